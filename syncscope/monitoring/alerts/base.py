"""What every alert's text is made from."""

from __future__ import annotations

from typing import Any, NamedTuple

from syncscope.thresholds import Alert, Level, Thresholds, Windows


class AlertInput(NamedTuple):
    """What an alert's text is made from: the thresholds, the alert's own entry there, one
    severity level of it, that level's threshold, and the windows."""

    cfg: Thresholds
    entry: Alert
    level: Level
    threshold: Any
    windows: Windows
