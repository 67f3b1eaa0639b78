"""Alerts of this area (promtool tests: deploy/prometheus/tests/fabric.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import pct
from syncscope.recorded import CONTENTION, CONTENTION_COST, LINK_CAPACITY_RATIO
from syncscope.thresholds import Thresholds, required


def contention_floor(cfg: Thresholds) -> float:
    """The share of each rank's time a transfer's excess must cost for the alert to fire."""
    return float(
        required(
            cfg.alerts["SyncscopeFabricContention"].min_cost_share,
            "alerts.SyncscopeFabricContention.min_cost_share",
        )
    )


def fabric_contention_text(alert: AlertInput) -> dict[str, Any]:
    threshold, windows = alert.threshold, alert.windows
    floor = contention_floor(alert.cfg)
    return {
        # DDP's gradient sync has no cost series (its index is per step already): kept.
        "expr": (
            f"{CONTENTION} > {threshold}\nunless on (job, op, group)\n  {CONTENTION_COST} < {floor}\n"
        ),
        "summary": (
            "{{ $labels.op }} on group {{ $labels.group }} of job {{ $labels.job }} "
            "transfers slower than its own baseline."
        ),
        "description": (
            "The transfer of {{ $labels.op }} on group {{ $labels.group }} of job "
            "{{ $labels.job }} (after the last rank arrives) takes "
            '{{ printf "%.2f" $value }} times its 10th percentile of the last '
            f"{windows.contention_baseline} (threshold {threshold}; an excess that costs each rank less "
            f"than {pct(floor)} of its time does not alert): the "
            "time goes to the fabric (queueing on shared links), not to waiting for peers."
        ),
    }


def slow_link_text(alert: AlertInput) -> dict[str, Any]:
    threshold = alert.threshold
    return {
        "expr": f"{LINK_CAPACITY_RATIO} < {threshold}",
        "summary": "The link of node {{ $labels.node }} is slow for job {{ $labels.job }}.",
        "description": (
            "Node {{ $labels.node }} of job {{ $labels.job }} has a link known to carry "
            "{{ $value | humanizePercentage }} of what the job's median node's does "
            f"(threshold {pct(threshold)}; negotiated speed or shaping, "
            f"{M.NODE_LINK_CAPACITY_BYTES_PER_SECOND.name}). Every collective of the job "
            "moves at the pace of its slowest link."
        ),
    }
