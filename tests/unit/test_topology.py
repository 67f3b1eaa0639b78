"""GPU topology from recorded NVML answers and sysfs trees (tests/fixtures/gpu), plus this
machine's real /sys and real (absent) NVML: unknowns are values, never errors."""

from __future__ import annotations

import json
import logging
import os
import shutil
import types
from pathlib import Path
from typing import Any

import pytest
from syncscope.agent.topology import (
    ANSWERS,
    CROSS_SOCKET,
    ERROR_KEYS,
    KEYS,
    LIVE_KEYS,
    SAME_NUMA_NODE,
    SAME_PCIE_SWITCH,
    UNKNOWN,
    DeviceLocator,
    NvmlProvider,
    PciDevice,
    PynvmlDevice,
    SysfsReader,
    TopologySampler,
    dynamic_sample,
    format_cpus,
    locator_from_torch,
    nic_distance,
    normalize_bus_id,
    parse_cpulist,
    static_topology,
)

from syncscope.wire import MAX_LABEL_LEN, MAX_TOPOLOGY_ENTRIES
from tests.fixtures.gpu import HERE, cases, load_case, materialize_sysfs
from tests.fixtures.gpu.capture import capture_sysfs
from tests.fixtures.gpu.replay import RecordedNvmlDevice, record_answers

pynvml = pytest.importorskip("pynvml")


def sampler_for(case: str, tmp_path, **kw) -> TopologySampler:
    device, sysfs = load_case(case, tmp_path)
    return TopologySampler(
        DeviceLocator(pci_bus_id="0000:00:06.0"), open_nvml=lambda _loc: device, sysfs=sysfs, **kw
    )


# -- the captured H100 and the constructed degraded case ------------------------------------------
def test_captured_h100_case_replays_to_what_the_device_reported(tmp_path):
    topo = sampler_for("captured-h100", tmp_path)()
    # the replay of the recorded answers and sysfs tree is what the live sampler sent; keys
    # added since the capture come from answers it holds (the XID events: none delivered)
    sent = json.loads((HERE / "captured-h100" / "topology.json").read_text())
    added = {"xid_faults", "last_fault_xid"}
    assert {k: v for k, v in topo.items() if k not in added} == sent
    assert {k: topo[k] for k in added} == {"xid_faults": None, "last_fault_xid": None}
    assert topo["gpu_name"] == "NVIDIA H100 80GB HBM3"
    assert topo["pci_bus_id"] == "0000:00:06.0"  # NVML's 8-digit domain, normalised
    assert (topo["pcie_link_max_width"], topo["pcie_link_max_generation"]) == (16, 5)
    # captured idle (clocks-event reason 0x1, 345 MHz): the current link is not trusted yet
    assert topo["throttle_reasons"] == 0x1 and topo["sm_clock_hertz"] == 345_000_000
    assert (topo["pcie_link_width"], topo["pcie_link_generation"]) == (None, None)
    assert topo["nvlink_active_links"] is None  # "not supported" is unknown, not 0 links
    # NVML NUMA "not supported", sysfs says -1: the node holding the GPU's CPUs (0-15) is it
    assert (topo["gpu_numa_node"], topo["gpu_numa_source"]) == (0, "cpu_affinity")
    assert topo["gpu_cpu_affinity"] == "0-15"
    assert topo["cpu_affinity"] == "0-15"
    assert topo["process_numa_nodes"] == "0"
    assert topo["numa_mismatch"] == 0
    # eth0 is a virtio NIC on a flat VM bus with no NUMA node: found, distance unknown; lo,
    # ifb0 and ifb1 sit on no PCI device and are not NICs
    assert (topo["nic"], topo["nic_distance"], topo["nic_numa_node"]) == ("eth0", UNKNOWN, None)
    assert topo["temperature_celsius"] == 37
    assert topo["power_watts"] == pytest.approx(72.305)
    assert topo["topology_source"] == "nvml+sysfs"


def test_captured_h100_case_lists_only_eth0_as_a_nic(tmp_path):
    _device, sysfs = load_case("captured-h100", tmp_path)
    assert sysfs.listdir("/sys/class/net") == ["eth0", "ifb0", "ifb1", "lo"]
    assert [(n.name, n.kind, n.pci.bus_id) for n in sysfs.nics()] == [
        ("eth0", "net", "0000:00:03.0")
    ]


