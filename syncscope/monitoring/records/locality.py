"""Recording rules of this area (promtool tests: deploy/prometheus/tests/locality.test.yml):
each rank's GPU locality faults (PCIe link below its maximum, NUMA mismatch), as the exporters
write them."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import sel
from syncscope.monitoring.records.base import record
from syncscope.recorded import LOCALITY_FAULT
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        # One series (value 1) per (rank, fault) that has it: the exporter writes the faults
        # (exporter.gpu.locality_faults) and healthy GPUs nothing, so this reads no series per
        # healthy rank (three 0/1 series per rank were the costliest rule at 1024 × 8, and the
        # gauges it compared cost three series per rank).
        record(
            LOCALITY_FAULT,
            f"max by (job, node, rank, fault) ({sel(cfg, M.GPU_LOCALITY_FAULT.name)})",
        ),
    ]
