"""The decision verdict (the seed scenario's decision rule): whether the time a diagnosed job
loses goes to its coupling or to its infrastructure, with the evidence.

None while the job loses no time (no straggler, no amplification, jitter, slow link or contention
verdict) and its throughput per GPU holds against its own baseline (exporter/throughput.py);
"infrastructure", naming the node, GPU or link, when a health check fails; else "coupling" —
"structural coupling, not infrastructure" where every check passed, and with "hardware health
not known" where some could not be made (a host with no GPU telemetry).
exporter.diagnosis.diagnose_job adds it to its Diagnosis.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from syncscope.exporter.findings import (
    THROTTLE_BITS,
    Diagnosis,
    JobVerdict,
    median,
    numa_mismatch,
    number,
    rank_list,
)
from syncscope.exporter.gpu import has_gpu, pcie_link_fault
from syncscope.exporter.jobwide import JobWide
from syncscope.exporter.settings import DEFAULT_THRESHOLDS, Thresholds
from syncscope.exporter.store import RankView

# The software power cap is set whenever a busy GPU reaches its power limit, routine under full
# load: for the verdict it is a fault only where it holds that GPU's clock below its peers'.
POWER_CAP_BIT = 0x4

# The decision verdict: what the time the job loses is due to, and what is known of its hardware.
VERDICTS = ("coupling", "infrastructure")
HARDWARE = ("healthy", "unknown", "unhealthy")
# Modes whose verdict is time lost to the job's coupling; a straggler counts unless its cause is
# its hardware (then a health check fails and the verdict is infrastructure).
COUPLING_MODES = ("straggler", "sync_amplification", "runtime_jitter")
HARDWARE_CAUSES = ("gpu_throttle", "locality")
# Modes whose verdict is time lost to the infrastructure itself: a slow link, a contended fabric.
INFRASTRUCTURE_MODES = ("slow_link", "fabric_contention")
# The coupling evidence of a job whose throughput per GPU fell with no mode named: its share is
# the share of the baseline's throughput lost.
THROUGHPUT_DROP = "throughput_drop"
# What an XID says, where NVIDIA's XID catalog gives it a short name (others: the code alone).
XID_WORDS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after earlier errors",
    48: "double-bit ECC error",
    63: "ECC page retirement or row remapping",
    64: "ECC page retirement or row remapping failure",
    74: "NVLink error",
    79: "fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def _gpu_where(r: RankView) -> str:
    """rank 2's GPU 0000:1b:00.0 on node n1: where to look."""
    topo = r.topology or {}
    ident = next(
        (
            str(topo[k])
            for k in ("pci_bus_id", "gpu_uuid", "gpu_name")
            if isinstance(topo.get(k), str) and topo[k] not in ("", "unknown")
        ),
        "",
    )
    gpu = f"GPU {ident}" if ident else "GPU"
    return f"rank {r.rank}'s {gpu} on node {r.hostname or 'unknown'}"


def _throttle_fault(r: RankView, peers: Sequence[RankView], t: Thresholds) -> str | None:
    """What slows a rank's GPU, in words: any slowing clock-event reason but the software power
    cap, which counts only where its SM clock is below clock_ratio × its peers' median."""
    topo = r.topology or {}
    mask = max(0, int(number(topo.get("throttle_reasons")) or 0))
    own = number(topo.get("sm_clock_hertz"))
    clocks = [number((p.topology or {}).get("sm_clock_hertz")) for p in peers]
    peer_clock = median([c for c in clocks if c])
    slower = bool(own and peer_clock and own < t.clock_ratio * peer_clock)
    reasons = [
        words
        for bit, words in THROTTLE_BITS.items()
        if mask & bit and (bit != POWER_CAP_BIT or slower)
    ]
    if not reasons:
        return None
    clock = (
        f", SM clock {own / 1e6:.0f} MHz vs peers' {peer_clock / 1e6:.0f} MHz"
        if own and peer_clock
        else f", SM clock {own / 1e6:.0f} MHz"
        if own
        else ""
    )
    return f"{', '.join(reasons)}{clock}"