def test_degraded_case_shows_the_narrow_link_and_the_wrong_socket(tmp_path):
    topo = sampler_for("degraded", tmp_path)()
    assert (topo["pcie_link_width"], topo["pcie_link_max_width"]) == (8, 16)
    assert topo["nvlink_active_links"] == 17
    assert (topo["gpu_numa_node"], topo["gpu_numa_source"]) == (1, "nvml")
    assert topo["process_numa_nodes"] == "0"
    assert topo["numa_mismatch"] == 1
    # two RDMA NICs: mlx5_1 shares the GPU's PCIe switch, mlx5_0 sits on the other socket
    assert (topo["nic"], topo["nic_distance"], topo["nic_numa_node"]) == (
        "mlx5_1",
        SAME_PCIE_SWITCH,
        1,
    )
    assert topo["throttle_reasons"] == 0x48  # HW slowdown + HW thermal
    assert topo["temperature_celsius"] == 87


def test_the_exporters_diagnosis_reads_the_degraded_case_as_a_locality_fault(tmp_path):
    from syncscope.exporter.diagnosis import locality_fault

    assert locality_fault(sampler_for("captured-h100", tmp_path / "a")()) is None
    assert locality_fault(sampler_for("degraded", tmp_path / "b")()) == "PCIe link x8 of x16"


@pytest.mark.parametrize("case", cases())
def test_every_case_is_flat_bounded_and_typed(case, tmp_path):
    topo = sampler_for(case, tmp_path)()
    assert set(topo) <= set(KEYS) and len(KEYS) <= MAX_TOPOLOGY_ENTRIES == 64
    for key, value in topo.items():
        assert value is None or isinstance(value, (str, int, float)), key
        assert not isinstance(value, str) or len(value) <= MAX_LABEL_LEN == 64, key
    json.dumps(topo, allow_nan=False)  # what the reporter will do with it


def grace_hopper(tmp_path, pci_numa_node: str, cpulist: str | None = "\n"):
    """The captured H100 as a Grace-Hopper / GB200 node shows it: NVML's NUMA id is the node of
    the GPU's *own memory* (node 1), a node with no CPUs (sysfs writes an empty cpulist, or
    `cpulist=None`: none at all), while the process and the GPU's PCI function are on node 0."""
    device, sysfs = load_case("captured-h100", tmp_path)
    root = Path(sysfs.root)
    node1 = root / "sys/devices/system/node/node1"
    node1.mkdir(parents=True)
    if cpulist is not None:
        (node1 / "cpulist").write_text(cpulist)
    (root / "sys/devices/pci0000:00/0000:00:06.0/numa_node").write_text(pci_numa_node + "\n")
    device.answers["numa_node_id"] = 1
    return device, sysfs


@pytest.mark.parametrize(
    ("pci_numa_node", "cpulist", "expected"),
    [
        ("0", "\n", (0, "sysfs")),  # the GPU's PCI function knows its CPUs' node
        ("-1", "\n", (0, "cpu_affinity")),  # it doesn't: the node holding the GPU's CPUs
        ("0", None, (0, "sysfs")),  # the CPU-less node has no cpulist at all
    ],
    ids=["pci-numa-node", "gpu-cpu-affinity", "no-cpulist"],
)
def test_a_cpu_less_nvml_numa_node_is_not_the_gpus_cpu_node(
    pci_numa_node, cpulist, expected, tmp_path
):
    device, sysfs = grace_hopper(tmp_path, pci_numa_node, cpulist)
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="0000:00:06.0"), open_nvml=lambda _l: device, sysfs=sysfs
    )
    topo = sampler()
    # and no false "process on another NUMA node than its GPU"
    assert (topo["gpu_numa_node"], topo["gpu_numa_source"], topo["numa_mismatch"]) == (
        *expected,
        0,
    )
    assert topo["process_numa_nodes"] == "0"


def test_an_nvml_numa_node_is_kept_where_sysfs_lists_no_nodes(tmp_path):
    # Without /sys/devices/system/node nothing says node 1 has no CPUs: NVML is believed, and
    # with no process node known there is no mismatch to flag either way.
    device, sysfs = grace_hopper(tmp_path, "-1")
    shutil.rmtree(Path(sysfs.root) / "sys/devices/system/node")
    topo = static_topology(NvmlProvider(device), sysfs, None)
    assert (topo["gpu_numa_node"], topo["gpu_numa_source"]) == (1, "nvml")
    assert topo["process_numa_nodes"] == UNKNOWN and topo["numa_mismatch"] is None


def test_without_nvml_sysfs_still_gives_links_and_numa(tmp_path):
    _device, sysfs = load_case("degraded", tmp_path)
    topo = static_topology(None, sysfs, DeviceLocator(pci_bus_id="0000:1b:00.0"))
    assert (topo["pcie_link_width"], topo["pcie_link_max_width"]) == (8, 16)
    assert (topo["pcie_link_generation"], topo["pcie_link_max_generation"]) == (5, 5)
    assert (topo["gpu_numa_node"], topo["gpu_numa_source"]) == (1, "sysfs")
    assert topo["numa_mismatch"] == 1
    assert topo["gpu_uuid"] == UNKNOWN and topo["nvlink_active_links"] is None
    assert topo["topology_source"] == "sysfs"


def test_every_nvml_answer_failing_is_all_unknown_never_an_error(tmp_path):
    broken = RecordedNvmlDevice({name: {"error": "GpuIsLost"} for name in ANSWERS})
    _device, sysfs = load_case("captured-h100", tmp_path)
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="0000:00:06.0"), open_nvml=lambda _l: broken, sysfs=sysfs
    )
    topo = sampler()
    assert topo["gpu_uuid"] == UNKNOWN and topo["sm_clock_hertz"] is None
    assert topo["pcie_link_width"] == 16  # sysfs fills in
    assert sampler.nvml.errors["uuid"] == "GpuIsLost"
    assert sampler.errors == 0


def test_no_gpu_means_no_topology(tmp_path):
    # a CPU-only rank has nothing to locate: no topology, so the exporter shows no GPU series
    assert TopologySampler(None)() is None
    # a GPU torch located but neither NVML nor sysfs can see (a locked-down container): the
    # GPU is still reported, by what torch knew, and everything else is unknown
    empty = SysfsReader(root=str(tmp_path), process_cpus=lambda: {0})
    locator = DeviceLocator(pci_bus_id="0000:00:09.0", uuid="GPU-1")
    topo = TopologySampler(locator, open_nvml=None, sysfs=empty)()
    assert (topo["pci_bus_id"], topo["gpu_uuid"], topo["gpu_name"]) == (
        "0000:00:09.0",
        "GPU-1",
        UNKNOWN,
    )
    assert topo["pcie_link_width"] is None and topo["numa_mismatch"] is None
    assert topo["nic"] == UNKNOWN and topo["topology_source"] == "none"


# -- low-rate samples -------------------------------------------------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_dynamic_fields_are_resampled_every_interval_only(tmp_path):
    device, sysfs = load_case("captured-h100", tmp_path)
    clock = Clock()
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="0000:00:06.0"),
        open_nvml=lambda _l: device,
        sysfs=sysfs,
        interval_s=10.0,
        clock=clock,
    )
    assert sampler()["temperature_celsius"] == 37
    device.answers["temperature_c"] = 80
    clock.now = 9.9
    assert sampler()["temperature_celsius"] == 37 and sampler.samples == 1
    clock.now = 10.0
    assert sampler()["temperature_celsius"] == 80 and sampler.samples == 2


def test_ranks_started_apart_resample_at_the_same_wall_clock_multiples(tmp_path):
    # Two ranks whose first samples are 4.7 s apart: both resample at 10, 20 ... (the same
    # aligned flush on every rank), not 10 s after their own first sample (13.2 and 17.9).
    samplers = []
    for start in (3.2, 7.9):
        device, sysfs = load_case("captured-h100", tmp_path / str(start))
        clock = Clock()
        clock.now = start
        sampler = TopologySampler(
            DeviceLocator(pci_bus_id="0000:00:06.0"),
            open_nvml=lambda _l, d=device: d,
            sysfs=sysfs,
            interval_s=10.0,
            clock=clock,
        )
        sampler()
        samplers.append((sampler, clock))
    for now, samples in ((9.99, 1), (10.0, 2), (13.2, 2), (19.99, 2), (20.01, 3)):
        for sampler, clock in samplers:
            clock.now = now
            sampler()
            assert sampler.samples == samples, (now, clock)


