"""Recording rules of this area (promtool tests: deploy/prometheus/tests/step.test.yml): the
job's step rate, mean, quantiles, jitter band and step-time CV."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import (
    STEP_SECONDS_BUCKET,
    STEP_SECONDS_COUNT,
    STEP_SECONDS_SUM,
    rate,
    sel,
)
from syncscope.monitoring.records.base import record
from syncscope.recorded import (
    JITTER_QUANTILES,
    STEP_BUCKET_RATE,
    STEP_CV,
    STEP_JITTER,
    STEP_MEAN,
    STEP_OUTLIER_QUANTILE,
    STEP_QUANTILE,
    STEP_RATIO_BUCKET_RATE,
    STEPS_RATE,
)
from syncscope.thresholds import Thresholds, required

RATIO_BUCKET = M.STEP_DURATION_RATIO.name + "_bucket"


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    # The CV alert's quantiles over its own (long) window, recorded once for both severities.
    o = required(cfg.alerts["SyncscopeStepTimeCVHigh"].outliers, "outliers")
    rules: list[dict[str, Any]] = [
        # Synchronous ranks share one step rate; the average is robust to a rank that
        # briefly reports late.
        record(STEPS_RATE, f"avg by (job) ({rate(cfg, M.STEPS_TOTAL.name)})"),
        record(
            STEP_MEAN,
            f"""
  sum by (job) ({rate(cfg, STEP_SECONDS_SUM)})
/
  sum by (job) ({rate(cfg, STEP_SECONDS_COUNT)})
""",
        ),
    ]
    # Every rule reads the job's buckets once (each quantile re-reading every node's
    # buckets cost three passes over the largest family).
    rules.append(record(STEP_BUCKET_RATE, f"sum by (job, le) ({rate(cfg, STEP_SECONDS_BUCKET)})"))
    for q in cfg.step_quantiles:
        rules.append(
            record(
                STEP_QUANTILE, f"histogram_quantile({q}, {STEP_BUCKET_RATE})", {"quantile": str(q)}
            )
        )
    for q in o.quantiles:
        rules.append(
            record(
                STEP_OUTLIER_QUANTILE,
                f"histogram_quantile({q}, sum by (job, le) "
                f"({rate(cfg, STEP_SECONDS_BUCKET, window=o.window)}))",
                {"quantile": str(q)},
            )
        )
    # Jitter: steps over their rank's median step, so 10 % shows alike at 10 ms and 10 s steps.
    rules.append(record(STEP_RATIO_BUCKET_RATE, f"sum by (job, le) ({rate(cfg, RATIO_BUCKET)})"))
    for q in JITTER_QUANTILES:
        rules.append(
            record(
                STEP_JITTER,
                f"histogram_quantile({q}, {STEP_RATIO_BUCKET_RATE})",
                {"quantile": str(q)},
            )
        )
    # The noisiest rank: in lockstep training every rank sees the same step times, so
    # a max that stands out points at the exporter side, not at the job.
    rules.append(record(STEP_CV, f"max by (job) ({sel(cfg, M.STEP_TIME_CV.name)})"))
    return rules
