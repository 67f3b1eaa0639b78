"""Alerts of this area (promtool tests: deploy/prometheus/tests/sync.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import THIS_JOB, listing, pct
from syncscope.recorded import SKEW, STRAGGLER_RATIO, SYNC_AMPLIFICATION


def straggler_text(alert: AlertInput) -> dict[str, Any]:
    thr, w = alert.thr, alert.w
    straggler = listing(
        f"{STRAGGLER_RATIO}{{{THIS_JOB}}}",
        "{{ $s.Labels.rank }} (node {{ $s.Labels.node }})",
        "rank",
        limit=3,
    )
    # The exporter's floor too (diagnosis.skew_floor_s): a lag of a step's share that is a
    # few milliseconds of a short step is jitter or a pipeline's uneven stages, and the
    # exporter names no straggler there; the alert and the exporter agree.
    floor = alert.cfg["diagnosis"]["skew_floor_s"]
    return {
        "expr": f"max by (job) ({STRAGGLER_RATIO}) > {thr} and on (job) {SKEW} > {floor:g}",
        "summary": f"Job {{{{ $labels.job }}}} has a straggler: rank {straggler}.",
        "description": (
            f"Rank {straggler} of job {{{{ $labels.job }}}} arrives at collectives last, "
            "{{ $value | humanizePercentage }} of a step after the earliest rank (threshold "
            f"{pct(thr)} and {floor * 1e3:g} ms, averaged over {w['straggler']}). Every other "
            "rank waits for it; "
            f"{M.STRAGGLER_CAUSE.name} names the suspected cause."
        ),
    }


def sync_amplification_text(alert: AlertInput) -> dict[str, Any]:
    thr = alert.thr
    return {
        "expr": f"{SYNC_AMPLIFICATION} > {thr}",
        "summary": (
            "Ranks of job {{ $labels.job }} spend {{ $value | humanizePercentage }} "
            "of their step time waiting for peers."
        ),
        "description": (
            "Ranks of job {{ $labels.job }} spend {{ $value | humanizePercentage }} of their "
            "step time waiting at collectives for the last peer to arrive (threshold "
            f"{pct(thr)}). Local jitter is being amplified into job-wide idle time."
        ),
    }
