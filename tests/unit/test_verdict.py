"""The decision verdict (issue 31 item 5): coupling or infrastructure, on recorded real runs.

The timing data is the recorded 4-rank gloo runs of tests/fixtures/scenarios (no GPU: their
ranks send no topology); GPU facts are laid over them, from the `gpu` helper of
test_diagnosis or from the replayed `degraded` NVML fixture (tests/fixtures/gpu). Expected
strings are written out by hand from the rule in docs/diagnosis.md, never taken from the code.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from syncscope.agent.topology import DeviceLocator, TopologySampler
from syncscope.exporter import verdict as verdict_module
from syncscope.exporter.collectors import collect_verdict
from syncscope.exporter.diagnosis import Diagnosis, diagnose_job
from syncscope.exporter.gpu import locality_faults
from syncscope.exporter.jobwide import JobWide
from syncscope.exporter.page import render_status
from syncscope.exporter.store import JobView, RankView, StoreView, as_json
from syncscope.exporter.throughput import ThroughputView
from syncscope.exporter.verdict import JobVerdict

from tests.fixtures.gpu import load_case
from tests.unit.test_diagnosis import SETTINGS, diagnose, gpu, ranks_of

HEALTHY_CHECKS = (
    "no GPU slowed by throttling",
    "PCIe links at full width",
    "PCIe links at full generation",
    "processes on their GPU's NUMA node",
    "no hardware XID or ECC errors",
    "one node: no link between nodes",
)


def verdict_of(ranks: list[RankView], **kw: Any) -> JobVerdict | None:
    out = diagnose_job(ranks, SETTINGS, **kw) if kw else diagnose(ranks)
    assert out.error is None, out.error
    return out.verdict


def degraded_topology(tmp_path: Path, **answers: Any) -> dict[str, Any]:
    """What the agent's sampler sends from the constructed two-socket box: x8 of x16, GPU on
    NUMA node 1 with the process on node 0, HW slowdown + HW thermal (0x48) at 1410 MHz, no
    XID or ECC errors; `answers` replace the recorded NVML answers."""
    device, sysfs = load_case("degraded", tmp_path)
    device.answers.update(answers)
    sample = TopologySampler(
        DeviceLocator(pci_bus_id="0000:1b:00.0"), open_nvml=lambda _loc: device, sysfs=sysfs
    )()
    assert sample is not None
    return sample


# -- none ------------------------------------------------------------------------------------
def test_a_clean_job_gets_no_verdict_healthy_or_not() -> None:
    clean = ranks_of("balanced")  # skew 1.1 ms, 23 % idle, 8 % spikes: no mode detected
    assert verdict_of(clean) is None
    assert "verdict" not in as_json(diagnose(clean))  # absent from /v1/state, not null
    assert verdict_of(gpu(clean)) is None
    # A throttling GPU on a job that loses nothing measured is no verdict either.
    hot = gpu(clean, r2={"sm_clock_hertz": 1.41e9, "throttle_reasons": 0x40})
    assert verdict_of(hot) is None


# -- coupling ----------------------------------------------------------------------------------
def test_a_30ms_straggler_without_gpu_telemetry_is_coupling_with_health_unknown() -> None:
    v = verdict_of(ranks_of("forward_straggler"))  # rank 2 slowed 30 ms, CPU ranks
    assert v is not None
    assert (v.verdict, v.hardware) == ("coupling", "unknown")
    assert set(v.coupling) == {"straggler", "sync_amplification"}
    # 30 ms late on a ~40 ms step; ranks idle at the sync about half of each step
    assert 0.5 <= (v.coupling["straggler"] or 0) <= 1.0
    assert 0.25 <= (v.coupling["sync_amplification"] or 0) <= 0.75
    assert v.faults == ()
    assert v.unknown == ("no GPU telemetry",)
    assert v.passed == ("one node: no link between nodes",)
    assert "hardware health not known: no GPU telemetry" in v.reason
    assert "straggler rank 2 (cause forward" in v.reason
    assert "not infrastructure" not in v.reason and "healthy" not in v.reason


def test_a_30ms_straggler_on_healthy_gpus_is_structural_coupling_not_infrastructure() -> None:
    v = verdict_of(gpu(ranks_of("forward_straggler")))
    assert v is not None
    assert (v.verdict, v.hardware) == ("coupling", "healthy")
    assert v.passed == HEALTHY_CHECKS and v.unknown == () and v.faults == ()
    assert v.reason.startswith("structural coupling, not infrastructure: straggler rank 2")
    assert v.reason.endswith("hardware checks passed: " + ", ".join(HEALTHY_CHECKS))


def test_jitter_and_a_data_straggler_are_coupling_too() -> None:
    jitter = verdict_of(gpu(ranks_of("jitter")))
    assert jitter is not None and jitter.verdict == "coupling"
    assert set(jitter.coupling) == {"sync_amplification", "runtime_jitter"}  # no straggler
    assert 0.25 <= (jitter.coupling["runtime_jitter"] or 0) <= 0.5  # 150 ms stalls, 30 % steps
    data = verdict_of(gpu(ranks_of("data_straggler")))
    assert data is not None and data.verdict == "coupling" and "cause data" in data.reason


def test_a_software_power_cap_at_the_peers_clock_is_not_a_fault() -> None:
    # Routine at full load; it only counts where it holds the clock below 90 % of its peers'.
    capped = gpu(ranks_of("forward_straggler"), r2={"throttle_reasons": 0x4})
    v = verdict_of(capped)
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "healthy")
    slowed = gpu(
        ranks_of("forward_straggler"), r2={"throttle_reasons": 0x4, "sm_clock_hertz": 1.5e9}
    )
    v = verdict_of(slowed)
    assert v is not None and v.verdict == "infrastructure"
    assert v.faults == (
        "rank 2's GPU NVIDIA H100 on node vm: software power cap, SM clock 1500 MHz vs peers' "
        "1980 MHz",
    )


# -- infrastructure ----------------------------------------------------------------------------
def test_a_throttled_gpu_is_infrastructure_naming_the_rank_gpu_and_reason() -> None:
    ranks = gpu(
        ranks_of("forward_straggler"), r2={"sm_clock_hertz": 1.41e9, "throttle_reasons": 0x40}
    )
    v = verdict_of(ranks)
    assert v is not None and (v.verdict, v.hardware) == ("infrastructure", "unhealthy")
    assert v.faults == (
        "rank 2's GPU NVIDIA H100 on node vm: hardware thermal slowdown, SM clock 1410 MHz vs "
        "peers' 1980 MHz",
    )
    assert v.reason.startswith("infrastructure: rank 2's GPU NVIDIA H100 on node vm")
    # its lateness is the GPU's (cause gpu_throttle), not coupling; the waiting it causes stays
    assert "straggler" not in v.coupling and "sync_amplification" in v.coupling
    assert "no GPU slowed by throttling" not in v.passed


def test_the_degraded_gpu_fixture_is_infrastructure_naming_each_fault(tmp_path: Path) -> None:
    ranks = ranks_of("forward_straggler")
    healthy = gpu(ranks)
    ranks = [replace(healthy[0], topology=degraded_topology(tmp_path)), *healthy[1:]]
    v = verdict_of(ranks)
    assert v is not None and (v.verdict, v.hardware) == ("infrastructure", "unhealthy")
    where = "rank 0's GPU 0000:1b:00.0 on node vm"
    assert v.faults == (
        f"{where}: hardware slowdown, hardware thermal slowdown, SM clock 1410 MHz vs peers' "
        "1980 MHz",
        f"{where}: PCIe link x8 of x16",
        f"{where}: process on another NUMA node than its GPU",
    )
    # its generation (5 of 5), its error counts (none) and the single node pass; the other
    # checks failed
    assert v.passed == (
        "PCIe links at full generation",
        "no hardware XID or ECC errors",
        "one node: no link between nodes",
    )


def test_a_slow_link_is_infrastructure_naming_the_nodes_link() -> None:
    # The job-wide view (Prometheus): node n2's link, the job's slowest, carries a quarter of
    # the median node's.
    wide = JobWide(slowest_link=("n2", 0.25))
    v = verdict_of(ranks_of("balanced"), job_wide=wide)
    assert v is not None and (v.verdict, v.hardware) == ("infrastructure", "unhealthy")
    assert v.faults == ("node n2's link: carries 25% of what the job's median node's does",)
    assert v.coupling == {}  # the clean job loses time only to the link
    # Links at 60 % and up pass (the line is 50 %) and the straggler is coupling again.
    fine = JobWide(slowest_link=("n2", 0.6))
    v = verdict_of(gpu(ranks_of("forward_straggler")), job_wide=fine)
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "healthy")
    assert "every node's link carries at least 50% of the median" in v.passed


def test_a_pcie_generation_below_max_counts_only_when_read_under_load() -> None:
    slow_gen = {"pcie_link_generation": 3}
    v = verdict_of(gpu(ranks_of("forward_straggler"), r1=slow_gen))
    assert v is not None and v.verdict == "infrastructure"
    assert v.faults == ("rank 1's GPU NVIDIA H100 on node vm: PCIe link gen 3 of gen 5",)
    # Without NVML's clock-event reasons nothing says the link was read under load.
    sysfs_only = {"pcie_link_generation": 3, "throttle_reasons": None}
    v = verdict_of(gpu(ranks_of("forward_straggler"), r1=sysfs_only))
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "unknown")
    assert "throttle reasons not read for rank 1" in v.unknown
    assert "PCIe link generation (under load) not read for rank 1" in v.unknown


def test_the_verdict_judges_a_link_as_its_series_does() -> None:
    # A width sent as text has no gauge and no locality-fault series (exporter.gpu), so the
    # verdict calls it unread too, not a fault its page could not show; the same width as a
    # number is the fault in both.
    as_text = gpu(ranks_of("forward_straggler"), r1={"pcie_link_width": "8"})
    v = verdict_of(as_text)
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "unknown")
    assert "PCIe link width not read for rank 1" in v.unknown
    assert locality_faults(as_text[1].topology) == []
    as_number = gpu(ranks_of("forward_straggler"), r1={"pcie_link_width": 8})
    v = verdict_of(as_number)
    assert v is not None
    assert v.faults == ("rank 1's GPU NVIDIA H100 on node vm: PCIe link x8 of x16",)
    assert locality_faults(as_number[1].topology) == ["pcie_width"]


# -- health is never claimed without its facts ---------------------------------------------
def test_an_idle_gpus_link_and_a_node_local_view_leave_health_unknown() -> None:
    # The captured H100 idle: current link not reported (the agent drops idle readings).
    idle = {"pcie_link_width": None, "pcie_link_generation": None, "throttle_reasons": 0x1}
    ranks = gpu(ranks_of("forward_straggler"), **{f"r{i}": idle for i in range(4)})
    out = diagnose(ranks)
    assert out.verdict is not None and out.verdict.hardware == "unknown"
    assert "PCIe link width not read for ranks 0–3" in out.verdict.unknown
    assert out.modes["locality"].reason == (
        "PCIe link width not read for ranks 0–3; processes on their GPU's NUMA node"
    )
    # Half of an 8-rank job here, no job-wide view: the links between nodes are not compared.
    half = [replace(r, world_size=8) for r in gpu(ranks_of("forward_straggler"))]
    v = verdict_of(half)
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "unknown")
    assert v.unknown == ("links between nodes not compared (needs the job-wide view)",)


def test_a_cpu_ranks_link_facts_are_not_gpu_telemetry() -> None:
    """The demo's ranks send their network link only: no locality claim, health unknown."""
    link = {
        "link_interface": "lo",
        "link_speed_bytes_per_second": None,
        "link_capacity_bytes_per_second": None,
        "link_tx_bytes": 123,
        "link_rx_bytes": 456,
    }
    ranks = [replace(r, topology=link) for r in ranks_of("forward_straggler")]
    out = diagnose(ranks)
    assert "locality" not in out.modes  # was "PCIe links at full width, processes on ..."
    assert out.verdict is not None and out.verdict.unknown == ("no GPU telemetry",)
    html = render_status(view_of(ranks, out), SETTINGS)
    assert "PCIe links at full width" not in html
    assert "hardware health not known: no GPU telemetry" in html


