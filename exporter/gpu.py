"""GPU locality and state per rank, from the `topology` dict each agent sends (agent.topology).

Series exist only for ranks that reported a GPU (a UUID, PCI bus id or name); a number the
agent could not read (NVML "not supported", a VM without NUMA) is left out rather than sent as
0, so a missing reading never looks like a degraded link. The fault flags and codes (the last
XID, a pending or failed row remapping) are written only where non-zero, as the locality faults
are: a healthy GPU costs no series for them (docs/scale.md, "Series per rank"). Registered in
collectors.COLLECTORS as "gpu"; like every collector it gets the store's snapshot and yields
metric families, built from their specs in syncscope.catalog (collectors.py imports this
module, so the families are made here directly rather than through its helpers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from syncscope.exporter.store import StoreView, clean_label

from syncscope.catalog import (
    CATALOG,
    GPU_ENERGY_JOULES_TOTAL,
    GPU_INFO,
    GPU_LOCALITY_FAULT,
    GPU_PREFIX,
    MetricSpec,
)

UNKNOWN = "unknown"
# The topology keys behind GPU_INFO's own labels, in label order.
INFO_KEYS = (
    "gpu_uuid",
    "pci_bus_id",
    "gpu_name",
    "gpu_numa_node",
    "process_numa_nodes",
    "nic",
    "nic_distance",
    "pcie_link_max_width",
    "pcie_link_max_generation",
)
# Every other GPU family but the locality faults is named GPU_PREFIX + the topology key it
# reports: gauges, and the energy counter (whose key has no "_total": its family's name).
GAUGES = tuple(
    s
    for s in CATALOG
    if s.condition in ("gpu", "gpu_fault") and s not in (GPU_INFO, GPU_LOCALITY_FAULT)
)
# A PCIe link below what the GPU and slot support: fault -> (current key, supported key, the
# prefix its values are said with: pcie_link_fault). The agent reports the current link as
# seen under load only where NVML's clock-event reasons say whether the GPU idles
# (agent.topology: an idle GPU trains its link down, and the agent keeps the last loaded
# reading); from sysfs alone it cannot tell. A narrower width is a fault either
# way (a link trains its speed down, rarely its width); a lower generation only where it was
# read under load (link_read_under_load).
PCIE_FAULTS = {
    "pcie_width": ("pcie_link_width", "pcie_link_max_width", "x"),
    "pcie_generation": ("pcie_link_generation", "pcie_link_max_generation", "gen "),
}
ENERGY_KEY = GPU_ENERGY_JOULES_TOTAL.family.removeprefix(GPU_PREFIX)
# Gauges with a series only where the reading is non-zero: a fault's code or flag.
NONZERO_ONLY = frozenset(
    s.name.removeprefix(GPU_PREFIX) for s in GAUGES if s.condition == "gpu_fault"
)


def _family(spec: MetricSpec) -> tuple[str, GaugeMetricFamily | CounterMetricFamily]:
    """(the topology key, an empty family) of one GPU spec."""
    if spec.type == "counter":
        counter = CounterMetricFamily(spec.family, spec.help, labels=spec.labels)
        return spec.family.removeprefix(GPU_PREFIX), counter
    return spec.name.removeprefix(GPU_PREFIX), GaugeMetricFamily(
        spec.name, spec.help, labels=spec.labels
    )


def _text(topology: Mapping[str, Any], key: str) -> str:
    value = topology.get(key)
    if value is None or value == "":
        return UNKNOWN
    return clean_label(str(value))


def topology_number(value: Any) -> float | None:
    """A topology field as a gauge value (booleans as 0/1); None where it is not a finite number."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def has_gpu(topology: Mapping[str, Any] | None) -> bool:
    if not isinstance(topology, Mapping):
        return False
    return any(_text(topology, k) != UNKNOWN for k in ("gpu_uuid", "pci_bus_id", "gpu_name"))


def link_read_under_load(topology: Mapping[str, Any]) -> bool:
    """Whether the GPU's current PCIe generation was read under load: NVML gave its clock-event
    reasons, by which the agent drops idle readings (without them nothing says so)."""
    return topology_number(topology.get("throttle_reasons")) is not None


def pcie_link_fault(topology: Mapping[str, Any], fault: str) -> str | None:
    """One PCIe link (a PCIE_FAULTS key) as the series, the diagnosis and the verdict all judge
    it: "PCIe link x8 of x16", "PCIe link gen 3 of gen 5" where it runs below what it supports;
    "" where it runs at that; None where either reading is missing or not a positive number, and
    for the generation where it was not read under load (link_read_under_load)."""
    current, supported, prefix = PCIE_FAULTS[fault]
    if fault == "pcie_generation" and not link_read_under_load(topology):
        return None
    now, most = topology_number(topology.get(current)), topology_number(topology.get(supported))
    if now is None or most is None or now <= 0 or most <= 0:
        return None
    return f"PCIe link {prefix}{int(now)} of {prefix}{int(most)}" if now < most else ""


def locality_faults(topology: Mapping[str, Any]) -> list[str]:
    """The GPU's locality faults (GPU_LOCALITY_FAULT's `fault` values); none where a reading is
    missing, so an unread link or placement never looks like a fault (pcie_link_fault)."""
    faults = [fault for fault in PCIE_FAULTS if pcie_link_fault(topology, fault)]
    if topology_number(topology.get("numa_mismatch")) == 1:
        faults.append("numa_mismatch")
    return faults


def _info_text(topology: Mapping[str, Any], key: str) -> str:
    """An info label's value: numbers as integers where they are ("16", not "16.0")."""
    value = topology_number(topology.get(key))
    if value is not None and value.is_integer():
        return str(int(value))
    return _text(topology, key)


def collect_gpu(view: StoreView) -> Iterable[Metric]:
    info = GaugeMetricFamily(GPU_INFO.name, GPU_INFO.help, labels=GPU_INFO.labels)
    faults = GaugeMetricFamily(
        GPU_LOCALITY_FAULT.name, GPU_LOCALITY_FAULT.help, labels=GPU_LOCALITY_FAULT.labels
    )
    gauges = [_family(s) for s in GAUGES]
    for job, rank in view.ranks():
        topology = rank.topology
        if topology is None or not has_gpu(topology):
            continue
        labels = rank.label_values(job)
        try:
            info.add_metric(labels + [_info_text(topology, k) for k in INFO_KEYS], 1.0)
            for fault in locality_faults(topology):
                faults.add_metric([*labels, fault], 1.0)
            for key, family in gauges:
                value = topology_number(topology.get(key))
                if value is not None and (value or key not in NONZERO_ONLY):
                    family.add_metric(labels, value)
        except Exception:  # noqa: BLE001 - one odd rank must not cost the others their series
            continue
    return [info, faults, *(family for _, family in gauges)]