def _error_fault(r: RankView) -> str | None:
    """A GPU's hardware XID and ECC errors in words; "" where NVML read both and there are
    none; None where either was not read (and nothing was found in the other). XIDs the
    application causes (agent/topology.py, APP_XIDS: a killed process's cleanup, a kernel's
    illegal access) are no fault of the GPU; an agent from before that split counts all."""
    topo = r.topology or {}
    split = "xid_faults" in topo
    xids = number(topo.get("xid_faults" if split else "xid_errors"))
    ecc = number(topo.get("ecc_uncorrected_errors"))
    found = []
    if xids:
        code = int(number(topo.get("last_fault_xid" if split else "last_xid")) or 0)
        words = XID_WORDS.get(code)
        xid = f"XID {code} ({words})" if words else f"XID {code}"
        found.append(xid if xids == 1 else f"{int(xids)} XID errors, the last {xid}")
    if ecc:
        found.append(f"{int(ecc)} uncorrected ECC error{'s' if ecc != 1 else ''}")
    if number(topo.get("row_remap_pending")):
        found.append("row remapping pending (needs a GPU reset)")
    if number(topo.get("row_remap_failure")):
        found.append("row remapping failed")
    if found:
        return ", ".join(found)
    return None if xids is None or ecc is None else ""


def hardware_checks(
    live: Sequence[RankView],
    diagnosis: Diagnosis,
    job_wide: JobWide | None,
    t: Thresholds = DEFAULT_THRESHOLDS,
) -> tuple[list[str], list[str], list[str]]:
    """(faults, passed, unknown): the health checks the exporter's facts allow, each fault
    naming its rank, GPU and node or the node's link.

    Per GPU (from the topology its agent samples): throttling (clock-event reasons), PCIe link
    width and generation against their maxima (a generation only where NVML says the link was
    read under load: the agent keeps the last loaded reading while the GPU idles), the process's
    NUMA node against its GPU's, XID events and uncorrected ECC errors (passed only where NVML
    gives both; a pending or failed row remapping is a fault too). For the job: each node's
    link against the median node's (the slow_link mode; one node has no such link) and a
    contended fabric. A rank without GPU facts makes the GPU checks unknown, never passed."""
    faults: list[str] = []
    passed: list[str] = []
    unknown: list[str] = []
    gpus = [r for r in live if has_gpu(r.topology)]
    bare = [r.rank for r in live if not has_gpu(r.topology)]
    if bare:
        unknown.append(f"no GPU telemetry from {rank_list(bare)}" if gpus else "no GPU telemetry")

    def check(name: str, ok_words: str, per_rank: Any) -> None:
        blind: list[int] = []
        failed = False
        for r in gpus:
            result = per_rank(r)
            if result is None:
                blind.append(r.rank)
            elif result:
                faults.append(f"{_gpu_where(r)}: {result}")
                failed = True
        if blind:
            unknown.append(f"{name} not read for {rank_list(blind)}")
        elif gpus and not failed:
            passed.append(ok_words)

    def throttle(r: RankView) -> str | None:
        if number((r.topology or {}).get("throttle_reasons")) is None:
            return None
        return _throttle_fault(r, [p for p in gpus if p is not r], t) or ""

    def link(fault: str) -> Any:
        return lambda r: pcie_link_fault(r.topology or {}, fault)

    def numa(r: RankView) -> str | None:
        mismatch = numa_mismatch(r.topology)
        if mismatch is None:
            return None
        return "process on another NUMA node than its GPU" if mismatch else ""

    check("throttle reasons", "no GPU slowed by throttling", throttle)
    check("PCIe link width", "PCIe links at full width", link("pcie_width"))
    check(
        "PCIe link generation (under load)",
        "PCIe links at full generation",
        link("pcie_generation"),
    )
    check("NUMA placement", "processes on their GPU's NUMA node", numa)
    check("XID and ECC errors", "no hardware XID or ECC errors", _error_fault)

    slow_link = diagnosis.modes.get("slow_link")
    hosts = {r.hostname for r in live}
    elsewhere = max((r.world_size for r in live), default=0) - len(live)
    if slow_link is not None and job_wide is not None and job_wide.slowest_link is not None:
        node, ratio = job_wide.slowest_link
        if slow_link.verdict:
            faults.append(
                f"node {node}'s link: carries {ratio:.0%} of what the job's median node's does"
            )
        else:
            passed.append(
                f"every node's link carries at least {t.slow_link_ratio:.0%} of the median"
            )
    elif len(hosts) == 1 and elsewhere <= 0:
        passed.append("one node: no link between nodes")
    else:
        unknown.append("links between nodes not compared (needs the job-wide view)")
    contention = diagnosis.modes.get("fabric_contention")
    if contention is not None and contention.verdict:
        faults.append(f"the fabric: {contention.reason}")
    s = diagnosis.straggler
    if (
        s is not None
        and s.cause in HARDWARE_CAUSES
        and not any(f.startswith(f"rank {s.rank}'s ") for f in faults)
    ):
        faults.append(f"rank {s.rank} (the straggler): {s.cause_reason}")
    return faults, passed, unknown