# -- where it shows --------------------------------------------------------------------------
def view_of(ranks: list[RankView], out: Diagnosis) -> StoreView:
    return StoreView(0.0, 0.0, 1, {}, {"j": JobView(tuple(ranks), out, "j")})


@pytest.mark.parametrize(
    ("ranks", "labels"),
    [
        (lambda: ranks_of("balanced"), []),
        (
            lambda: ranks_of("forward_straggler"),
            [{"job": "j", "verdict": "coupling", "hardware": "unknown"}],
        ),
        (
            lambda: gpu(ranks_of("forward_straggler")),
            [{"job": "j", "verdict": "coupling", "hardware": "healthy"}],
        ),
        (
            lambda: gpu(ranks_of("forward_straggler"), r2={"numa_mismatch": 1}),
            [{"job": "j", "verdict": "infrastructure", "hardware": "unhealthy"}],
        ),
    ],
)
def test_the_metric_has_the_verdict_and_no_evidence_in_labels(ranks: Any, labels: list) -> None:
    rs = ranks()
    (family,) = collect_verdict(view_of(rs, diagnose(rs)))
    assert family.name == "syncscope_job_verdict"
    assert [s.labels for s in family.samples] == labels
    assert all(s.value == 1.0 for s in family.samples)


def test_the_status_page_says_the_verdict_near_the_diagnosis() -> None:
    healthy = gpu(ranks_of("forward_straggler"))
    html = render_status(view_of(healthy, diagnose(healthy)), SETTINGS)
    assert 'data-verdict="coupling" data-hardware="healthy"' in html
    assert "▲ coupling, not infrastructure" in html
    assert html.index('class="job-verdict"') < html.index('<table class="modes">')
    clean = ranks_of("balanced")
    html = render_status(view_of(clean, diagnose(clean)), SETTINGS)
    assert 'data-verdict="none"' in html and "loses no time" in html


