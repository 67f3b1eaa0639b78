"""GPU locality and state per rank, from the `topology` dict each agent sends (agent.topology).

Series exist only for ranks that reported a GPU (a UUID, PCI bus id or name); a number the
agent could not read (NVML "not supported", a VM without NUMA) is left out rather than sent as
0, so a missing reading never looks like a degraded link. Registered in collectors.COLLECTORS
as "gpu"; like every collector it gets the store's snapshot and yields metric families.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from syncscope.exporter.store import clean_label

RANK_LABELS = ["job", "rank", "local_rank"]
INFO_LABELS = ["gpu_uuid", "pci_bus_id", "name", "numa_node", "nic", "nic_distance"]
UNKNOWN = "unknown"

# metric name, topology key, help
GAUGES = (
    ("syncscope_gpu_pcie_link_width", "pcie_link_width", "Current PCIe link width (lanes)."),
    (
        "syncscope_gpu_pcie_link_max_width",
        "pcie_link_max_width",
        "Maximum PCIe link width the GPU and slot support (lanes).",
    ),
    (
        "syncscope_gpu_pcie_link_generation",
        "pcie_link_generation",
        "Current PCIe link generation, sampled while the GPU is busy.",
    ),
    (
        "syncscope_gpu_pcie_link_max_generation",
        "pcie_link_max_generation",
        "Maximum PCIe link generation the GPU and slot support.",
    ),
    (
        "syncscope_gpu_nvlink_active_links",
        "nvlink_active_links",
        "NVLink links up (absent where NVML reports NVLink as not supported).",
    ),
    (
        "syncscope_gpu_numa_mismatch",
        "numa_mismatch",
        "1 if the process may not run on the GPU's NUMA node, else 0.",
    ),
    ("syncscope_gpu_sm_clock_hertz", "sm_clock_hertz", "Current SM clock."),
    (
        "syncscope_gpu_throttle_reasons",
        "throttle_reasons",
        "NVML clocks-event reasons bitmask (0 = none; 0x1 GPU idle, 0x4 SW power cap, "
        "0x8 HW slowdown, 0x20 SW thermal, 0x40 HW thermal, 0x80 power brake).",
    ),
    ("syncscope_gpu_temperature_celsius", "temperature_celsius", "GPU core temperature."),
    ("syncscope_gpu_power_watts", "power_watts", "GPU board power draw."),
)


def _ranks(view: dict[str, Any]) -> Iterator[tuple[dict[str, Any], list[str]]]:
    for job, data in view.get("jobs", {}).items():
        for r in data.get("ranks", []):
            yield r, [job, str(r["rank"]), str(r["local_rank"])]


def _text(topology: dict[str, Any], key: str) -> str:
    value = topology.get(key)
    if value is None or value == "":
        return UNKNOWN
    return clean_label(str(value))


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def has_gpu(topology: dict[str, Any] | None) -> bool:
    if not isinstance(topology, dict):
        return False
    return any(_text(topology, k) != UNKNOWN for k in ("gpu_uuid", "pci_bus_id", "gpu_name"))


def collect_gpu(view: dict[str, Any]) -> Iterable[Metric]:
    info = GaugeMetricFamily(
        "syncscope_gpu_info",
        "The rank's GPU and its nearest NIC (value 1).",
        labels=RANK_LABELS + INFO_LABELS,
    )
    gauges = [(key, GaugeMetricFamily(name, doc, labels=RANK_LABELS)) for name, key, doc in GAUGES]
    for rank, labels in _ranks(view):
        topology = rank.get("topology")
        if not isinstance(topology, dict) or not has_gpu(topology):
            continue
        try:
            info.add_metric(
                labels
                + [
                    _text(topology, "gpu_uuid"),
                    _text(topology, "pci_bus_id"),
                    _text(topology, "gpu_name"),
                    _text(topology, "gpu_numa_node"),
                    _text(topology, "nic"),
                    _text(topology, "nic_distance"),
                ],
                1.0,
            )
            for key, family in gauges:
                value = _number(topology.get(key))
                if value is not None:
                    family.add_metric(labels, value)
        except Exception:  # noqa: BLE001 - one odd rank must not cost the others their series
            continue
    return [info, *(family for _, family in gauges)]