def throughput_fall(
    live: Sequence[RankView], t: Thresholds = DEFAULT_THRESHOLDS
) -> tuple[float, float, str] | None:
    """(current, baseline, unit) per GPU where the job's throughput per GPU has fallen below
    throughput_ratio × its own baseline, else None: the medians over the ranks that have both
    (exporter/throughput.py), in samples per second where any rank counts samples."""
    views = [
        v
        for v in (r.throughput for r in live)
        if v is not None and v.current_per_s is not None and v.baseline_per_s
    ]
    unit = "samples" if any(v.unit == "samples" for v in views) else "steps"
    same = [v for v in views if v.unit == unit]
    current = median([v.current_per_s for v in same if v.current_per_s is not None])
    baseline = median([v.baseline_per_s for v in same if v.baseline_per_s])
    if current is None or not baseline or current >= t.throughput_ratio * baseline:
        return None
    return current, baseline, unit


def _rate(per_s: float) -> str:
    """1234, 75.5, 0.812: a rate with three significant figures, never in e-notation."""
    return f"{per_s:.0f}" if per_s >= 100 else f"{per_s:.3g}"


def job_verdict(
    diagnosis: Diagnosis,
    ranks: Sequence[RankView],
    t: Thresholds = DEFAULT_THRESHOLDS,
    job_wide: JobWide | None = None,
    shares: Mapping[str, float] | None = None,
) -> JobVerdict | None:
    """The decision verdict for a diagnosed job: None while it loses no time (no straggler and
    no amplification, jitter, slow-link or contention verdict, and its throughput per GPU not
    below throughput_ratio × its own baseline); "infrastructure" when a health check fails
    (hardware "unhealthy"); else "coupling", hardware "healthy" where every check passed and
    "unknown" where some could not be made. `shares`: the share of step time the node measured
    idle at the sync and lost to spikes (job-wide amplification replaces the first where
    Prometheus gives it)."""
    live = [r for r in ranks if not r.stale and r.steps_total > 0]
    modes = diagnosis.modes
    s = diagnosis.straggler
    losing = [
        m for m in (*COUPLING_MODES, *INFRASTRUCTURE_MODES) if m in modes and modes[m].verdict
    ]
    if s is not None and "straggler" not in losing:
        losing.insert(0, "straggler")
    fall = throughput_fall(live, t)
    if not live or (not losing and fall is None):
        return None
    step = median([r.step_time_median_s for r in live if r.step_time_median_s])
    measured = dict(shares or {})
    if job_wide is not None and job_wide.amplification is not None:
        measured["sync_amplification"] = job_wide.amplification
    coupling: dict[str, float | None] = {}
    words = []
    for mode in COUPLING_MODES:
        if mode not in losing:
            continue
        if mode == "straggler":
            if s is None or s.cause in HARDWARE_CAUSES:
                continue
            share = s.lateness_s / step if step else None
            late = f", {share:.0%} of a step late" if share is not None else ""
            words.append(f"straggler rank {s.rank} (cause {s.cause}{late})")
        else:
            share = measured.get(mode)
            what = (
                "of each step idle at the sync"
                if mode == "sync_amplification"
                else "of step time lost to spikes"
            )
            pct = f" ({share:.0%} {what})" if share is not None else ""
            words.append(f"{mode.replace('_', ' ')}{pct}")
        coupling[mode] = round(share, 4) if share is not None else None
    fell = ""
    if fall is not None:
        current, baseline, unit = fall
        fell = (
            f"throughput per GPU {current / baseline:.0%} of the job's own baseline "
            f"({_rate(current)} vs {_rate(baseline)} {unit}/s per GPU; a change in the job's own "
            "work reads the same)"
        )
        coupling[THROUGHPUT_DROP] = round(1.0 - current / baseline, 4)
    faults, passed, unknown = hardware_checks(live, diagnosis, job_wide, t)
    if faults:
        also = f"; the job also loses time to {', '.join(words)}" if words else ""
        return JobVerdict(
            "infrastructure",
            "unhealthy",
            f"infrastructure: {'; '.join(faults)}{also}{f'; {fell}' if fell else ''}",
            coupling,
            tuple(faults),
            tuple(passed),
            tuple(unknown),
        )
    if not coupling:
        return None
    evidence = ", ".join([*words, fell] if fell else words)
    if unknown:
        reason = f"structural coupling: {evidence}; hardware health not known: {'; '.join(unknown)}"
        health = "unknown"
    else:
        reason = (
            f"structural coupling, not infrastructure: {evidence}; hardware checks passed: "
            f"{', '.join(passed)}"
        )
        health = "healthy"
    return JobVerdict("coupling", health, reason, coupling, (), tuple(passed), tuple(unknown))
