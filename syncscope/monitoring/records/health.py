"""Recording rules of this area (promtool tests: deploy/prometheus/tests/health.test.yml): the
job's size and the ranks known to an exporter."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import sel
from syncscope.monitoring.records.base import record
from syncscope.recorded import RANKS_REPORTING, WORLD_SIZE
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        record(WORLD_SIZE, f"max by (job) ({sel(cfg, M.WORLD_SIZE.name)})"),
        record(
            RANKS_REPORTING,
            f"count by (job) ({sel(cfg, M.RANK_LAST_REPORT_TIMESTAMP_SECONDS.name)})",
        ),
    ]
