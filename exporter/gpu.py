"""GPU locality and state per rank, from the `topology` dict each agent sends (agent.topology).

Series exist only for ranks that reported a GPU (a UUID, PCI bus id or name); a number the
agent could not read (NVML "not supported", a VM without NUMA) is left out rather than sent as
0, so a missing reading never looks like a degraded link. Registered in collectors.COLLECTORS
as "gpu"; like every collector it gets the store's snapshot and yields metric families, built
from their specs in syncscope.catalog (collectors.py imports this module, so the families are
made here directly rather than through its helpers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from syncscope.exporter.store import StoreView, clean_label

from syncscope.catalog import CATALOG, GPU_ENERGY_JOULES_TOTAL, GPU_INFO, GPU_PREFIX, MetricSpec

UNKNOWN = "unknown"
# The topology keys behind GPU_INFO's own labels, in label order.
INFO_KEYS = ("gpu_uuid", "pci_bus_id", "gpu_name", "gpu_numa_node", "nic", "nic_distance")
# Every other GPU family is named GPU_PREFIX + the topology key it reports: gauges, and the
# energy counter (whose key has no "_total": its family's name).
GAUGES = tuple(s for s in CATALOG if s.condition == "gpu" and s is not GPU_INFO)
ENERGY_KEY = GPU_ENERGY_JOULES_TOTAL.family.removeprefix(GPU_PREFIX)


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


def collect_gpu(view: StoreView) -> Iterable[Metric]:
    info = GaugeMetricFamily(GPU_INFO.name, GPU_INFO.help, labels=GPU_INFO.labels)
    gauges = [_family(s) for s in GAUGES]
    for job, rank in view.ranks():
        topology = rank.topology
        if topology is None or not has_gpu(topology):
            continue
        labels = rank.label_values(job)
        try:
            info.add_metric(labels + [_text(topology, k) for k in INFO_KEYS], 1.0)
            for key, family in gauges:
                value = topology_number(topology.get(key))
                if value is not None:
                    family.add_metric(labels, value)
        except Exception:  # noqa: BLE001 - one odd rank must not cost the others their series
            continue
    return [info, *(family for _, family in gauges)]
