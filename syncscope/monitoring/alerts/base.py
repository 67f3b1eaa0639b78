"""What every alert's text is made from."""

from __future__ import annotations

from typing import Any, NamedTuple

from syncscope.thresholds import Alert, Level, Thresholds, Windows


class AlertInput(NamedTuple):
    """What an alert's text is made from: the thresholds, its own entry there, one severity
    level of it, that level's threshold, and the windows."""

    cfg: Thresholds
    a: Alert
    level: Level
    thr: Any
    w: Windows
