"""CPU package energy from Linux powercap (RAPL), read by the exporter with each snapshot.

`<root>/intel-rapl:<n>/energy_uj` counts a CPU package's microjoules (AMD's RAPL driver uses
the same names) and wraps at `max_energy_range_uj`. `PowercapReader` reads every package zone
whenever the store takes a snapshot (each scrape, page and /v1/state) and keeps per package a
count that only grows: joules since the exporter first read the zone, wraps included. A reading
below the last is a wrap, so reads must come within one range of each other (a 262 kJ range
lasts 22 min at 200 W; Prometheus scrapes every 15 s). The collector exports the count once per
(job, node) of the ranks reporting here, as syncscope_node_cpu_energy_joules_total{package}: a
node's packages serve every job on it.

Absent where unreadable, never zeros: no powercap (a VM, a container without /sys), no package
zone, or energy_uj readable by root only (Linux 5.10 and later, after the Platypus side channel,
CVE-2020-8694) give no series and a reason (`CpuEnergy.missing`) that the status page shows.
The root and the file reader are injected, so tests point it at a fake tree.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterable

from prometheus_client.core import CounterMetricFamily, Metric
from syncscope.exporter.store import CpuEnergy, PackageEnergy, StoreView

from syncscope.catalog import NODE_CPU_ENERGY_JOULES_TOTAL

DEFAULT_ROOT = "/sys/class/powercap"
# Top-level RAPL zones only: intel-rapl:0:0 (cores, uncore, dram) are parts of their package,
# intel-rapl-mmio:* the same package again through another interface.
_ZONE = re.compile(r"^intel-rapl:\d+$")


def _read_text(path: str) -> str:
    with open(path) as f:
        return f.read(64).strip()


class PowercapReader:
    """Reads the RAPL package zones under `root`; thread-safe (scrapes and the page both read).

    Call it for a `CpuEnergy`. Never raises: every failure is a reason in `missing`.
    """

    def __init__(self, root: str = DEFAULT_ROOT, read: Callable[[str], str] = _read_text) -> None:
        self.root = root
        self.read = read
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}  # zone -> last raw energy_uj
        self._total: dict[str, int] = {}  # zone -> microjoules counted since the first read

    def __call__(self) -> CpuEnergy:
        try:
            with self._lock:
                return self._read_all()
        except Exception as exc:  # noqa: BLE001 - a snapshot always comes back
            return CpuEnergy((), f"powercap not readable: {exc!r}")

    def _zones(self) -> list[str] | str:
        """The package zones' directories, or why there are none."""
        try:
            entries = sorted(os.listdir(self.root))
        except FileNotFoundError:
            return f"no powercap on this host ({self.root} absent)"
        except OSError as exc:
            return f"powercap not readable: {exc.strerror or exc!r} ({self.root})"
        zones = [e for e in entries if _ZONE.match(e)]
        if not zones:
            return f"no RAPL zone in {self.root}"
        return zones

    def _read_all(self) -> CpuEnergy:
        zones = self._zones()
        if isinstance(zones, str):
            return CpuEnergy((), zones)
        packages: list[PackageEnergy] = []
        problems: list[str] = []
        for zone in zones:
            base = os.path.join(self.root, zone)
            try:
                name = self.read(os.path.join(base, "name"))
            except OSError:
                name = zone
            if not name.startswith("package"):
                continue  # psys (the whole platform) overlaps the packages; dram is not a CPU
            try:
                raw = int(self.read(os.path.join(base, "energy_uj")))
                span = int(self.read(os.path.join(base, "max_energy_range_uj")))
            except OSError as exc:
                problems.append(f"{exc.strerror or type(exc).__name__} ({exc.filename or base})")
                continue
            except ValueError as exc:
                problems.append(f"{exc} ({base})")
                continue
            packages.append(PackageEnergy(name, self._count(zone, raw, span) / 1e6))
        if packages:
            return CpuEnergy(tuple(packages))
        if problems:
            return CpuEnergy((), "powercap not readable: " + "; ".join(problems[:2]))
        return CpuEnergy((), f"no RAPL package zone in {self.root}")

    def _count(self, zone: str, raw: int, span: int) -> int:
        """Microjoules counted for `zone` after this reading."""
        last = self._last.get(zone)
        total = self._total.get(zone, 0)
        if last is not None:
            if raw >= last:
                total += raw - last
            elif 0 < last <= span:
                total += span - last + raw  # wrapped past max_energy_range_uj
            else:
                total += raw  # a range that cannot hold the last reading: count from zero
        self._last[zone] = raw
        self._total[zone] = total
        return total


def _reporting_nodes(view: StoreView) -> Iterable[tuple[str, str]]:
    """(job, node) of every job with a rank here that is not stale."""
    for job, data in view.jobs.items():
        for node in sorted({r.hostname for r in data.ranks if not r.stale}):
            yield job, node


def collect_cpu_energy(view: StoreView) -> Iterable[Metric]:
    """The host's package counters once per (job, node) reporting here; none if unread."""
    spec = NODE_CPU_ENERGY_JOULES_TOTAL
    family = CounterMetricFamily(spec.family, spec.help, labels=spec.labels)
    energy = view.cpu_energy
    if energy is not None and energy.packages:
        for job, node in _reporting_nodes(view):
            for package in energy.packages:
                family.add_metric([job, node, package.package], package.joules)
    return [family]
