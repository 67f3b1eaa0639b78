"""Alerts of this area (promtool tests: deploy/prometheus/tests/locality.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import THIS_JOB, listing
from syncscope.recorded import LOCALITY_FAULT


def locality_fault_text(alert: AlertInput) -> dict[str, Any]:
    faults = listing(
        f"{LOCALITY_FAULT}{{{THIS_JOB}}}",
        "rank {{ $s.Labels.rank }} on {{ $s.Labels.node }} {{ $s.Labels.fault }}",
        "rank",
    )
    return {
        "expr": f"count by (job) (max by (job, node, rank) ({LOCALITY_FAULT}))",
        "summary": (
            "The GPUs of {{ $value }} rank(s) in job {{ $labels.job }} have a locality fault."
        ),
        "description": (
            f"GPUs of job {{{{ $labels.job }}}} report locality faults ({faults}): a PCIe "
            "link below its maximum width (pcie_width) or generation (pcie_generation), or a "
            "process on another NUMA node than its GPU (numa_mismatch). Their transfers cost "
            "more than their peers', which makes those ranks likely stragglers."
        ),
    }
