"""Recording rules of this area (promtool tests: deploy/prometheus/tests/trends.test.yml, whose
rules run every 5m: its cases span days): a job's trends over days, against its own first day."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import sel
from syncscope.monitoring.records.base import record
from syncscope.recorded import (
    RESTARTS,
    RESTARTS_PER_DAY,
    SAMPLES_PER_GPU,
    SAMPLES_PER_GPU_PER_DAY,
    STEP_CV,
    STEP_CV_PER_DAY,
    STEPS_RATE,
    STEPS_RATE_PER_DAY,
)
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    """Per day (windows.trend), for panels over the job's life: its restarts (the per-node
    counters summed first, so the day's increase reads one series a job), and the day's mean
    step-time CV and throughput per GPU from series already recorded per job. A day not yet
    full averages what it has."""
    restarts = M.NODE_RESTARTS_TOTAL.name
    day = cfg.windows.trend
    return [
        record(RESTARTS, f"sum by (job) ({sel(cfg, restarts)})"),
        record(RESTARTS_PER_DAY, f"increase({RESTARTS}[{day}])"),
        record(STEP_CV_PER_DAY, f"avg_over_time({STEP_CV}[{day}])"),
        record(SAMPLES_PER_GPU_PER_DAY, f"avg_over_time({SAMPLES_PER_GPU}[{day}])"),
        record(STEPS_RATE_PER_DAY, f"avg_over_time({STEPS_RATE}[{day}])"),
    ]
