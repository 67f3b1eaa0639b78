"""One recording rule as the rule file writes it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from syncscope.monitoring.promql import block


def record(name: str, expr: str, labels: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{record: name, expr: expr}`` (and ``labels`` where given), ``expr`` laid out by `block`."""
    rule: dict[str, Any] = {"record": name, "expr": block(expr)}
    if labels:
        rule["labels"] = dict(labels)
    return rule
