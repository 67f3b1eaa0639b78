"""The GPU collector end to end on CPU: fixture topologies -> a validated batch -> the real store
-> collect_gpu -> exposition text, diffed against a golden file and checked by promtool."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from syncscope.agent.topology import DeviceLocator, TopologySampler
from syncscope.exporter.app import parse_batch
from syncscope.exporter.diagnosis import snapshot
from syncscope.exporter.gpu import collect_gpu, locality_faults
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import Store

from tests.fixtures.gpu import HERE, load_case

GOLDEN = HERE / "expected-gpu-metrics.prom"
CONTRACT = Path(__file__).resolve().parents[2] / "deploy" / "metrics-contract.txt"


def topology(case: str, tmp_path: Path) -> dict:
    device, sysfs = load_case(case, tmp_path / case)
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="x"), open_nvml=lambda _l: device, sysfs=sysfs
    )
    return sampler()


def batch(rank: int, topo: dict | None) -> bytes:
    return json.dumps(
        {
            "schema_version": 1,
            "agent": {
                "job": "train",
                "rank": rank,
                "local_rank": rank,
                "world_size": 3,
                "incarnation": f"i{rank}",
                "hostname": "gpu-node-7",
            },
            "steps": [
                {"step": 0, "duration_s": 0.03, "end_unix_s": 1.7e9, "phases": {"forward": 0.01}}
            ],
            "topology": topo,
        },
        allow_nan=False,
    ).encode()


class ViewCollector:
    def __init__(self, store: Store) -> None:
        self.store = store

    def collect(self):
        return collect_gpu(snapshot(self.store))


@pytest.fixture
def store(tmp_path) -> Store:
    store = Store(Settings())
    store.ingest(parse_batch(batch(0, topology("captured-h100", tmp_path))))
    store.ingest(parse_batch(batch(1, topology("degraded", tmp_path))))
    store.ingest(parse_batch(batch(2, None)))  # a CPU-only rank
    return store


def render(store: Store) -> str:
    registry = CollectorRegistry()
    registry.register(ViewCollector(store))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def test_exposition_matches_the_golden_file(store):
    text = render(store)
    if os.environ.get("SYNCSCOPE_UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def faults(text: str) -> set[tuple[str, str]]:
    """(rank, fault) of every locality-fault series in the exposition."""
    return {
        (s.labels["rank"], s.labels["fault"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "syncscope_gpu_locality_fault"
    }


@pytest.mark.parametrize(
    ("topology", "expected"),
    [
        ({"pcie_link_width": 16, "pcie_link_max_width": 16, "numa_mismatch": 0}, []),
        ({"pcie_link_width": 8, "pcie_link_max_width": 16}, ["pcie_width"]),
        (
            {"pcie_link_generation": 4, "pcie_link_max_generation": 5, "throttle_reasons": 0},
            ["pcie_generation"],
        ),
        # a generation not known to be read under load (no clock-event reasons: sysfs alone)
        ({"pcie_link_generation": 4, "pcie_link_max_generation": 5}, []),
        ({"numa_mismatch": True}, ["numa_mismatch"]),
        # a reading missing (an idle GPU's link is not reported) or unread is no fault
        ({"pcie_link_width": None, "pcie_link_max_width": 16, "numa_mismatch": None}, []),
        ({"pcie_link_width": 0, "pcie_link_max_width": 16}, []),
        (
            {
                "pcie_link_width": 4,
                "pcie_link_max_width": 16,
                "pcie_link_generation": 1,
                "pcie_link_max_generation": 4,
                "numa_mismatch": 1,
                "throttle_reasons": 0x4,
            },
            ["pcie_width", "pcie_generation", "numa_mismatch"],
        ),
    ],
)
def test_locality_faults_compare_the_link_under_load_with_what_is_supported(topology, expected):
    assert locality_faults(topology) == expected


def samples(text: str, name: str) -> dict[str, dict]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["rank"]] = {**s.labels, "value": s.value}
    return out


def test_series_per_rank(store):
    text = render(store)
    info = samples(text, "syncscope_gpu_info")
    assert set(info) == {"0", "1"}  # the CPU-only rank has no GPU series at all
    assert info["0"]["name"] == "NVIDIA H100 80GB HBM3"
    assert (info["0"]["nic"], info["0"]["nic_distance"], info["0"]["numa_node"]) == (
        "eth0",
        "unknown",
        "0",
    )
    assert (info["1"]["nic"], info["1"]["nic_distance"]) == ("mlx5_1", "same_pcie_switch")
    assert info["1"]["pci_bus_id"] == "0000:1b:00.0"
    width = samples(text, "syncscope_gpu_pcie_link_width")
    # the H100 was captured idle (clocks-event reason 0x1): no current link until seen under load
    assert set(width) == {"1"} and width["1"]["value"] == 8
    # what the GPU and slot support is a label of its info series, not a series of its own
    assert (info["0"]["pcie_link_max_width"], info["0"]["pcie_link_max_generation"]) == ("16", "5")
    assert (info["1"]["numa_node"], info["1"]["process_numa_nodes"]) == ("1", "0")
    # faults: a series each only where a GPU has one (rank 1: x8 of x16, off its NUMA node)
    assert faults(text) == {("1", "pcie_width"), ("1", "numa_mismatch")}
    # NVLink "not supported" in the VM: no series rather than a misleading 0
    assert set(samples(text, "syncscope_gpu_nvlink_active_links")) == {"1"}
    assert samples(text, "syncscope_gpu_sm_clock_hertz")["1"]["value"] == 1.41e9
    assert samples(text, "syncscope_gpu_power_watts")["1"]["value"] == pytest.approx(698.5)


def test_xid_and_ecc_series_where_nvml_read_them_and_none_where_it_did_not(tmp_path):
    """Counters where read, zero included; the last XID and the row-remap flags only where
    non-zero (a healthy GPU costs no series for them)."""
    topo = topology("degraded", tmp_path)
    topo.update(
        xid_errors=2,
        last_xid=79,
        ecc_uncorrected_errors=3,
        row_remap_pending=1,
        row_remap_failure=0,
    )
    store = Store(Settings())
    store.ingest(parse_batch(batch(0, topo)))
    store.ingest(parse_batch(batch(1, topology("captured-h100", tmp_path))))  # not read
    text = render(store)
    for name, value in (
        ("syncscope_gpu_xid_errors_total", 2),
        ("syncscope_gpu_last_xid", 79),
        ("syncscope_gpu_ecc_uncorrected_errors_total", 3),
        ("syncscope_gpu_row_remap_pending", 1),
    ):
        series = samples(text, name)
        assert set(series) == {"0"} and series["0"]["value"] == value, name
    assert samples(text, "syncscope_gpu_row_remap_failure") == {}
    # rank 1 read none of them; a read zero count is a series, a zero flag or code is not
    healthy = topology("degraded", tmp_path / "healthy")
    healthy.update(xid_errors=0, last_xid=0, row_remap_pending=0, row_remap_failure=0)
    store = Store(Settings())
    store.ingest(parse_batch(batch(0, healthy)))
    text = render(store)
    assert samples(text, "syncscope_gpu_xid_errors_total")["0"]["value"] == 0
    for name in ("last_xid", "row_remap_pending", "row_remap_failure"):
        assert samples(text, f"syncscope_gpu_{name}") == {}, name


def test_families_and_labels_are_the_contracts_gpu_lines(store):
    contract = {}
    for line in CONTRACT.read_text().splitlines():
        parts = line.split()
        if len(parts) == 4 and not line.startswith("#") and parts[3] == "gpu":
            contract[parts[0]] = set(parts[2].split(","))
    emitted = {}
    for family in text_string_to_metric_families(render(store)):
        for s in family.samples:
            emitted[s.name] = set(s.labels)
    assert emitted == contract


def test_odd_topologies_never_fail_the_collector(store):
    # Topologies ingest would refuse (infinities, overlong text) laid over a real CPU rank's view.
    view = snapshot(store)
    cpu = view.jobs["train"].ranks[2]
    odd = {
        "gpu_uuid": "GPU-1",
        "pcie_link_width": "sixteen",
        "temperature_celsius": float("inf"),
        "numa_mismatch": True,
        "nic": "x" * 300,
    }
    ranks = tuple(
        replace(cpu, rank=i, local_rank=i, topology=topology)
        for i, topology in enumerate([None, {"gpu_uuid": "unknown"}, odd])
    )
    view = replace(view, jobs={"j": replace(view.jobs["train"], ranks=ranks, name="j")})
    families = {f.name: f for f in collect_gpu(view)}
    assert [s.labels["rank"] for s in families["syncscope_gpu_info"].samples] == ["2"]
    assert families["syncscope_gpu_pcie_link_width"].samples == []
    assert families["syncscope_gpu_temperature_celsius"].samples == []
    assert [
        (s.labels["rank"], s.labels["fault"], s.value)
        for s in families["syncscope_gpu_locality_fault"].samples
    ] == [("2", "numa_mismatch", 1.0)]
    assert len(families["syncscope_gpu_info"].samples[0].labels["nic"]) <= 64


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promtool_accepts_the_exposition(store):
    result = subprocess.run(
        ["promtool", "check", "metrics"],
        input=render(store),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr
