"""GPU locality and low-rate GPU state for one rank, from NVML and sysfs (paper §5.2).

What a rank sends in each batch's `topology` field: a flat dict of at most 64 keys whose values
are str, int, float or None (see `KEYS`). Identity, PCIe links, NVLink, NUMA placement and the
nearest NIC are read once; SM clock, throttle reasons, temperature, power and the *current*
PCIe link are re-read every `interval_s` from the reporter's background thread, never from the
training thread; so is the GPU's total-energy counter (NVML, millijoules since the driver
loaded; sent as joules, exported as syncscope_gpu_energy_joules_total), and its memory and
error state: uncorrected ECC errors since the driver loaded, a pending or failed row remapping,
and the XID critical errors NVML delivers as events, polled without blocking. Anything NVML or
sysfs cannot say is "unknown" (strings) or None (numbers), never an error and never 0: VMs
report NUMA and NVLink as "not supported", GeForce cards ECC, containers hide /sys/class/*.

Both sources sit behind small interfaces with their I/O injected, the way prometheus_client's
ProcessCollector takes `proc=`: `NvmlDevice` (the live `PynvmlDevice`; the tests replay captured
answers, tests/fixtures/gpu/replay.py) and `SysfsReader(root=...)`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from syncscope.wire import MAX_LABEL_LEN

log = logging.getLogger("syncscope.agent")

UNKNOWN = "unknown"
# nic_distance, nearest first (NCCL's PIX/PXB, PHB/NODE, SYS)
SAME_PCIE_SWITCH, SAME_NUMA_NODE, CROSS_SOCKET = (
    "same_pcie_switch",
    "same_numa_node",
    "cross_socket",
)
NIC_DISTANCES = (SAME_PCIE_SWITCH, SAME_NUMA_NODE, CROSS_SOCKET, UNKNOWN)

# Every key a topology dict may carry (at most wire.MAX_TOPOLOGY_ENTRIES; exporter/gpu.py reads
# these). Text values become label values of the exporter's GPU info series: at most
# wire.MAX_LABEL_LEN characters.
KEYS = (
    "gpu_uuid",
    "gpu_name",
    "pci_bus_id",
    "pcie_link_width",
    "pcie_link_max_width",
    "pcie_link_generation",
    "pcie_link_max_generation",
    "nvlink_active_links",
    "gpu_numa_node",
    "gpu_numa_source",
    "gpu_cpu_affinity",
    "process_numa_nodes",
    "numa_mismatch",
    "nic",
    "nic_numa_node",
    "nic_distance",
    "cpu_affinity",
    "sm_clock_hertz",
    "throttle_reasons",
    "temperature_celsius",
    "power_watts",
    "energy_joules",
    "xid_errors",
    "last_xid",
    "xid_faults",
    "last_fault_xid",
    "ecc_uncorrected_errors",
    "row_remap_pending",
    "row_remap_failure",
    "topology_source",
    # the network link of the rank's collectives (agent/link.py), GPU or not
    "link_interface",
    "link_speed_bytes_per_second",
    "link_shaped_bytes_per_second",
    "link_capacity_bytes_per_second",
    "link_tx_bytes",
    "link_rx_bytes",
)
# The topology key of the GPU's energy counter (joules since the driver loaded).
ENERGY_KEY = "energy_joules"
# XID critical-error events seen since the agent registered for them, and the last one's code;
# the same for those of them that are not the application's (APP_XIDS).
XID_KEY, LAST_XID_KEY = "xid_errors", "last_xid"
FAULT_XID_KEY, LAST_FAULT_XID_KEY = "xid_faults", "last_fault_xid"
# XIDs NVIDIA's XID catalog puts down to the application in the common case, with no action on
# the GPU: 13 (graphics engine exception: an out-of-range access in a kernel), 31 (GPU memory
# page fault: an illegal address), 43 (GPU stopped processing: the application's channel hit a
# fault, the GPU stays healthy), 45 (preemptive cleanup: the driver tearing down the channels of
# a process that aborted or was killed, as every checkpoint-restart cycle's kill does). They
# are counted in `xid_errors` and named on the page, but are not a hardware fault: a job of
# restarts would otherwise read "infrastructure". A hardware XID before them (48, 79 ...) stays
# in `xid_faults` whatever follows it.
APP_XIDS = frozenset({13, 31, 43, 45})
# The GPU's error state: XID events, uncorrected ECC errors, row remapping.
ERROR_KEYS = (
    XID_KEY,
    LAST_XID_KEY,
    FAULT_XID_KEY,
    LAST_FAULT_XID_KEY,
    "ecc_uncorrected_errors",
    "row_remap_pending",
    "row_remap_failure",
)
# Keys that only mean something re-read (everything dynamic_sample, the XID poll and the link's
# byte counters give): a value written once (a shared-memory ring's header) would read as a GPU
# that drew no energy, never had an error, never throttled and kept its first clock after its
# start, or a link that moved nothing. Left out there, their checks say "not read".
LIVE_KEYS = (
    ENERGY_KEY,
    *ERROR_KEYS,
    "sm_clock_hertz",
    "throttle_reasons",
    "temperature_celsius",
    "power_watts",
    "pcie_link_width",
    "pcie_link_generation",
    "link_tx_bytes",
    "link_rx_bytes",
)
# XID events drained per poll at most: a storm waits for the next poll rather than hold the
# reporter's thread.
MAX_XID_EVENTS_PER_POLL = 256
# NVML clocks-event reason "GPU idle": the PCIe link may have trained down to save power, so a
# current link generation/width read now says nothing about the link under load.
CLOCKS_EVENT_GPU_IDLE = 0x1
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
_GT_PER_S_TO_GEN = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6, 128.0: 7}


# -- small helpers ------------------------------------------------------------------------------
def normalize_bus_id(value: Any) -> str | None:
    """'00000000:19:00.0' (NVML), '0000:19:00.0' (sysfs) or b'..' -> '0000:19:00.0', else None."""
    if isinstance(value, bytes):
        value = value.decode(errors="replace")
    if not isinstance(value, str):
        return None
    text = value.strip().lower().rstrip("\x00")
    parts = text.split(":")
    if len(parts) == 2:
        parts = ["0000", *parts]
    if len(parts) != 3:
        return None
    domain = parts[0][-4:].rjust(4, "0")
    out = f"{domain}:{parts[1]}:{parts[2]}"
    return out if _BDF.match(out) else None


def parse_cpulist(text: str) -> set[int]:
    """'0-3,8,10-11' -> {0,1,2,3,8,10,11}; malformed parts are ignored."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            continue
        if 0 <= a <= b < 1 << 16:
            cpus.update(range(a, b + 1))
    return cpus


