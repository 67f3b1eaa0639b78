"""Recording rules of this area (promtool tests: deploy/prometheus/tests/locality.test.yml):
each rank's GPU locality faults (PCIe link below its maximum, NUMA mismatch)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import sel
from syncscope.monitoring.records.base import record
from syncscope.recorded import LOCALITY_FAULT
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        # One series (value 1) per (rank, fault) that has it: healthy GPUs write nothing
        # (three 0/1 series per rank were the costliest rule at 1024 × 8).
        record(
            LOCALITY_FAULT,
            f"""
max by (job, node, rank, fault) (
    label_replace(
      0 * ({sel(cfg, M.GPU_PCIE_LINK_WIDTH.name)} < {sel(cfg, M.GPU_PCIE_LINK_MAX_WIDTH.name)}) + 1,
      "fault", "pcie_width", "", ""
    )
  or
    label_replace(
      0 * ({sel(cfg, M.GPU_PCIE_LINK_GENERATION.name)} < {sel(cfg, M.GPU_PCIE_LINK_MAX_GENERATION.name)}) + 1,
      "fault", "pcie_generation", "", ""
    )
  or
    label_replace(0 * ({sel(cfg, M.GPU_NUMA_MISMATCH.name)} > 0) + 1, "fault", "numa_mismatch", "", "")
)
""",
        ),
    ]
