"""Recording rules of this area (promtool tests: deploy/prometheus/tests/pacing.test.yml): the
ranks pacing now and the share of rank-time spent in pacing delays."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import STEP_SECONDS_SUM, rate, sel
from syncscope.monitoring.records.base import record
from syncscope.recorded import PACING_ACTIVE, PACING_RATIO, STEPS_RATE
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        # Ranks pacing in a job that still steps: the exporter keeps a rank's last gauge until
        # it expires the rank, long after the job ended.
        record(
            PACING_ACTIVE,
            f"sum by (job) ({sel(cfg, M.PACING_ACTIVE.name)}) and on (job) ({STEPS_RATE} > 0)",
        ),
        record(
            PACING_RATIO,
            f"""
  sum by (job) ({rate(cfg, M.PACING_DELAY_SECONDS_TOTAL.name)})
/
  sum by (job) ({rate(cfg, STEP_SECONDS_SUM)})
""",
        ),
    ]
