"""Alerts of this area (promtool tests: deploy/prometheus/tests/sync.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import THIS_JOB, listing, pct, sel
from syncscope.recorded import SKEW, STRAGGLER_RATIO, SYNC_AMPLIFICATION


def straggler_text(alert: AlertInput) -> dict[str, Any]:
    threshold, windows = alert.threshold, alert.windows
    straggler = listing(
        f"{STRAGGLER_RATIO}{{{THIS_JOB}}}",
        "{{ $s.Labels.rank }} (node {{ $s.Labels.node }})",
        "rank",
        limit=3,
    )
    # The exporter's floor too (diagnosis.skew_floor_s): a lag of a step's share that is a
    # few milliseconds of a short step is jitter or a pipeline's uneven stages, and the
    # exporter names no straggler there; the alert and the exporter agree.
    floor = alert.cfg.diagnosis.skew_floor_s
    return {
        "expr": f"max by (job) ({STRAGGLER_RATIO}) > {threshold} and on (job) {SKEW} > {floor:g}",
        "summary": f"Job {{{{ $labels.job }}}} has a straggler: rank {straggler}.",
        "description": (
            f"Rank {straggler} of job {{{{ $labels.job }}}} arrives at collectives last, "
            "{{ $value | humanizePercentage }} of a step after the earliest rank (threshold "
            f"{pct(threshold)} and {floor * 1e3:g} ms, averaged over {windows.straggler}). Every other "
            "rank waits for it; "
            f"{M.STRAGGLER_CAUSE.name} names the suspected cause."
        ),
    }


def sync_amplification_text(alert: AlertInput) -> dict[str, Any]:
    threshold = alert.threshold
    return {
        "expr": f"{SYNC_AMPLIFICATION} > {threshold}",
        "summary": (
            "Ranks of job {{ $labels.job }} spend {{ $value | humanizePercentage }} "
            "of their step time waiting for peers."
        ),
        "description": (
            "Ranks of job {{ $labels.job }} spend {{ $value | humanizePercentage }} of their "
            "step time waiting at collectives for the last peer to arrive (threshold "
            f"{pct(threshold)}). Local jitter is being amplified into job-wide idle time."
        ),
    }


def structural_coupling_text(alert: AlertInput) -> dict[str, Any]:
    # Every exporter of the job that gives a verdict says coupling with its hardware known
    # healthy: one that says infrastructure, or cannot tell (no GPU telemetry), keeps it silent.
    healthy = sel(alert.cfg, M.JOB_VERDICT.name, 'verdict="coupling"', 'hardware="healthy"')
    other = sel(alert.cfg, M.JOB_VERDICT.name, 'hardware!="healthy"')
    score = alert.cfg.diagnosis.verdict_score
    modes = listing(
        f"max by (mode) ({M.DIAGNOSIS.name}{{{THIS_JOB}}}) >= {score:g}",
        "{{ $s.Labels.mode }}",
        "mode",
        # the verdict's other trigger, which no failure mode scores
        empty="no failure mode, throughput per GPU below its own baseline",
    )
    return {
        "expr": f"count by (job) ({healthy})\nunless on (job) {other}\n",
        "summary": "Job {{ $labels.job }} loses time to structural coupling, not infrastructure.",
        "description": (
            "The exporters of job {{ $labels.job }} ({{ $value }} with a verdict) find it "
            f"losing time to its coupling (detected: {modes}) while every hardware check they "
            "can make passes: no GPU slowed by throttling, PCIe links at full width and "
            "generation, processes on their GPU's NUMA node, no hardware XID or uncorrected ECC errors, "
            "no slow link between nodes. More or other hardware will not buy this time back. "
            "The evidence (modes, their share of step time, a fall against the job's own "
            "throughput, the checks passed) is in each exporter's /v1/state and status page."
        ),
    }
