"""What every alert's text is made from."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class AlertInput(NamedTuple):
    """What an alert's text is made from: the thresholds, its own entry there, one severity
    level of it, that level's threshold, and the windows."""

    cfg: Mapping[str, Any]
    a: Mapping[str, Any]
    level: Mapping[str, Any]
    thr: Any
    w: Mapping[str, Any]