def test_an_idle_gpu_does_not_report_a_downtrained_link(tmp_path):
    device, sysfs = load_case("captured-h100", tmp_path)
    device.answers.update(curr_pcie_link_generation=1, clocks_event_reasons=0x1)  # idle
    clock = Clock()
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="0000:00:06.0"),
        open_nvml=lambda _l: device,
        sysfs=sysfs,
        clock=clock,
    )
    assert sampler()["pcie_link_generation"] is None  # nothing seen under load yet
    device.answers.update(curr_pcie_link_generation=5, clocks_event_reasons=0)  # training
    clock.now = 10
    assert sampler()["pcie_link_generation"] == 5
    device.answers.update(curr_pcie_link_generation=1, clocks_event_reasons=0x1)  # idle again
    clock.now = 20
    assert sampler()["pcie_link_generation"] == 5  # the last value seen under load


# -- helpers ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("00000000:1B:00.0", "0000:1b:00.0"),
        ("0000:1b:00.0", "0000:1b:00.0"),
        (b"00000000:00:05.0\x00", "0000:00:05.0"),
        ("1b:00.0", "0000:1b:00.0"),
        ("not a bus id", None),
        (None, None),
    ],
)
def test_bus_ids_normalise_to_the_sysfs_form(raw, expected):
    assert normalize_bus_id(raw) == expected


def test_cpu_lists_round_trip_and_stay_bounded():
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert parse_cpulist("garbage,2") == {2}
    assert format_cpus({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert format_cpus(set()) == UNKNOWN
    scattered = set(range(0, 400, 2))
    text = format_cpus(scattered)
    assert len(text) <= 64 and text.endswith(",..")


def pci(chain: tuple[str, ...], node: int | None) -> PciDevice:
    return PciDevice(chain[-1], chain, node, frozenset(), None, None, None, None)


def test_nic_distance_classes():
    gpu = pci(("0000:17:00.0", "0000:18:00.0", "0000:19:08.0", "0000:1b:00.0"), 1)
    switch_mate = pci(("0000:17:00.0", "0000:18:00.0", "0000:19:0c.0", "0000:1c:00.0"), 1)
    other_root_port = pci(("0000:17:02.0", "0000:20:00.0"), 1)
    other_socket = pci(("0000:97:00.0", "0000:98:00.0"), 0)
    no_node = pci(("0000:00:03.0",), None)
    assert nic_distance(gpu, 1, switch_mate) == SAME_PCIE_SWITCH
    assert nic_distance(gpu, 1, other_root_port) == SAME_NUMA_NODE
    assert nic_distance(gpu, 1, other_socket) == CROSS_SOCKET
    assert nic_distance(gpu, 1, no_node) == UNKNOWN
    assert nic_distance(None, None, other_socket) == UNKNOWN


# -- pynvml itself: the real module's errors, and this machine's real (absent) library ---------------
def fake_nvml(**functions) -> types.SimpleNamespace:
    """pynvml's real constants and exception classes, with the device functions replaced."""
    names = [n for n in dir(pynvml) if n.startswith(("NVML_", "NVMLError"))]
    ns = types.SimpleNamespace(**{n: getattr(pynvml, n) for n in names})
    ns.nvmlInit = lambda: None
    ns.nvmlShutdown = lambda: None
    ns.nvmlDeviceGetHandleByPciBusId = lambda bus: ("handle", bus)
    for name, fn in functions.items():
        setattr(ns, name, fn)
    return ns


def not_supported(*_a):
    raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


def test_pynvml_device_maps_real_nvml_errors():
    def nvlink_state(_h, link):
        if link >= 12:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return 1 if link != 3 else 0

    nvml = fake_nvml(
        nvmlDeviceGetNvLinkState=nvlink_state,
        nvmlDeviceGetNumaNodeId=not_supported,
        nvmlDeviceGetCpuAffinity=lambda _h, words: [0xFFFF] + [0] * (words - 1),
        nvmlDeviceGetPciInfo=lambda _h: types.SimpleNamespace(busId=b"00000000:1B:00.0"),
        nvmlDeviceGetCurrentClocksEventReasons=lambda _h: 0x4,
        nvmlDeviceGetPowerUsage=lambda _h: 250_500,
    )
    device = PynvmlDevice.open(DeviceLocator(pci_bus_id="0000:1b:00.0"), nvml=nvml)
    assert device.handle == ("handle", "0000:1b:00.0")
    answers = record_answers(device)
    assert answers["nvlink_states"] == [1] * 3 + [0] + [1] * 8
    assert answers["numa_node_id"] == {"error": "NotSupported"}
    assert answers["cpu_affinity"] == list(range(16))
    assert answers["pci_bus_id"] == "00000000:1B:00.0"
    assert answers["clocks_event_reasons"] == 0x4
    assert answers["uuid"] == {"error": "AttributeError"}  # not faked: still only an answer
    # and the recorded answers replay as the same NVML errors
    replay = NvmlProvider(RecordedNvmlDevice(answers))
    assert replay.ask("numa_node_id") is None and replay.errors["numa_node_id"] == "NotSupported"
    with pytest.raises(pynvml.NVMLError_NotSupported):
        RecordedNvmlDevice(answers).numa_node_id()


def test_nvlink_not_supported_on_link_zero_is_unknown():
    nvml = fake_nvml(nvmlDeviceGetNvLinkState=not_supported)
    device = PynvmlDevice(nvml, "h")
    with pytest.raises(pynvml.NVMLError_NotSupported):
        device.nvlink_states()


def test_older_drivers_fall_back_to_the_throttle_reasons_name():
    def missing(_h):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_FUNCTION_NOT_FOUND)

    nvml = fake_nvml(
        nvmlDeviceGetCurrentClocksEventReasons=missing,
        nvmlDeviceGetCurrentClocksThrottleReasons=lambda _h: 0x20,
    )
    assert PynvmlDevice(nvml, "h").clocks_event_reasons() == 0x20


def test_real_pynvml_without_a_driver_is_reported_not_raised(caplog, tmp_path):
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        pass
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has an NVIDIA driver; covered by tests/gpu")
    _device, sysfs = load_case("captured-h100", tmp_path)
    sampler = TopologySampler(DeviceLocator(pci_bus_id="0000:00:06.0"), sysfs=sysfs)
    with caplog.at_level(logging.INFO, logger="syncscope.agent"):
        topo = sampler()
    assert sampler.nvml is None and sampler.nvml_error in ("LibraryNotFound", "DriverNotLoaded")
    assert topo["topology_source"] == "sysfs" and topo["pcie_link_width"] == 16
    assert sampler.errors == 0
    sampler.close()


def test_this_machines_real_sysfs_never_raises():
    reader = SysfsReader()
    reader.node_cpus()
    reader.process_cpus()
    for nic in reader.nics():
        assert nic.pci.bus_id and normalize_bus_id(nic.pci.bus_id) == nic.pci.bus_id
    static_topology(None, reader, DeviceLocator(pci_bus_id="0000:00:00.0"))


def test_capture_then_materialize_reproduces_this_machines_nics(tmp_path):
    if not os.path.isdir("/sys/class/net"):
        pytest.skip("no /sys/class/net here")
    out = tmp_path / "captured"
    out.mkdir()
    capture_sysfs(None, out)
    copied = SysfsReader(root=str(materialize_sysfs(out, tmp_path)), process_cpus=lambda: {0})
    real = SysfsReader()
    assert [(n.name, n.pci.bus_id, n.pci.numa_node) for n in copied.nics()] == [
        (n.name, n.pci.bus_id, n.pci.numa_node) for n in real.nics()
    ]
    assert copied.node_cpus() == real.node_cpus()


def test_locator_from_torch_properties():
    props = types.SimpleNamespace(
        pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0, uuid="c0ffee00-0000-4000-8000-1"
    )
    torch = types.SimpleNamespace(
        cuda=types.SimpleNamespace(get_device_properties=lambda _i: props)
    )
    loc = locator_from_torch(torch, 0)
    assert loc.pci_bus_id == "0000:1b:00.0"
    assert loc.uuid == "GPU-c0ffee00-0000-4000-8000-1"


def test_fixture_readme_says_which_cases_are_captured_and_which_constructed():
    readme = (HERE / "README.md").read_text()
    rows = {
        line.split("|")[1].strip(" `/"): line.split("|")[3].strip()
        for line in readme.splitlines()
        if line.startswith("| `")
    }
    assert set(cases()) <= set(rows)  # every case is described
    assert rows["captured-h100"].startswith("captured on the device")
    assert rows["degraded"].startswith("constructed")


def test_a_failed_first_sample_is_retried_after_an_interval_not_every_call(tmp_path):
    opened = []

    def open_nvml(_locator):
        opened.append(1)
        raise RuntimeError("driver busy")

    clock = Clock()
    sampler = TopologySampler(
        DeviceLocator(index=0),  # nothing NVML can open and nothing sysfs can find
        open_nvml=open_nvml,
        sysfs=SysfsReader(root=str(tmp_path), process_cpus=lambda: {0}),
        clock=clock,
    )
    assert sampler() is None and sampler() is None and len(opened) == 1
    clock.now = 10.0
    assert sampler() is None and len(opened) == 2


# -- memory and error state: ECC, row remapping, XID events ---------------------------------------
def test_the_degraded_case_reads_no_errors_and_the_captured_h100_none_at_all(tmp_path):
    topo = sampler_for("degraded", tmp_path / "d")()
    assert (topo["ecc_uncorrected_errors"], topo["xid_errors"], topo["last_xid"]) == (0, 0, 0)
    assert (topo["row_remap_pending"], topo["row_remap_failure"]) == (0, 0)
    # captured before these were asked: NVML gave no answer, so nothing is claimed, not 0
    h100 = sampler_for("captured-h100", tmp_path / "h")()
    assert all(h100[k] is None for k in (*ERROR_KEYS, "energy_joules"))


def test_ecc_and_row_remapping_not_supported_are_absent_never_zero(tmp_path):
    device, sysfs = load_case("degraded", tmp_path)
    device.answers["ecc_uncorrected_volatile"] = {"error": "NotSupported"}  # ECC off, GeForce
    device.answers["remapped_rows"] = {"error": "NotSupported"}  # before Ampere
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="0000:1b:00.0"), open_nvml=lambda _l: device, sysfs=sysfs
    )
    topo = sampler()
    assert topo["ecc_uncorrected_errors"] is None
    assert (topo["row_remap_pending"], topo["row_remap_failure"]) == (None, None)
    assert sampler.nvml.errors["ecc_uncorrected_volatile"] == "NotSupported"
    assert topo["xid_errors"] == 0  # the events still come


def test_errors_and_a_pending_remap_are_reported(tmp_path):
    device, sysfs = load_case("degraded", tmp_path)
    device.answers.update(ecc_uncorrected_volatile=3, remapped_rows=[2, 1, 1, 0])
    topo = TopologySampler(
        DeviceLocator(pci_bus_id="0000:1b:00.0"), open_nvml=lambda _l: device, sysfs=sysfs
    )()
    assert topo["ecc_uncorrected_errors"] == 3
    assert (topo["row_remap_pending"], topo["row_remap_failure"]) == (1, 0)


def clocked_sampler(tmp_path) -> tuple[Any, Clock, TopologySampler]:
    """The degraded case's sampler on a clock the test moves: (its NVML device, clock, it)."""
    device, sysfs = load_case("degraded", tmp_path)
    clock = Clock()
    sampler = TopologySampler(
        DeviceLocator(pci_bus_id="0000:1b:00.0"),
        open_nvml=lambda _l: device,
        sysfs=sysfs,
        clock=clock,
    )
    return device, clock, sampler


def test_xid_events_are_counted_across_samples_and_the_last_code_kept(tmp_path):
    device, clock, sampler = clocked_sampler(tmp_path)
    assert (sampler()["xid_errors"], sampler()["last_xid"]) == (0, 0)
    device.answers["xid_events"] = [13, 79]  # what this poll drains
    clock.now = 10
    topo = sampler()
    assert (topo["xid_errors"], topo["last_xid"]) == (2, 79)
    device.answers["xid_events"] = {"error": "GpuIsLost"}  # a failed poll: not known now
    clock.now = 20
    topo = sampler()
    assert (topo["xid_errors"], topo["last_xid"]) == (None, None)
    device.answers["xid_events"] = [79]  # and the count goes on
    clock.now = 30
    assert (sampler()["xid_errors"], sampler()["last_xid"]) == (3, 79)


