"""Energy: CPU packages from a powercap tree (fake, in tmp_path: this machine has none), the GPU's
NVML counter through the agent's topology, and where either is missing, no series and a reason
on the status page."""

from __future__ import annotations

import copy
import os
import types
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from syncscope.agent.topology import NvmlProvider, PynvmlDevice, dynamic_sample
from syncscope.exporter.app import create_app
from syncscope.exporter.energy import CpuEnergy, PackageEnergy, PowercapReader
from syncscope.exporter.page import cpu_energy_line, gpu_energy_line
from syncscope.exporter.settings import Settings

from tests.conftest import parse_samples
from tests.unit import test_exporter_app as app_tests

RANGE = 262_143_328_850  # a real package's max_energy_range_uj


def zone(root: Path, name: str, label: str, energy_uj: int, span: int = RANGE) -> Path:
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{span}\n")
    return path


def set_energy(path: Path, energy_uj: int) -> None:
    (path / "energy_uj").write_text(f"{energy_uj}\n")


@pytest.fixture
def powercap(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two packages, and zones that are not packages: a core sub-zone, psys, an mmio copy."""
    root = tmp_path / "powercap"
    p0 = zone(root, "intel-rapl:0", "package-0", 5_000_000)
    zone(root, "intel-rapl:0:0", "core", 1_000_000)
    p1 = zone(root, "intel-rapl:1", "package-1", RANGE - 1_000_000)
    zone(root, "intel-rapl:2", "psys", 9_000_000)
    zone(root, "intel-rapl-mmio:0", "package-0", 7_000_000)
    return root, p0, p1


def joules(energy: CpuEnergy) -> dict[str, float]:
    assert energy.missing is None
    return {p.package: p.joules for p in energy.packages}


def test_packages_count_from_the_first_read_and_across_a_wrap(powercap):
    root, p0, p1 = powercap
    read = PowercapReader(str(root))
    assert joules(read()) == {"package-0": 0.0, "package-1": 0.0}
    set_energy(p0, 7_500_000)  # +2.5 J
    set_energy(p1, 2_000_000)  # wrapped: 1 J to the top of the range, then 2 J
    assert joules(read()) == {"package-0": 2.5, "package-1": 3.0}
    set_energy(p1, 2_000_500)
    assert joules(read()) == {"package-0": 2.5, "package-1": 3.0005}


def test_no_powercap_gives_no_packages_and_says_why(tmp_path):
    energy = PowercapReader(str(tmp_path / "absent"))()
    assert energy.packages == () and energy.missing.startswith("no powercap on this host")
    (tmp_path / "empty").mkdir()
    zone(tmp_path / "empty", "dram-ish", "dram", 1)
    assert PowercapReader(str(tmp_path / "empty"))().missing.startswith("no RAPL zone")
    zone(tmp_path / "psys-only", "intel-rapl:0", "psys", 1)
    assert PowercapReader(str(tmp_path / "psys-only"))().missing.startswith("no RAPL package")


def test_a_root_only_energy_file_is_a_reason_not_a_zero(powercap):
    """Linux 5.10+ makes energy_uj 0400 root:root. Tests run as root here, where a chmod denies
    nothing, so the reader gets the error the kernel gives (EACCES) from its injected reader."""
    root, _p0, _p1 = powercap

    def read(path: str) -> str:
        if path.endswith("energy_uj"):
            raise PermissionError(13, "Permission denied", path)
        return Path(path).read_text()

    energy = PowercapReader(str(root), read=read)()
    assert energy.packages == ()
    assert energy.missing.startswith("powercap not readable: Permission denied (")
    assert "intel-rapl:0/energy_uj" in energy.missing


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a file whatever its mode")
def test_a_file_this_user_may_not_read_is_a_reason(powercap):
    root, p0, p1 = powercap
    for path in (p0, p1):
        (path / "energy_uj").chmod(0)
    energy = PowercapReader(str(root))()
    assert energy.packages == () and "Permission denied" in energy.missing


def test_one_unreadable_package_leaves_the_other(powercap):
    root, _p0, p1 = powercap
    (p1 / "energy_uj").write_text("not a number\n")
    energy = PowercapReader(str(root))()
    assert joules(energy) == {"package-0": 0.0}


def test_the_exporter_exports_its_hosts_packages_per_job_and_node(powercap):
    root, p0, _p1 = powercap
    with TestClient(create_app(Settings(powercap_root=str(root)))) as client:
        # no job reports here yet: a family with no series
        assert "syncscope_node_cpu_energy_joules_total{" not in client.get("/metrics").text
        first = copy.deepcopy(app_tests.BATCH)
        first["agent"] = {**first["agent"], "hostname": "n1"}
        assert client.post("/v1/ingest", json=first).status_code == 200
        other = copy.deepcopy(app_tests.BATCH)
        other["agent"] = {**other["agent"], "job": "k", "hostname": "n2"}
        assert client.post("/v1/ingest", json=other).status_code == 200
        client.get("/metrics")
        set_energy(p0, 5_000_000 + 1_500_000)
        text = client.get("/metrics").text
        state = client.get("/v1/state").json()
    series = parse_samples(text, "syncscope_node_cpu_energy_joules_total")
    by_labels = {
        (dict(k)["job"], dict(k)["node"], dict(k)["package"]): v for k, v in series.items()
    }
    assert by_labels == {
        ("j", "n1", "package-0"): 1.5,
        ("j", "n1", "package-1"): 0.0,
        ("k", "n2", "package-0"): 1.5,
        ("k", "n2", "package-1"): 0.0,
    }
    assert state["cpu_energy"]["missing"] is None
    assert [p["package"] for p in state["cpu_energy"]["packages"]] == ["package-0", "package-1"]


def test_no_series_and_the_reason_on_the_page_without_powercap_or_nvml(tmp_path):
    settings = Settings(powercap_root=str(tmp_path / "absent"))
    with TestClient(create_app(settings)) as client:
        assert client.post("/v1/ingest", json=app_tests.BATCH).status_code == 200
        text = client.get("/metrics").text
        page = client.get("/").text
    assert "syncscope_node_cpu_energy_joules_total{" not in text
    assert "syncscope_gpu_energy_joules_total{" not in text
    assert "GPU: no NVML (no rank here reports a GPU)" in page
    assert f"CPU: no powercap on this host ({tmp_path / 'absent'} absent)" in page
    assert "Energy" in page and "not measured" in page


# -- the page's words for each case ---------------------------------------------------------------
class Rank:
    def __init__(self, topology):
        self.topology = topology


GPU = {"gpu_uuid": "GPU-1", "pci_bus_id": "0000:1b:00.0", "gpu_name": "H100"}


@pytest.mark.parametrize(
    "topologies,line,known",
    [
        ([None, None], "GPU: no NVML (no rank here reports a GPU)", False),
        ([{**GPU, "topology_source": "sysfs"}], "GPU: no NVML (GPU facts from sysfs only)", False),
        (
            [{**GPU, "topology_source": "nvml+sysfs"}],
            "GPU: not sent (the shared-memory transport sends GPU state once)",
            False,
        ),
        (
            [{**GPU, "topology_source": "nvml+sysfs", "energy_joules": None}],
            "GPU: NVML has no energy counter on these GPUs",
            False,
        ),
        (
            [{**GPU, "topology_source": "nvml", "energy_joules": 1.5e6}, None],
            "GPU: 1.50 MJ on 1 GPU since driver load",
            True,
        ),
    ],
)
def test_the_page_says_what_gpu_energy_is_known_or_why_not(topologies, line, known):
    assert gpu_energy_line([Rank(t) for t in topologies]) == (line, known)  # type: ignore[misc]


def test_the_page_says_what_cpu_energy_is_known_or_why_not():
    two = CpuEnergy((PackageEnergy("package-0", 1500.0), PackageEnergy("package-1", 500.0)))
    assert cpu_energy_line(two) == ("CPU: 2.00 kJ on 2 packages since first read", True)
    denied = CpuEnergy((), "powercap not readable: Permission denied (/x/energy_uj)")
    assert cpu_energy_line(denied) == (
        "CPU: powercap not readable: Permission denied (/x/energy_uj)",
        False,
    )
    assert cpu_energy_line(None) == ("CPU: not read (no --powercap-root)", False)


# -- the GPU's counter through NVML -----------------------------------------------------------------
def test_nvml_total_energy_is_sent_in_joules_and_not_supported_is_unknown():
    pynvml = pytest.importorskip("pynvml")
    calls = []

    def energy(handle):
        calls.append(handle)
        return 123_456_789  # mJ since the driver loaded

    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByPciBusId=lambda bus: ("handle", bus),
        nvmlDeviceGetTotalEnergyConsumption=energy,
    )
    device = PynvmlDevice.open(types.SimpleNamespace(pci_bus_id="0000:1b:00.0"), nvml=nvml)
    sample = dynamic_sample(NvmlProvider(device), _NoSysfs(), None)
    assert sample["energy_joules"] == pytest.approx(123_456.789)
    assert calls == [("handle", "0000:1b:00.0")]

    def not_supported(_handle):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    nvml.nvmlDeviceGetTotalEnergyConsumption = not_supported
    provider = NvmlProvider(PynvmlDevice.open(types.SimpleNamespace(pci_bus_id="x"), nvml=nvml))
    assert dynamic_sample(provider, _NoSysfs(), None)["energy_joules"] is None
    assert provider.errors["total_energy_mj"] == "NotSupported"


class _NoSysfs:
    def pci_device(self, _bus):
        return None