def format_cpus(cpus: Iterable[int] | None) -> str:
    """{0,1,2,3,8} -> '0-3,8', bounded to MAX_LABEL_LEN characters."""
    ordered = sorted(set(cpus or ()))
    if not ordered:
        return UNKNOWN
    ranges: list[str] = []
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        ranges.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    text = ",".join(ranges)
    if len(text) > MAX_LABEL_LEN:
        text = text[: MAX_LABEL_LEN - 3].rsplit(",", 1)[0] + ",.."
    return text


def _short(value: Any) -> str:
    if value is None or value == "":
        return UNKNOWN
    return str(value)[:MAX_LABEL_LEN]


def _int_or_none(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _node_or_none(value: Any) -> int | None:
    node = _int_or_none(value)
    return node if node is not None and node >= 0 else None  # sysfs says -1 for "no node"


# -- NVML -----------------------------------------------------------------------------------------
class NvmlDevice(Protocol):
    """The NVML answers the provider needs. Any method may raise; the provider treats every
    exception as "unknown". Names (ANSWERS) are the keys of a recorded answers file."""

    def uuid(self) -> str: ...
    def name(self) -> str: ...
    def pci_bus_id(self) -> str: ...
    def curr_pcie_link_generation(self) -> int: ...
    def max_pcie_link_generation(self) -> int: ...
    def curr_pcie_link_width(self) -> int: ...
    def max_pcie_link_width(self) -> int: ...
    def nvlink_states(self) -> list[int]: ...
    def numa_node_id(self) -> int: ...
    def cpu_affinity(self) -> list[int]: ...
    def sm_clock_mhz(self) -> int: ...
    def clocks_event_reasons(self) -> int: ...
    def temperature_c(self) -> int: ...
    def power_mw(self) -> int: ...
    def total_energy_mj(self) -> int: ...
    def ecc_uncorrected_volatile(self) -> int: ...
    def remapped_rows(self) -> list[int]: ...
    def xid_events(self) -> list[int]: ...


ANSWERS = (
    "uuid",
    "name",
    "pci_bus_id",
    "curr_pcie_link_generation",
    "max_pcie_link_generation",
    "curr_pcie_link_width",
    "max_pcie_link_width",
    "nvlink_states",
    "numa_node_id",
    "cpu_affinity",
    "sm_clock_mhz",
    "clocks_event_reasons",
    "temperature_c",
    "power_mw",
    "total_energy_mj",
    "ecc_uncorrected_volatile",
    "remapped_rows",
    "xid_events",
)
STATIC_ANSWERS = ANSWERS[:10]
DYNAMIC_ANSWERS = (
    "sm_clock_mhz",
    "clocks_event_reasons",
    "temperature_c",
    "power_mw",
    "total_energy_mj",
    "ecc_uncorrected_volatile",
    "remapped_rows",
)


@dataclass(frozen=True)
class DeviceLocator:
    """Which GPU is this rank's: PCI bus id first (absolute, unlike CUDA indices), then UUID."""

    pci_bus_id: str | None = None
    uuid: str | None = None
    index: int | None = None  # NVML index, last resort (CUDA_VISIBLE_DEVICES reorders CUDA's)


def locator_from_torch(torch: Any, device_index: int) -> DeviceLocator:
    """The locator of a CUDA device as torch sees it (needs CUDA initialised; GPU only)."""
    props = torch.cuda.get_device_properties(device_index)
    bus = None
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        bus = normalize_bus_id(
            f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        )
    uuid = getattr(props, "uuid", None)
    uuid_text = None
    if uuid is not None:
        uuid_text = str(uuid)
        if not uuid_text.startswith(("GPU-", "MIG-")):
            uuid_text = "GPU-" + uuid_text
    return DeviceLocator(pci_bus_id=bus, uuid=uuid_text, index=None)


class PynvmlDevice:
    """NvmlDevice over nvidia-ml-py (module `pynvml`); `nvml` is injectable for tests."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml = nvml
        self.handle = handle
        self._events: Any = None  # the XID event set, once registered
        self._events_refused: BaseException | None = None  # why it could not be

    @classmethod
    def open(cls, locator: DeviceLocator, nvml: Any = None) -> PynvmlDevice:
        """nvmlInit and find the handle; raises (ImportError, NVMLError) if there is no NVML."""
        if nvml is None:
            import pynvml as nvml  # type: ignore[no-redef]
        nvml.nvmlInit()  # reference-counted by NVML: one nvmlShutdown per nvmlInit
        try:
            handle = None
            if locator.pci_bus_id:
                handle = nvml.nvmlDeviceGetHandleByPciBusId(locator.pci_bus_id)
            elif locator.uuid:
                handle = nvml.nvmlDeviceGetHandleByUUID(locator.uuid)
            elif locator.index is not None:
                handle = nvml.nvmlDeviceGetHandleByIndex(locator.index)
            else:
                raise LookupError("no PCI bus id, UUID or index to find the GPU by")
        except BaseException:
            nvml.nvmlShutdown()
            raise
        return cls(nvml, handle)

    def close(self) -> None:
        events, self._events = self._events, None
        if events is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlEventSetFree(events)
        self.nvml.nvmlShutdown()

    def uuid(self) -> str:
        return self.nvml.nvmlDeviceGetUUID(self.handle)

    def name(self) -> str:
        return self.nvml.nvmlDeviceGetName(self.handle)

    def pci_bus_id(self) -> str:
        bus = self.nvml.nvmlDeviceGetPciInfo(self.handle).busId  # c_char array: bytes
        return bus.decode() if isinstance(bus, bytes) else str(bus)

    def curr_pcie_link_generation(self) -> int:
        return self.nvml.nvmlDeviceGetCurrPcieLinkGeneration(self.handle)

    def max_pcie_link_generation(self) -> int:
        return self.nvml.nvmlDeviceGetMaxPcieLinkGeneration(self.handle)

    def curr_pcie_link_width(self) -> int:
        return self.nvml.nvmlDeviceGetCurrPcieLinkWidth(self.handle)

    def max_pcie_link_width(self) -> int:
        return self.nvml.nvmlDeviceGetMaxPcieLinkWidth(self.handle)

    def nvlink_states(self) -> list[int]:
        """State of each NVLink until NVML says the index is out of range.

        NotSupported on link 0 (a single PCIe GPU, or a VM) propagates: "no NVLink" is
        unknown, not zero links. InvalidArgument marks the end of this GPU's links.
        """
        nvml = self.nvml
        states: list[int] = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                states.append(int(nvml.nvmlDeviceGetNvLinkState(self.handle, link)))
            except nvml.NVMLError as exc:
                if link == 0 or not isinstance(
                    exc, (nvml.NVMLError_InvalidArgument, nvml.NVMLError_NotSupported)
                ):
                    raise
                break
        return states

    def numa_node_id(self) -> int:
        return self.nvml.nvmlDeviceGetNumaNodeId(self.handle)

    def cpu_affinity(self) -> list[int]:
        words = max(1, ((os.cpu_count() or 64) + 63) // 64)
        mask = self.nvml.nvmlDeviceGetCpuAffinity(self.handle, words)
        return [w * 64 + b for w, word in enumerate(mask) for b in range(64) if word >> b & 1]

    def sm_clock_mhz(self) -> int:
        return self.nvml.nvmlDeviceGetClockInfo(self.handle, self.nvml.NVML_CLOCK_SM)

    def clocks_event_reasons(self) -> int:
        get = getattr(self.nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
        if get is not None:
            try:
                return get(self.handle)
            except self.nvml.NVMLError_FunctionNotFound:
                pass  # a driver older than the binding: the pre-12.2 name still works
        return self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle)

    def temperature_c(self) -> int:
        return self.nvml.nvmlDeviceGetTemperature(self.handle, self.nvml.NVML_TEMPERATURE_GPU)

    def power_mw(self) -> int:
        return self.nvml.nvmlDeviceGetPowerUsage(self.handle)

    def total_energy_mj(self) -> int:
        """Millijoules since the driver loaded (Volta and later; NotSupported before)."""
        return self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)

    def ecc_uncorrected_volatile(self) -> int:
        """Uncorrected ECC errors since the driver loaded (NotSupported where ECC is off or
        the GPU has none)."""
        nvml = self.nvml
        return nvml.nvmlDeviceGetTotalEccErrors(
            self.handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
        )

    def remapped_rows(self) -> list[int]:
        """[correctable, uncorrectable, pending, failure] row remappings (Ampere and later)."""
        return [int(v) for v in self.nvml.nvmlDeviceGetRemappedRows(self.handle)]

    def xid_events(self) -> list[int]:
        """The XID codes of the critical-error events delivered since the last call, without
        waiting. The first call registers for them; where NVML refuses (NotSupported: some
        GPUs, VMs, MIG), every call raises that refusal again."""
        nvml = self.nvml
        if self._events_refused is not None:
            raise self._events_refused.with_traceback(None)
        if self._events is None:
            events = None
            try:
                events = nvml.nvmlEventSetCreate()
                kind = nvml.nvmlEventTypeXidCriticalError
                nvml.nvmlDeviceRegisterEvents(self.handle, kind, events)
            except nvml.NVMLError as exc:
                if events is not None:
                    with contextlib.suppress(Exception):
                        nvml.nvmlEventSetFree(events)
                self._events_refused = exc
                raise
            self._events = events
        codes: list[int] = []
        for _ in range(MAX_XID_EVENTS_PER_POLL):
            try:
                data = nvml.nvmlEventSetWait(self._events, 0)  # 0 ms: never blocks
            except nvml.NVMLError_Timeout:
                break  # nothing (more) delivered
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                codes.append(int(data.eventData))
        return codes


class NvmlProvider:
    """Asks an NvmlDevice; every failure becomes None and is remembered in `errors`."""

    def __init__(self, device: NvmlDevice) -> None:
        self.device = device
        self.errors: dict[str, str] = {}

    def ask(self, name: str) -> Any:
        try:
            return getattr(self.device, name)()
        except Exception as exc:  # noqa: BLE001 - NVMLError_NotSupported and friends
            self.errors[name] = type(exc).__name__.removeprefix("NVMLError_")
            return None

    def answers(self, names: Iterable[str]) -> dict[str, Any]:
        return {name: self.ask(name) for name in names}

    def close(self) -> None:
        close = getattr(self.device, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                close()


# -- sysfs ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PciDevice:
    bus_id: str
    chain: tuple[str, ...]  # PCI functions from the root port down to this device
    numa_node: int | None
    local_cpus: frozenset[int]
    link_width: int | None
    link_max_width: int | None
    link_generation: int | None
    link_max_generation: int | None


@dataclass(frozen=True)
class Nic:
    name: str
    kind: str  # "infiniband" (RDMA) or "net"
    pci: PciDevice


def _link_generation(text: str | None) -> int | None:
    """'32.0 GT/s PCIe' -> 5; sysfs's 'Unknown' or garbage -> None."""
    if not text:
        return None
    match = re.match(r"\s*([0-9.]+)\s*GT/s", text)
    if not match:
        return None
    return _GT_PER_S_TO_GEN.get(float(match.group(1)))


class SysfsReader:
    """Reads the few /sys files locality needs; `root` points it at a fixture tree."""

    def __init__(
        self,
        root: str = "/",
        process_cpus: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.root = os.path.abspath(root)
        self._process_cpus = process_cpus or (lambda: os.sched_getaffinity(0))

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def read(self, path: str) -> str | None:
        try:
            with open(self._path(path)) as f:
                return f.read(4096).strip()
        except (OSError, UnicodeDecodeError):
            return None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(self._path(path)))
        except OSError:
            return []

    def resolve(self, path: str) -> str | None:
        """The real path of a sysfs link, relative to the root ('/sys/devices/...')."""
        full = self._path(path)
        if not os.path.exists(full):
            return None
        real = os.path.realpath(full)
        if self.root != "/" and not real.startswith(self.root + os.sep):
            return None
        return "/" + os.path.relpath(real, self.root)

    def process_cpus(self) -> set[int]:
        try:
            return set(self._process_cpus())
        except Exception:  # noqa: BLE001
            return set()

    def node_cpus(self) -> dict[int, set[int]]:
        nodes = {}
        for entry in self.listdir("/sys/devices/system/node"):
            if entry.startswith("node") and entry[4:].isdigit():
                text = self.read(f"/sys/devices/system/node/{entry}/cpulist")
                if text is not None:
                    nodes[int(entry[4:])] = parse_cpulist(text)
        return nodes

    def pci_device(self, bus_id: str | None) -> PciDevice | None:
        bus = normalize_bus_id(bus_id)
        if bus is None:
            return None
        real = self.resolve(f"/sys/bus/pci/devices/{bus}")
        if real is None:
            return None
        return self._pci_at(real)

    def _pci_at(self, real: str) -> PciDevice | None:
        """The PCI device at (or, for a virtio child like .../0000:00:03.0/virtio2, above)
        a resolved /sys/devices path."""
        parts = [p for p in real.split("/") if p]
        chain = tuple(p for p in parts if _BDF.match(p))
        if not chain:
            return None
        bus = chain[-1]
        base = "/" + "/".join(parts[: parts.index(bus) + 1])

        def num(name: str) -> int | None:
            text = self.read(f"{base}/{name}")
            try:
                return int(text) if text is not None else None
            except ValueError:
                return None

        width, max_width = num("current_link_width"), num("max_link_width")
        return PciDevice(
            bus_id=bus,
            chain=chain,
            numa_node=_node_or_none(num("numa_node")),
            local_cpus=frozenset(parse_cpulist(self.read(f"{base}/local_cpulist") or "")),
            link_width=width if width else None,  # 0 means "no link information"
            link_max_width=max_width if max_width else None,
            link_generation=_link_generation(self.read(f"{base}/current_link_speed")),
            link_max_generation=_link_generation(self.read(f"{base}/max_link_speed")),
        )

    def nics(self) -> list[Nic]:
        """RDMA devices and network interfaces that sit on a PCI device (not lo, bridges, veth)."""
        out = []
        for kind, base in (("infiniband", "/sys/class/infiniband"), ("net", "/sys/class/net")):
            for name in self.listdir(base):
                real = self.resolve(f"{base}/{name}/device")
                pci = self._pci_at(real) if real else None
                if pci is not None:
                    out.append(Nic(name=name[:MAX_LABEL_LEN], kind=kind, pci=pci))
        return out


def nic_distance(gpu: PciDevice | None, gpu_node: int | None, nic: PciDevice) -> str:
    """How far a NIC is from the GPU, in the terms NCCL uses to pick one.

    A shared PCI function above both devices means they hang off the same switch tree (a root
    port leads to one device, so sharing it means sharing what is below it); otherwise the NUMA
    nodes decide. Flat VM buses share nothing, so there the NUMA nodes speak.
    """
    if gpu is not None and set(gpu.chain[:-1]) & set(nic.chain[:-1]):
        return SAME_PCIE_SWITCH
    if gpu_node is None or nic.numa_node is None:
        return UNKNOWN
    return SAME_NUMA_NODE if gpu_node == nic.numa_node else CROSS_SOCKET


def nearest_nic(
    gpu: PciDevice | None, gpu_node: int | None, nics: list[Nic]
) -> tuple[Nic, str] | None:
    """RDMA before plain Ethernet, then the nearest, then the name (stable across restarts)."""
    if not nics:
        return None
    ranked = sorted(
        (
            (
                n.kind != "infiniband",
                NIC_DISTANCES.index(nic_distance(gpu, gpu_node, n.pci)),
                n.name,
            ),
            n,
        )
        for n in nics
    )
    best = ranked[0][1]
    return best, nic_distance(gpu, gpu_node, best.pci)


# -- composition --------------------------------------------------------------------------------
def static_topology(
    nvml: NvmlProvider | None, sysfs: SysfsReader, locator: DeviceLocator | None
) -> dict[str, Any]:
    """Everything that does not change during a run: identity, links, NUMA, nearest NIC."""
    a = nvml.answers(STATIC_ANSWERS) if nvml is not None else dict.fromkeys(STATIC_ANSWERS)
    bus = normalize_bus_id(a["pci_bus_id"]) or (locator.pci_bus_id if locator else None)
    pci = sysfs.pci_device(bus)
    nodes = sysfs.node_cpus()
    gpu_cpus = set(a["cpu_affinity"] or ()) or set(pci.local_cpus if pci else ())

    def has_cpus(node: int | None) -> bool:
        # Grace-Hopper / GB200: NVML's NUMA id is the node of the GPU's own memory, a node with
        # no CPUs (empty cpulist). It says nothing of CPU locality and would flag a false
        # mismatch. Where sysfs lists no nodes at all, nothing says a node is CPU-less.
        return node is not None and (not nodes or bool(nodes.get(node)))

    gpu_node, source = None, UNKNOWN
    for candidate, origin in (
        (_node_or_none(a["numa_node_id"]), "nvml"),
        (pci.numa_node if pci is not None else None, "sysfs"),
    ):
        if has_cpus(candidate):
            gpu_node, source = candidate, origin
            break
    if gpu_node is None and gpu_cpus:
        # NVML in VMs says "not supported"; the node holding all the GPU's local CPUs is it.
        holding = [n for n, cpus in nodes.items() if gpu_cpus <= cpus]
        if len(holding) == 1:
            gpu_node, source = holding[0], "cpu_affinity"

    proc_cpus = sysfs.process_cpus()
    proc_nodes = sorted(n for n, cpus in nodes.items() if cpus & proc_cpus)
    mismatch = None
    if gpu_node is not None and proc_nodes:
        mismatch = 0 if gpu_node in proc_nodes else 1

    states = a["nvlink_states"]
    nvlinks = sum(1 for s in states if s == 1) if isinstance(states, list) else None

    def pick(nvml_value: Any, sysfs_value: Any) -> int | None:
        value = _int_or_none(nvml_value)
        return value if value else _int_or_none(sysfs_value)

    near = nearest_nic(pci, gpu_node, sysfs.nics())
    sources = [s for s, ok in (("nvml", nvml is not None), ("sysfs", pci is not None)) if ok]
    return {
        "gpu_uuid": _short(a["uuid"] or (locator.uuid if locator else None)),
        "gpu_name": _short(a["name"]),
        "pci_bus_id": _short(bus),
        "pcie_link_width": pick(a["curr_pcie_link_width"], pci and pci.link_width),
        "pcie_link_max_width": pick(a["max_pcie_link_width"], pci and pci.link_max_width),
        "pcie_link_generation": pick(a["curr_pcie_link_generation"], pci and pci.link_generation),
        "pcie_link_max_generation": pick(
            a["max_pcie_link_generation"], pci and pci.link_max_generation
        ),
        "nvlink_active_links": nvlinks,
        "gpu_numa_node": gpu_node,
        "gpu_numa_source": source,
        "gpu_cpu_affinity": format_cpus(gpu_cpus),
        "process_numa_nodes": ",".join(map(str, proc_nodes)) or UNKNOWN,
        "numa_mismatch": mismatch,
        "nic": near[0].name if near else UNKNOWN,
        "nic_numa_node": near[0].pci.numa_node if near else None,
        "nic_distance": near[1] if near else UNKNOWN,
        "cpu_affinity": format_cpus(proc_cpus),
        "topology_source": "+".join(sources) or "none",
    }


def dynamic_sample(
    nvml: NvmlProvider | None, sysfs: SysfsReader, bus_id: str | None
) -> dict[str, Any]:
    """What changes during a run: clocks, throttling, temperature, power, energy, the current
    link, uncorrected ECC errors and row remapping (XID events: `TopologySampler`)."""
    a = nvml.answers(DYNAMIC_ANSWERS) if nvml is not None else dict.fromkeys(DYNAMIC_ANSWERS)
    link = {}
    if nvml is not None:
        link = {
            "pcie_link_width": _int_or_none(nvml.ask("curr_pcie_link_width")),
            "pcie_link_generation": _int_or_none(nvml.ask("curr_pcie_link_generation")),
        }
    if nvml is None or not all(link.values()):
        pci = sysfs.pci_device(bus_id)
        if pci is not None:
            link = {"pcie_link_width": pci.link_width, "pcie_link_generation": pci.link_generation}
    mhz, power = _int_or_none(a["sm_clock_mhz"]), a["power_mw"]
    energy = _int_or_none(a["total_energy_mj"])
    ecc = _int_or_none(a["ecc_uncorrected_volatile"])
    rows = a["remapped_rows"]  # [correctable, uncorrectable, pending, failure]
    flags = [_int_or_none(v) for v in rows[2:]] if isinstance(rows, list) and len(rows) == 4 else []
    pending, failure = (int(v > 0) if v is not None else None for v in flags or (None, None))
    return {
        **link,
        "sm_clock_hertz": mhz * 1_000_000 if mhz is not None else None,
        "throttle_reasons": _int_or_none(a["clocks_event_reasons"]),
        "temperature_celsius": _int_or_none(a["temperature_c"]),
        "power_watts": power / 1000.0 if isinstance(power, (int, float)) else None,
        ENERGY_KEY: energy / 1000.0 if energy is not None and energy >= 0 else None,
        "ecc_uncorrected_errors": ecc if ecc is not None and ecc >= 0 else None,
        "row_remap_pending": pending,
        "row_remap_failure": failure,
    }


class TopologySampler:
    """The `topology` callable of the reporter: a full sample on first use, then the dynamic
    fields every `interval_s`. Runs on the reporter's thread; returns None where there is no
    GPU (so CPU-only ranks send no topology and show no GPU series) and never raises.

    Resamples fall on multiples of `interval_s` of the wall clock, not `interval_s` after this
    rank's first sample: the reporter flushes at the same step on every rank (transport.py), so
    every rank's NVML reads land in the same flush rather than one rank's in every flush, which
    a synchronous job would pay for at each."""

    def __init__(
        self,
        locator: DeviceLocator | None,
        *,
        open_nvml: Callable[[DeviceLocator], Any] | None = PynvmlDevice.open,
        sysfs: SysfsReader | None = None,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.locator = locator
        self.open_nvml = open_nvml
        self.sysfs = sysfs or SysfsReader()
        self.interval_s = interval_s
        self.clock = clock
        self.nvml: NvmlProvider | None = None
        self.nvml_error: str | None = None
        self.samples = 0
        self.errors = 0
        self._static: dict[str, Any] | None = None
        self._current: dict[str, Any] | None = None
        self._loaded_link: dict[str, Any] = {}
        # XID events counted since NVML first delivered them (None: never) and the last code;
        # the same for those not the application's (APP_XIDS).
        self._xids: int | None = None
        self._last_xid = 0
        self._faults = 0
        self._last_fault = 0
        self._next = 0.0
        self._closed = False

    def __call__(self) -> dict[str, Any] | None:
        if self._closed or self.locator is None:
            return None
        try:
            now = self.clock()
            if self._static is None:
                if now < self._next:
                    return None  # nothing found last time: look again once an interval passed
                self._next = self._grid_after(now)
                self._static = self._sample_static()
                if self._static is not None:
                    self._next = now  # and the dynamic fields right away
            if self._static is not None and now >= self._next:
                self._next = self._grid_after(now)
                self._current = {**self._static, **self._sample_dynamic()}
                self.samples += 1
        except Exception as exc:  # noqa: BLE001 - topology is never worth an exception
            self.errors += 1
            if self.errors == 1:
                log.warning("syncscope: GPU topology sample failed: %r", exc)
        return self._current

    def _grid_after(self, now: float) -> float:
        return (now // self.interval_s + 1) * self.interval_s

    def _sample_static(self) -> dict[str, Any] | None:
        if self.open_nvml is not None:
            try:
                self.nvml = NvmlProvider(self.open_nvml(self.locator))  # type: ignore[arg-type]
            except Exception as exc:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound ...
                self.nvml_error = type(exc).__name__.removeprefix("NVMLError_")
                log.info("syncscope: NVML unavailable (%s); GPU topology from sysfs", exc)
        static = static_topology(self.nvml, self.sysfs, self.locator)
        if any(static[k] != UNKNOWN for k in ("gpu_uuid", "pci_bus_id", "gpu_name")):
            return static
        if self.nvml is not None:  # found nothing after all: give NVML back until next time
            self.nvml.close()
            self.nvml = None
        return None

    def _sample_dynamic(self) -> dict[str, Any]:
        bus = self._static.get("pci_bus_id") if self._static else None
        sample = dynamic_sample(self.nvml, self.sysfs, None if bus == UNKNOWN else bus)
        reasons = sample.get("throttle_reasons")
        idle = isinstance(reasons, int) and bool(reasons & CLOCKS_EVENT_GPU_IDLE)
        for key in ("pcie_link_width", "pcie_link_generation"):
            if key not in sample:
                continue
            if idle:
                # An idle GPU trains its link down to save power: keep the last value seen
                # under load, or say nothing yet, rather than report a false "degraded link".
                sample[key] = self._loaded_link.get(key)
            elif sample[key] is not None:
                self._loaded_link[key] = sample[key]
        return {**sample, **self._xid_sample()}

    def _xid_sample(self) -> dict[str, int | None]:
        """The XID events counted so far and the last one's code (0: none yet), all of them and
        those not the application's; None for all where NVML cannot deliver them, or this poll
        failed (the counts go on at the next)."""
        codes = self.nvml.ask("xid_events") if self.nvml is not None else None
        if not isinstance(codes, list):
            return dict.fromkeys((XID_KEY, LAST_XID_KEY, FAULT_XID_KEY, LAST_FAULT_XID_KEY))
        self._xids = (self._xids or 0) + len(codes)
        for code in map(int, codes):
            self._last_xid = code
            if code not in APP_XIDS:
                self._faults += 1
                self._last_fault = code
        return {
            XID_KEY: self._xids,
            LAST_XID_KEY: self._last_xid,
            FAULT_XID_KEY: self._faults,
            LAST_FAULT_XID_KEY: self._last_fault,
        }

    def close(self) -> None:
        self._closed = True
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None
