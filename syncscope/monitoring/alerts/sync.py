"""Alerts of this area (promtool tests: deploy/prometheus/tests/sync.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import THIS_JOB, listing, pct
from syncscope.recorded import STRAGGLER_RATIO, SYNC_AMPLIFICATION


def straggler_text(alert: AlertInput) -> dict[str, Any]:
    thr, w = alert.thr, alert.w
    straggler = listing(
        f"{STRAGGLER_RATIO}{{{THIS_JOB}}}",
        "{{ $s.Labels.rank }} (node {{ $s.Labels.node }})",
        "rank",
        limit=3,
    )
    return {
        "expr": f"max by (job) ({STRAGGLER_RATIO}) > {thr}",
        "summary": f"Job {{{{ $labels.job }}}} has a straggler: rank {straggler}.",
        "description": (
            f"Rank {straggler} of job {{{{ $labels.job }}}} arrives at collectives last, "
            "{{ $value | humanizePercentage }} of a step after the earliest rank (threshold "
            f"{pct(thr)}, averaged over {w['straggler']}). Every other rank waits for it; "
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