def test_a_failing_verdict_keeps_the_modes(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_a: Any, **_k: Any) -> None:
        raise ZeroDivisionError("boom")

    monkeypatch.setattr(verdict_module, "job_verdict", broken)
    out = diagnose_job(ranks_of("forward_straggler"), SETTINGS)
    assert out.straggler is not None and out.straggler.rank == 2
    assert out.verdict is None and out.error == "verdict: ZeroDivisionError: boom"


# -- XID and ECC errors --------------------------------------------------------------------------
def test_xid_and_ecc_errors_are_infrastructure_naming_the_gpu() -> None:
    ranks = gpu(
        ranks_of("forward_straggler"),
        r1={"xid_errors": 2, "last_xid": 79},
        r3={"ecc_uncorrected_errors": 3, "row_remap_pending": 1},
    )
    v = verdict_of(ranks)
    assert v is not None and (v.verdict, v.hardware) == ("infrastructure", "unhealthy")
    assert v.faults == (
        "rank 1's GPU NVIDIA H100 on node vm: 2 XID errors, the last XID 79 (fallen off the bus)",
        "rank 3's GPU NVIDIA H100 on node vm: 3 uncorrected ECC errors, row remapping pending "
        "(needs a GPU reset)",
    )
    assert "no hardware XID or ECC errors" not in v.passed
    one = verdict_of(gpu(ranks_of("forward_straggler"), r0={"xid_errors": 1, "last_xid": 48}))
    assert one is not None and one.faults == (
        "rank 0's GPU NVIDIA H100 on node vm: XID 48 (double-bit ECC error)",
    )