def test_the_xids_an_application_causes_are_counted_apart_from_the_gpus_faults(tmp_path):
    device, clock, sampler = clocked_sampler(tmp_path)
    keys = ("xid_errors", "last_xid", "xid_faults", "last_fault_xid")
    assert tuple(sampler()[k] for k in keys) == (0, 0, 0, 0)
    device.answers["xid_events"] = [45, 13]  # a killed process's cleanup, a kernel's fault
    clock.now = 10
    assert tuple(sampler()[k] for k in keys) == (2, 13, 0, 0)
    device.answers["xid_events"] = [79, 45]  # off the bus, then the cleanup it forces
    clock.now = 20
    assert tuple(sampler()[k] for k in keys) == (4, 45, 1, 79)
    device.answers["xid_events"] = {"error": "GpuIsLost"}
    clock.now = 30
    assert tuple(sampler()[k] for k in keys) == (None, None, None, None)


class EventSet:
    """NVML's event set as pynvml hands it out: queued events, drained by nvmlEventSetWait."""

    def __init__(self) -> None:
        self.queue: list[types.SimpleNamespace] = []
        self.freed = False
        self.registered: list[tuple] = []

    def wait(self, events, timeout_ms):
        assert events is self and timeout_ms == 0  # never blocks the reporter's thread
        if not self.queue:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        return self.queue.pop(0)


def event_nvml(events: EventSet, **functions) -> types.SimpleNamespace:
    def register(handle, kinds, into):
        into.registered.append((handle, kinds))

    def free(into):
        into.freed = True

    return fake_nvml(
        **{
            "nvmlEventTypeXidCriticalError": pynvml.nvmlEventTypeXidCriticalError,
            "nvmlEventSetCreate": lambda: events,
            "nvmlDeviceRegisterEvents": register,
            "nvmlEventSetWait": events.wait,
            "nvmlEventSetFree": free,
            **functions,
        }
    )


def test_pynvml_device_polls_xid_events_without_blocking_and_frees_the_set():
    events = EventSet()
    nvml = event_nvml(events)
    device = PynvmlDevice.open(DeviceLocator(pci_bus_id="0000:1b:00.0"), nvml=nvml)
    assert device.xid_events() == []  # registered, nothing delivered yet
    assert events.registered == [(("handle", "0000:1b:00.0"), 0x8)]  # XID critical errors
    xid = pynvml.nvmlEventTypeXidCriticalError
    events.queue = [
        types.SimpleNamespace(eventType=xid, eventData=79),
        types.SimpleNamespace(eventType=xid, eventData=48),
    ]
    assert device.xid_events() == [79, 48]
    assert device.xid_events() == [] and len(events.registered) == 1  # registered once
    device.close()
    assert events.freed


def test_xid_events_refused_are_unknown_and_not_asked_for_again():
    calls = []

    def refuse(*_a):
        calls.append(1)
        not_supported()

    events = EventSet()
    nvml = event_nvml(events, nvmlDeviceRegisterEvents=refuse)
    device = PynvmlDevice(nvml, "h")
    provider = NvmlProvider(device)
    assert provider.ask("xid_events") is None and provider.ask("xid_events") is None
    assert provider.errors["xid_events"] == "NotSupported"
    assert len(calls) == 1 and events.freed  # the set it could not register is given back


def test_pynvml_device_asks_for_volatile_uncorrected_ecc_and_remapped_rows():
    asked = []

    def ecc(handle, error_type, counter_type):
        asked.append((handle, error_type, counter_type))
        return 3

    nvml = fake_nvml(
        nvmlDeviceGetTotalEccErrors=ecc, nvmlDeviceGetRemappedRows=lambda _h: (4, 1, 1, 0)
    )
    device = PynvmlDevice(nvml, "h")
    assert device.ecc_uncorrected_volatile() == 3
    assert asked == [("h", pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, pynvml.NVML_VOLATILE_ECC)]
    assert device.remapped_rows() == [4, 1, 1, 0]


def test_live_keys_are_topology_keys_and_every_value_that_changes_is_one(tmp_path):
    # what a shared-memory ring's header leaves out (agent/core.py), all of them real keys
    assert set(LIVE_KEYS) <= set(KEYS)
    # written once there, a throttle reason or a byte counter would claim its first value for
    # the whole run: every key sampled again while the job runs is left out
    device, sysfs = load_case("degraded", tmp_path)
    changing = set(dynamic_sample(NvmlProvider(device), sysfs, "0000:1b:00.0"))
    changing |= set(ERROR_KEYS) | {"link_tx_bytes", "link_rx_bytes"}
    assert changing <= set(LIVE_KEYS), changing - set(LIVE_KEYS)
