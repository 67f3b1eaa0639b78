"""Alerts of this area (promtool tests: deploy/prometheus/tests/fabric.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import pct
from syncscope.recorded import CONTENTION, LINK_CAPACITY_RATIO


def fabric_contention_text(alert: AlertInput) -> dict[str, Any]:
    thr, w = alert.thr, alert.w
    return {
        "expr": f"{CONTENTION} > {thr}",
        "summary": (
            "{{ $labels.op }} on group {{ $labels.group }} of job {{ $labels.job }} "
            "transfers slower than its own baseline."
        ),
        "description": (
            "The transfer of {{ $labels.op }} on group {{ $labels.group }} of job "
            "{{ $labels.job }} (after the last rank arrives) takes "
            '{{ printf "%.2f" $value }} times its 10th percentile of the last '
            f"{w.contention_baseline} (threshold {thr}): the time goes to the fabric "
            "(queueing on shared links), not to waiting for peers."
        ),
    }


def slow_link_text(alert: AlertInput) -> dict[str, Any]:
    thr = alert.thr
    return {
        "expr": f"{LINK_CAPACITY_RATIO} < {thr}",
        "summary": "The link of node {{ $labels.node }} is slow for job {{ $labels.job }}.",
        "description": (
            "Node {{ $labels.node }} of job {{ $labels.job }} has a link known to carry "
            "{{ $value | humanizePercentage }} of what the job's median node's does "
            f"(threshold {pct(thr)}; negotiated speed or shaping, "
            f"{M.NODE_LINK_CAPACITY_BYTES_PER_SECOND.name}). Every collective of the job "
            "moves at the pace of its slowest link."
        ),
    }