def test_xids_the_application_causes_are_no_hardware_fault() -> None:
    # restarts' kills (45) and a kernel's illegal access (13): the job's coupling stands
    app = {"xid_errors": 3, "last_xid": 45, "xid_faults": 0, "last_fault_xid": 0}
    v = verdict_of(gpu(ranks_of("forward_straggler"), r1=app))
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "healthy")
    assert "no hardware XID or ECC errors" in v.passed and v.faults == ()
    # a hardware XID stays a fault whatever application XIDs came after it
    mixed = {"xid_errors": 3, "last_xid": 45, "xid_faults": 1, "last_fault_xid": 79}
    v = verdict_of(gpu(ranks_of("forward_straggler"), r1=mixed))
    assert v is not None and v.verdict == "infrastructure"
    assert v.faults == ("rank 1's GPU NVIDIA H100 on node vm: XID 79 (fallen off the bus)",)
    # an agent from before the split sends all XIDs as faults
    old = verdict_of(gpu(ranks_of("forward_straggler"), r1={"xid_errors": 1, "last_xid": 45}))
    assert old is not None and old.verdict == "infrastructure"


def test_ecc_not_supported_leaves_the_check_unknown_not_passed(tmp_path: Path) -> None:
    # The replayed NVML of rank 0 raises NotSupported for ECC (ECC off, or a GPU without it).
    # Its error readings are laid over a healthy GPU: its throttling, link and NUMA faults are
    # not at issue here.
    topo = degraded_topology(tmp_path, ecc_uncorrected_volatile={"error": "NotSupported"})
    assert topo["ecc_uncorrected_errors"] is None and topo["xid_errors"] == 0
    read = ("pci_bus_id", "xid_errors", "last_xid", "ecc_uncorrected_errors", "row_remap_pending")
    healthy = gpu(ranks_of("forward_straggler"))
    fine = {**(healthy[0].topology or {}), **{k: topo[k] for k in read}}
    v = verdict_of([replace(healthy[0], topology=fine), *healthy[1:]])
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "unknown")
    assert v.unknown == ("XID and ECC errors not read for rank 0",)
    assert "no hardware XID or ECC errors" not in v.passed
    # an error found in what was read is a fault whatever was not read
    fine["xid_errors"], fine["last_xid"] = 1, 79
    v = verdict_of([replace(healthy[0], topology=fine), *healthy[1:]])
    assert v is not None and v.verdict == "infrastructure"
    assert v.faults == ("rank 0's GPU 0000:1b:00.0 on node vm: XID 79 (fallen off the bus)",)


