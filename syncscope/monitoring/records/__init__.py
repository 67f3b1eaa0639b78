"""Syncscope's recording rules: the cluster-wide view one node cannot compute, one module per
area that mirrors the promtool test files (deploy/prometheus/tests/<area>.test.yml). The series'
names are declared once in syncscope.recorded; rules.rule_groups puts the rules in their groups.

    from syncscope.monitoring.records import recording_rules
    names = [r["record"] for r in recording_rules(load_config())]
"""

from __future__ import annotations

from typing import Any

from syncscope.monitoring.records import (
    fabric,
    goodput,
    health,
    locality,
    pacing,
    step,
    sync,
    trends,
    work,
)
from syncscope.thresholds import Thresholds

__all__ = ["AREAS", "recording_rules"]

# In this order: within a group a later rule reads an earlier one's result of the same evaluation.
AREAS = (health, step, sync, fabric, pacing, locality, work, goodput, trends)


def recording_rules(cfg: Thresholds) -> list[dict[str, Any]]:
    """Every recording rule, the areas' in AREAS order."""
    return [rule for area in AREAS for rule in area.records(cfg)]
