"""The link a rank communicates over (agent/link.py), the exporter's per-node link series, and
the slow-link verdict the exporter takes from Prometheus's job-wide view (issue 16)."""

from __future__ import annotations

import json
import time

from prometheus_client.parser import text_string_to_metric_families
from syncscope.agent.link import (
    LinkSampler,
    comm_interface,
    default_route_interface,
    shaped_rate_bytes,
    with_link,
)
from syncscope.exporter.diagnosis import diagnose_job
from syncscope.exporter.jobwide import JobWide
from syncscope.exporter.settings import Settings

from tests.unit import test_exporter_app as app_tests
from tests.unit.test_jobwide import two_of_four

client = app_tests.client  # the exporter in-process, lifespan included

ROUTES = (
    "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
    "eth1\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\n"
    "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\n"
)
PRESENT = ["eth0", "eth1", "ib0", "lo"]
TBF = json.dumps([{"kind": "tbf", "handle": "8002:", "root": True, "options": {"rate": 12500000}}])


def test_the_interface_is_the_one_the_process_group_was_told_to_use():
    assert comm_interface({"GLOO_SOCKET_IFNAME": "eth1"}, PRESENT, ROUTES) == "eth1"
    # GLOO first, then NCCL; NCCL's prefix, exact (=) and exclusion (^) forms.
    assert comm_interface({"NCCL_SOCKET_IFNAME": "ib"}, PRESENT, ROUTES) == "ib0"
    assert comm_interface({"NCCL_SOCKET_IFNAME": "=eth1,eth0"}, PRESENT, ROUTES) == "eth1"
    assert comm_interface({"NCCL_SOCKET_IFNAME": "^eth,ib"}, PRESENT, ROUTES) is None
    assert comm_interface({"NCCL_SOCKET_IFNAME": "^ib"}, PRESENT, ROUTES) == "eth0"
    assert comm_interface({"NCCL_SOCKET_IFNAME": "wlan"}, PRESENT, ROUTES) is None
    # Unset: the default route's interface.
    assert comm_interface({}, PRESENT, ROUTES) == "eth0"
    assert default_route_interface(ROUTES.splitlines()[0]) is None


def test_a_tbf_root_qdisc_is_the_shaped_rate_and_nothing_else_is():
    assert shaped_rate_bytes(TBF) == 12.5e6
    assert shaped_rate_bytes('[{"kind": "fq_codel", "root": true, "options": {}}]') is None
    assert shaped_rate_bytes('[{"kind": "tbf", "root": false, "options": {"rate": 5}}]') is None
    assert shaped_rate_bytes("not json") is None


def _sysfs(tmp_path, name: str, speed: str, tx: int, rx: int):
    base = tmp_path / "net"
    stats = base / name / "statistics"
    stats.mkdir(parents=True)
    (base / name / "speed").write_text(speed + "\n")
    (stats / "tx_bytes").write_text(f"{tx}\n")
    (stats / "rx_bytes").write_text(f"{rx}\n")
    return base


def test_the_sampler_reports_the_least_known_capacity_and_fresh_counters(tmp_path):
    base = _sysfs(tmp_path, "node1", "10000", 100, 200)
    asked = []

    def tc(ifname: str) -> str:
        asked.append(ifname)
        return TBF

    sampler = LinkSampler({"GLOO_SOCKET_IFNAME": "node1"}, sys_class_net=str(base), tc_qdisc=tc)
    first = sampler()
    assert first == {
        "link_interface": "node1",
        "link_speed_bytes_per_second": 1.25e9,
        "link_shaped_bytes_per_second": 12.5e6,
        "link_capacity_bytes_per_second": 12.5e6,  # the shaping, not veth's nominal 10 Gbit/s
        "link_tx_bytes": 100,
        "link_rx_bytes": 200,
    }
    (base / "node1" / "statistics" / "tx_bytes").write_text("5000\n")
    assert sampler()["link_tx_bytes"] == 5000
    assert asked == ["node1"]  # tc runs once, at start; counters are read at every flush


def test_without_a_known_interface_or_speed_the_sampler_says_nothing_and_never_raises(tmp_path):
    base = _sysfs(tmp_path, "eth0", "-1", 1, 2)  # virtio and some VMs report -1
    unknown = LinkSampler(
        {"GLOO_SOCKET_IFNAME": "eth0"}, sys_class_net=str(base), tc_qdisc=lambda _: None
    )
    assert "link_capacity_bytes_per_second" not in unknown()
    assert unknown()["link_tx_bytes"] == 1
    assert LinkSampler({"GLOO_SOCKET_IFNAME": "nope"}, sys_class_net=str(base))() == {}

    def broken(_: str) -> str:
        raise RuntimeError("tc crashed")

    assert (
        LinkSampler({"GLOO_SOCKET_IFNAME": "eth0"}, sys_class_net=str(base), tc_qdisc=broken)()
        == {}
    )
    # The reporter's topology: the GPU sampler's dict (None on CPU) with the link facts.
    assert with_link(None, LinkSampler({}, sys_class_net=str(tmp_path / "none")))() is None
    merged = with_link(lambda: {"gpu_uuid": "GPU-1"}, unknown)()
    assert (
        merged is not None and merged["gpu_uuid"] == "GPU-1" and merged["link_interface"] == "eth0"
    )


def test_each_node_exports_its_link_once_from_its_ranks_reports(client):
    for rank, tx in ((0, 1000), (1, 1500)):  # two ranks of one host read the one interface
        batch = json.loads(json.dumps(app_tests.BATCH))
        batch["agent"] = {
            **batch["agent"],
            "rank": rank,
            "local_rank": rank,
            "incarnation": f"i{rank}",
        }
        batch["topology"] = {
            "link_interface": "node1",
            "link_capacity_bytes_per_second": 12.5e6,
            "link_tx_bytes": tx,
            "link_rx_bytes": 7,
        }
        assert client.post("/v1/ingest", json=batch).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    capacity = families["syncscope_node_link_capacity_bytes_per_second"].samples
    assert [(s.labels["interface"], s.value) for s in capacity] == [("node1", 12.5e6)]
    moved = {
        s.labels["direction"]: s.value
        for s in families["syncscope_node_link_bytes"].samples
        if s.name.endswith("_total")
    }
    assert moved == {"tx": 1500, "rx": 7}


def test_the_job_wide_view_names_the_slow_link_and_no_straggler():
    ranks = two_of_four("balanced")
    leads = {0: 0.001, 1: 0.0, 2: 0.0015, 3: 0.0005}
    even = JobWide(leads, 0.004, 0.05, time.time(), 1.0, ("node0", 1.0))
    slow = JobWide(leads, 0.004, 0.05, time.time(), 1.0, ("node1", 0.4))
    settings = Settings()
    calm = diagnose_job(ranks, settings, job_wide=even)
    assert not calm.modes["slow_link"].verdict and calm.modes["slow_link"].score == 0
    out = diagnose_job(ranks, settings, job_wide=slow)
    assert out.modes["slow_link"].verdict and "node node1" in out.modes["slow_link"].reason
    assert "40%" in out.modes["slow_link"].reason
    assert out.straggler is None and not out.modes["fabric_contention"].verdict
    # Node-local, no job-wide view: nothing to compare the link with, no verdict.
    assert "slow_link" not in diagnose_job(ranks, settings).modes