# -- throughput per GPU against the job's own baseline -------------------------------------------
def paced(ranks: list[RankView], current: float | None, unit: str = "samples") -> list[RankView]:
    """Ranks whose throughput per GPU is `current` against a baseline of 100 (exporter.throughput
    gives each rank's; these lay it over the recorded runs)."""
    view = ThroughputView(unit, current, 100.0)
    return [replace(r, throughput=view) for r in ranks]


def test_steady_throughput_gets_no_verdict() -> None:
    clean = gpu(ranks_of("balanced"))  # no mode detected
    assert verdict_of(paced(clean, 97.0)) is None
    assert verdict_of(paced(clean, 81.0)) is None  # above the line (80 %)
    assert verdict_of(paced(clean, None)) is None  # no current level yet (warm-up)


def test_a_25_percent_fall_on_healthy_gpus_is_structural_coupling_naming_the_fall() -> None:
    v = verdict_of(paced(gpu(ranks_of("balanced")), 75.0))
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "healthy")
    assert v.coupling == {"throughput_drop": 0.25}
    assert v.passed == HEALTHY_CHECKS and v.unknown == () and v.faults == ()
    assert v.reason == (
        "structural coupling, not infrastructure: throughput per GPU 75% of the job's own "
        "baseline (75 vs 100 samples/s per GPU; a change in the job's own work reads the same); "
        "hardware checks passed: " + ", ".join(HEALTHY_CHECKS)
    )
    # steps per second where the agents count no samples; with a straggler, both are evidence
    v = verdict_of(paced(gpu(ranks_of("forward_straggler")), 60.0, unit="steps"))
    assert v is not None and v.verdict == "coupling"
    assert set(v.coupling) == {"straggler", "sync_amplification", "throughput_drop"}
    assert "throughput per GPU 60% of the job's own baseline (60 vs 100 steps/s per GPU" in v.reason


def test_the_same_fall_with_a_throttled_gpu_is_infrastructure_naming_it(tmp_path: Path) -> None:
    healthy = gpu(ranks_of("balanced"))
    ranks = paced([replace(healthy[0], topology=degraded_topology(tmp_path)), *healthy[1:]], 75.0)
    v = verdict_of(ranks)
    assert v is not None and (v.verdict, v.hardware) == ("infrastructure", "unhealthy")
    assert v.faults[0] == (
        "rank 0's GPU 0000:1b:00.0 on node vm: hardware slowdown, hardware thermal slowdown, "
        "SM clock 1410 MHz vs peers' 1980 MHz"
    )
    assert v.reason.startswith("infrastructure: rank 0's GPU 0000:1b:00.0 on node vm")
    assert v.reason.endswith(
        "throughput per GPU 75% of the job's own baseline (75 vs 100 "
        "samples/s per GPU; a change in the job's own work reads the same)"
    )
    assert v.coupling == {"throughput_drop": 0.25}
    # a throttled GPU on a job whose throughput holds is still no verdict (nothing measured)
    assert verdict_of(paced(ranks, 100.0)) is None


def test_a_fall_without_gpu_telemetry_is_coupling_with_health_unknown() -> None:
    v = verdict_of(paced(ranks_of("balanced"), 70.0))
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "unknown")
    assert v.reason.startswith("structural coupling: throughput per GPU 70% of the job's own")
    assert "hardware health not known: no GPU telemetry" in v.reason


def test_the_fall_shows_on_the_page_in_v1_state_and_in_the_metric() -> None:
    ranks = paced(gpu(ranks_of("balanced")), 75.0)
    out = diagnose(ranks)
    view = view_of(ranks, out)
    html = render_status(view, SETTINGS)
    assert 'data-verdict="coupling" data-hardware="healthy"' in html
    assert "throughput per GPU 75% of the job&#x27;s own baseline" in html
    state = as_json(view)["jobs"]["j"]
    assert state["diagnosis"]["verdict"]["coupling"] == {"throughput_drop": 0.25}
    assert state["ranks"][0]["throughput"] == {
        "unit": "samples",
        "current_per_s": 75.0,
        "baseline_per_s": 100.0,
    }
    assert RankView.from_json(state["ranks"][0]).throughput == ranks[0].throughput
    (family,) = collect_verdict(view)
    assert [s.labels for s in family.samples] == [
        {"job": "j", "verdict": "coupling", "hardware": "healthy"}
    ]
