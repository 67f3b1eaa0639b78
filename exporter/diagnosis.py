"""Node-local diagnosis in the paper's §3.3 terms, shared by /metrics, /v1/state and the page.

Every mode gives a score in 0..1 and a one-line reason; its `verdict` is the score reaching the
thresholds file's verdict_score (0.5), as do the dashboards' and the status page's verdict lines.
The modes (their exact rules, reasoning and the scenarios they are tested on: docs/diagnosis.md):

  straggler           one rank arrives last at the gradient sync persistently (a large arrival
                      skew beyond the steps' noise, and the same rank last in most steps; random
                      stalls rotate the last arrival and are runtime jitter, not a straggler)
  sync_amplification  the share of each step that ranks sit idle at the sync for a later peer
  fabric_contention   the transfer per step (of the rank that arrived last, who waited for
                      nobody) against its own uncontended baseline; a large share of the step,
                      a link slow from the start, or waiting for a late rank is not contention
  slow_link           (job-wide view only) a node whose link carries far less than the median's
  runtime_jitter      the share of step time lost to irregular spikes in the ranks' own work
  locality            a narrow PCIe link or a process on another NUMA node than its GPU (only
                      over ranks that report a GPU; its reason claims no health it has no facts for)

A named straggler gets a cause: gpu_throttle, locality, the phase that makes up most of its
lateness, or unknown. The decision verdict (`Diagnosis.verdict`, `job_verdict`) joins the modes
with the hardware's health: none while the job loses no time (no mode's verdict, and throughput
per GPU not below its own baseline, exporter/throughput.py); "infrastructure", naming the node,
GPU or link, when a health check fails; else "coupling", with "hardware health not known" where
some check could not be made (a host with no GPU telemetry).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from syncscope.exporter import verdict as decision
from syncscope.exporter.findings import (
    THROTTLE_BITS,
    Diagnosis,
    ModeVerdict,
    Straggler,
    Victim,
    WarmUp,
    median,
    numa_mismatch,
    number,
    rank_list,
)
from syncscope.exporter.gpu import has_gpu, locality_faults, pcie_link_fault
from syncscope.exporter.jobwide import JobWide
from syncscope.exporter.pooling import NodeInflation, fabric_share
from syncscope.exporter.settings import DEFAULT_THRESHOLDS, Settings, Thresholds
from syncscope.exporter.store import LEAD_STEPS, RankView, RecentStep, Store, StoreView

from syncscope.catalog import STEP_WINDOW
from syncscope.wire import BLOCKED, Phase, blocked_s, group_first, group_ranks

CAUSE_PHASES = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
COMPUTE_PHASES = (Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER)
MODES = (
    "straggler",
    "sync_amplification",
    "fabric_contention",
    "slow_link",
    "runtime_jitter",
    "locality",
)
CAUSES = (*(p.label for p in CAUSE_PHASES), "gpu_throttle", "locality", "unknown")


def straggler_line(t: Thresholds, floor_s: float, step: float, job_wide: bool = False) -> float:
    """The arrival skew over which a straggler is named: the skew floor, or a share of the
    median step, the node-local view's (with its last-arrival count) or, for the job-wide
    view (none), SyncscopeStraggler's (Thresholds.straggler_ratio)."""
    return max(floor_s, (t.straggler_ratio if job_wide else t.skew_step_fraction) * step)


def settled_steps(rank: RankView, window: int) -> list[RecentStep]:
    """The rank's latest `window` recent steps less its warm-up steps (its incarnation's first,
    compiling, step; one a checkpoint load fell in): no rule's baseline."""
    return [s for s in rank.recent_steps[-window:] if not s.warm_up]


def _phase_means(
    rank: RankView, window: int, phases: Sequence[Phase] = CAUSE_PHASES
) -> dict[Phase, float]:
    steps = settled_steps(rank, window)
    if not steps:
        return {}
    return {p: sum(s.phases[p] for s in steps) / len(steps) for p in phases}


def locality_fault(topology: Mapping[str, Any] | None) -> str | None:
    """The first locality fault of the rank's GPU (gpu.locality_faults: the faults its series
    and the rules' locality alert carry), in words; else None."""
    if not topology:
        return None
    for fault in locality_faults(topology):
        if fault == "numa_mismatch":
            return "process on another NUMA node than its GPU"
        return pcie_link_fault(topology, fault)
    return None


def throttle_reasons(topology: Mapping[str, Any] | None) -> list[str]:
    """The slowing-down clock-event reasons a rank's GPU reports, in words."""
    mask = number((topology or {}).get("throttle_reasons"))
    if not mask:
        return []
    return [name for bit, name in THROTTLE_BITS.items() if int(mask) & bit]


def _throttled(straggler: RankView, peers: Sequence[RankView], t: Thresholds) -> str | None:
    topo = straggler.topology or {}
    reasons = throttle_reasons(topo)
    own = number(topo.get("sm_clock_hertz"))
    clocks = [number((p.topology or {}).get("sm_clock_hertz")) for p in peers]
    peer_clock = median([c for c in clocks if c])
    if not reasons or not own or not peer_clock or own >= t.clock_ratio * peer_clock:
        return None
    return (
        f"SM clock {own / 1e6:.0f} MHz vs peers' {peer_clock / 1e6:.0f} MHz ({', '.join(reasons)})"
    )


def straggler_cause(
    straggler: RankView, peers: Sequence[RankView], t: Thresholds = DEFAULT_THRESHOLDS
) -> tuple[str, str]:
    """(cause, reason) for a named straggler: a phase, gpu_throttle, locality or unknown."""
    mine = _phase_means(straggler, t.window)
    others = [o for o in (_phase_means(p, t.window) for p in peers) if o]
    if not mine or not others:
        return "unknown", "not enough steps to compare its phases with its peers'"
    gaps = {p: mine[p] - statistics.median(o[p] for o in others) for p in CAUSE_PHASES}
    positive = {p: g for p, g in gaps.items() if g > 0}
    total = sum(positive.values())
    if total <= 0:
        return "unknown", "none of its phases is slower than on its peers"
    compute = sum(positive.get(p, 0.0) for p in COMPUTE_PHASES)
    throttle = _throttled(straggler, peers, t)
    if throttle and compute >= t.cause_share * total:
        return "gpu_throttle", f"{throttle}; compute is {compute * 1e3:.1f} ms slower"
    fault = locality_fault(straggler.topology)
    shared = fault is not None and all(locality_fault(p.topology) for p in peers)
    if fault and not shared and compute + positive.get(Phase.DATA, 0.0) >= t.cause_share * total:
        return "locality", f"{fault}, unlike its peers"
    # Phases sampled (agent/phases.py): the other steps' phases are the timed steps' shares.
    every = straggler.phase_every
    sampled = f"; its phases timed in 1 step of {every}" if every > 1 else ""
    phase, gap = max(positive.items(), key=lambda kv: kv[1])
    if gap >= t.cause_share * total:
        return (
            phase.label,
            f"{phase.label} takes {gap * 1e3:.1f} ms longer than on its peers "
            f"({gap / total:.0%} of its lateness{sampled})",
        )
    ranked = sorted(positive.items(), key=lambda kv: -kv[1])[:2]
    split = ", ".join(f"{p.label} {g / total:.0%}" for p, g in ranked)
    return "unknown", f"no single signal explains 80 % of its lateness ({split}{sampled})"


def stage_root(
    leads: Mapping[int, float], stages: Mapping[int, int]
) -> tuple[int, float, int] | None:
    """The rank the others wait for, the arrival skew and the earliest peer: the rank blocked
    least in the stage whose ranks' leads spread most, that spread, and the rank of that stage
    blocked longest (`stages`: rank -> pipeline stage; a rank not in it, and every rank of a
    job that is no pipeline, is stage 0). A pipeline's stages differ in work by design, so a
    rank is compared with the ranks of its own stage only: a lighter stage, blocked longer in
    its point-to-point ops, is no straggler's victim. None where no stage holds two ranks with
    a lead."""
    by_stage: dict[int, list[tuple[float, int]]] = {}
    for rank, lead in leads.items():
        by_stage.setdefault(stages.get(rank, 0), []).append((lead, rank))
    best: tuple[int, float, int] | None = None
    for members in by_stage.values():
        if len(members) < 2:
            continue
        (lo, rank), (hi, first) = min(members), max(members)
        if best is None or hi - lo > best[1]:
            best = (rank, hi - lo, first)
    return best


def _over_line(
    job_wide: JobWide, t: Thresholds, floor_s: float, step: float
) -> tuple[int, float, float, float] | None:
    """One reading's root, its skew, the straggler's line and the step it is a share of; None
    without a root or a step. The leads are means per step over the rules' window: the line
    is a share of that window's mean step, as SyncscopeStraggler reads them, not of the step
    the ranks report now (after a slow spell the window still holds its steps, and the line
    would shrink under them). `step`: the step reported now, where no mean was read."""
    root = job_wide.straggler
    window_step = job_wide.step_mean_s or step
    if root is None or window_step <= 0:
        return None
    line = straggler_line(t, floor_s, window_step, job_wide=True)
    return root[0], root[1], line, window_step


def _held_for(
    job_wide: JobWide, rank: int, t: Thresholds, floor_s: float, step: float
) -> float | None:
    """How long `rank` has been the job-wide root over the line: from the oldest of the
    consecutive readings, this one included, in which it was, to this one (None: not in
    this one). A lead that the windows lend the ranks of one node as the job's steps
    lengthen (each node's rates end at its own last scrape) flickers from one evaluation to
    the next; a straggler's holds."""
    since: float | None = None
    for reading in (job_wide, *reversed(job_wide.earlier)):
        over = _over_line(reading, t, floor_s, step)
        if over is None or over[0] != rank or over[1] <= over[2]:
            break
        since = reading.read_unix_s
    return None if since is None else job_wide.read_unix_s - since


def _of_stage(stage: int | None) -> str:
    """' in its pipeline stage (stage 0)' for a pipeline's rank, '' for any other."""
    return "" if stage is None else f" in its pipeline stage (stage {stage})"


def group_members(rank: RankView, group: str) -> tuple[int, ...]:
    """The global ranks of `rank`'s group labelled `group`, as its agent reported them."""
    return group_ranks(rank.topology, group)


def wait_chain(
    ranks: Sequence[RankView],
    root: int,
    min_wait_s: float,
    window: int = STEP_WINDOW,
    job_leads: Mapping[int, float] | None = None,
    job_hops: Mapping[str, Mapping[int, int]] | None = None,
) -> tuple[Victim, ...]:
    """Each rank here (but the root) that waits at least `min_wait_s` per step (a paced rank's
    delay counted): the group it waits in most (its collectives' waits) and whom it waits for
    there: the root where the root is in that group, else the member of the group blocked
    least in collectives (who itself waits elsewhere, or for nobody): a rank that waits for a
    rank in another group is a victim, and following `waits_for` from any victim leads to the
    root.

    `job_leads` (rank -> its blocked time per step beyond the job's least blocked rank, from
    Prometheus) reaches past this node: a rank here that waits for a rank elsewhere waits as
    long as its node's peers, so its wait beyond them is nil; its job-wide lead is its wait,
    the group its collectives take longest in is where it waits, and members elsewhere are
    compared by their leads. `job_hops` (group label -> {lowest rank: least blocked member},
    from Prometheus) names whom a rank waits for in a group too large for its agent to list.

    Where that leads round in a circle (an interleaved pipeline's pair sends both ways, so each
    rank of it waits most in `pp`, for the other), the rank of the circle that waits longest in
    a group whose chain leaves the circle waits there instead, until no circle is left."""
    if job_leads:
        blocked = dict(job_leads)
    else:
        blocked = {r.rank: sum(_phase_means(r, window, BLOCKED).values()) for r in ranks}
    hops = job_hops or {}
    out: dict[int, Victim] = {}
    others: dict[int, list[Victim]] = {}  # each victim's other groups, longest wait first
    for r in ranks:
        if r.rank == root or r.steps_total <= 0 or not r.collectives:
            continue
        waits: dict[str, float] = {}
        for c in r.collectives:  # per step over the window: where it waits now
            waits[c.group] = waits.get(c.group, 0.0) + c.wait_per_step
        group, wait = max(waits.items(), key=lambda kv: kv[1])
        # Pacing delays a rank before its first wait, by less than that wait: the delay is
        # time it holds back for the rank it waits for, moved out of the collective. A paced
        # rank is a victim by both (its wait_s stays what it waited in the collective).
        paced = _phase_means(r, window, (Phase.PACING,)).get(Phase.PACING, 0.0)
        lead = (job_leads or {}).get(r.rank)
        if wait < min_wait_s and lead is not None and lead >= min_wait_s:
            # It waits for a rank elsewhere, as long as its node's peers do: its lead (its
            # blocked time, pacing's delay in it, beyond the least blocked rank) less its
            # delay is what it waits in the collective.
            spent: dict[str, float] = {}
            for c in r.collectives:
                spent[c.group] = spent.get(c.group, 0.0) + c.seconds_per_step
            group, wait = max(spent, key=spent.__getitem__), max(0.0, lead - paced)
            waits = {}
        elif wait + paced < min_wait_s:
            continue
        out[r.rank] = Victim(r.rank, group, _waits_for(r, group, root, blocked, hops), wait)
        others[r.rank] = [
            Victim(r.rank, g, _waits_for(r, g, root, blocked, hops), w)
            for g, w in sorted(waits.items(), key=lambda kv: -kv[1])
            if g != group
        ]
    _break_circles(out, others)
    return tuple(out.values())


def _waits_for(
    r: RankView,
    group: str,
    root: int,
    blocked: Mapping[int, float],
    hops: Mapping[str, Mapping[int, int]],
) -> int | None:
    """Whom `r` waits for in `group`: the root where it is a member, else the member blocked
    least; in a group its agent did not list, its least blocked member as the rules found it
    (None: no member this exporter knows)."""
    members = group_members(r, group)
    if root in members:
        return root
    peers = [m for m in members if m != r.rank and m in blocked]
    if peers:
        return min(peers, key=lambda m: blocked[m])
    first = None if members else group_first(r.topology, group)
    hop = hops.get(group, {}).get(first) if first is not None else None
    return hop if hop != r.rank else None


def _break_circles(out: dict[int, Victim], others: Mapping[int, list[Victim]]) -> None:
    """Re-point victims of `out` (in place) whose `waits_for` lead round in a circle: each time
    the one, of all on circles, that waits longest in another group whose chain ends outside
    a circle. A rank whose chain only runs into a circle keeps its own: once the circle is
    broken, its chain leads on through it."""

    def end(rank: int) -> int | None:
        """Where `rank`'s chain stops: the first rank it reaches twice (a circle), else None."""
        seen = set()
        while rank in out and rank not in seen:
            seen.add(rank)
            whom = out[rank].waits_for
            if whom is None:
                return None
            rank = whom
        return rank if rank in seen else None

    while True:
        exits = [
            next(
                (v for v in others[rank] if v.waits_for is not None and end(v.waits_for) is None),
                None,
            )
            for rank in out
            if end(rank) == rank  # on a circle, not on the way into one
        ]
        found = [v for v in exits if v is not None]
        if not found:
            return
        best = max(found, key=lambda v: v.wait_s)
        out[best.rank] = best


def _aligned(ranks: Sequence[RankView], window: int) -> list[dict[int, RecentStep]]:
    """Per step number that every rank reports (the latest `window`), each rank's record."""
    by_rank = [{s.step: s for s in r.recent_steps if not s.warm_up} for r in ranks]
    common = set(by_rank[0]).intersection(*by_rank[1:]) if by_rank else set()
    return [{r.rank: b[k] for r, b in zip(ranks, by_rank, strict=True)} for k in sorted(common)][
        -window:
    ]


def _sync_signal(steps: list[dict[int, RecentStep]]) -> str:
    # DDP's exposed communication is measured directly each step; without DDP (direct
    # collectives only) the arrival estimator's per-step wait is the only sync signal.
    exposed = any(s.phases[Phase.COMM_EXPOSED] > 0 for step in steps for s in step.values())
    return "comm_exposed" if exposed else "wait_s"


def _sync_time(record: RecentStep, signal: str) -> float:
    return blocked_s(record.phases) if signal == "comm_exposed" else record.wait_s


def _spike_share(rank: RankView, window: int) -> float | None:
    steps = settled_steps(rank, window)
    total = sum(s.step_s for s in steps)
    if len(steps) < 5 or total <= 0:
        return None
    work = [s.step_s - blocked_s(s.phases) for s in steps]
    typical = statistics.median(work)
    return sum(max(0.0, w - typical) for w in work) / total


def diagnose_job(
    ranks: Sequence[RankView],
    settings: Settings,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
    job_wide: JobWide | None = None,
    node_transfer: NodeInflation | None = None,
    last: Diagnosis | None = None,
    now: float | None = None,
) -> Diagnosis:
    """Scores, verdicts and reasons for one job's ranks on this node.

    With `job_wide` (Prometheus's view of every node, exporter.jobwide) the straggler, the
    amplification and the fabric's share are the job's; without it, and with ranks of the job
    on other nodes, the reasons say the view is node-local and fabric contention abstains.
    `node_transfer`: the node's transfer and work per step against their own baselines, from
    the exporter's pooling: the contention verdict where every rank of the job reports here.
    `now` (unix s) and `last`, the job's previous diagnosis: the coupling modes hold as their
    alerts do (hold_modes); without `now`, one reading on its own, they do not.
    Never raises: the snapshot it is part of also serves /metrics and the page, so on a rule's
    failure it returns no verdicts and the error in `error`.
    """
    try:
        local, shares = _diagnose(ranks, settings, thresholds, node_transfer)
        diagnosis = _job_wide(local, ranks, settings, thresholds, job_wide, node_transfer)
    except Exception as exc:  # noqa: BLE001 - a diagnosis bug must not take /metrics down
        return Diagnosis({}, None, None, 0, error=f"{type(exc).__name__}: {exc}"[:200])
    warm_up = warming_up(ranks, thresholds)
    if warm_up is not None:
        return _before_the_evidence(diagnosis, warm_up, thresholds)
    if now is not None:
        diagnosis = hold_modes(diagnosis, last, now, thresholds)
    try:
        verdict = decision.job_verdict(diagnosis, ranks, thresholds, job_wide, shares)
    except Exception as exc:  # noqa: BLE001 - nor may a verdict bug cost the modes
        return dataclasses.replace(diagnosis, error=f"verdict: {type(exc).__name__}: {exc}"[:200])
    return dataclasses.replace(diagnosis, verdict=verdict)


def warming_up(ranks: Sequence[RankView], t: Thresholds = DEFAULT_THRESHOLDS) -> WarmUp | None:
    """The job's warm-up, while a rank reporting here has fewer settled steps (steps after its
    incarnation's first, compiling, step and after a checkpoint load) than the diagnosis's
    window: a torch.compile, lazy init, the data loader's warm-up or a restart's load make the
    first steps unequal, and the rules would name a straggler that is none. The Prometheus
    rules wait for full windows too (recorded.WINDOW_FULL). None once every rank has a settled
    window; a view that does not count them (replayed from before) is taken as settled."""
    counts = [r.settled_steps for r in ranks if not r.stale and r.settled_steps is not None]
    if not counts or min(counts) >= t.window:
        return None
    return WarmUp(min(counts), t.window)


def _before_the_evidence(diagnosis: Diagnosis, warm_up: WarmUp, t: Thresholds) -> Diagnosis:
    """`diagnosis` during the job's warm-up: the modes' scores and reasons as measured but none
    at its verdict line, no straggler, no wait chain and no decision verdict."""
    modes = {
        mode: ModeVerdict(
            round(min(m.score, t.verdict_score - 0.01), 4), False, f"{warm_up.text}: {m.reason}"
        )
        for mode, m in diagnosis.modes.items()
    }
    return dataclasses.replace(
        diagnosis, modes=modes, straggler=None, victims=(), verdict=None, warming_up=warm_up
    )


# The coupling modes that are a verdict only once they have held at their line for their alert's
# for: mode -> (the Thresholds field, the alert).
HELD_MODES = {
    "runtime_jitter": ("jitter_hold_s", "SyncscopeStepTimeCVHigh"),
    "sync_amplification": ("amplification_hold_s", "SyncscopeSyncAmplification"),
}


def hold_modes(
    diagnosis: Diagnosis, last: Diagnosis | None, now: float, t: Thresholds
) -> Diagnosis:
    """`diagnosis` with each of HELD_MODES a verdict only once it has been at its line, in
    consecutive diagnoses of the job, for as long as its alert's for:. Before that its score
    stays just under the line and its reason says how long it has held. `last`: the job's
    previous diagnosis, whose `over_since` this one carries on (None: its first)."""
    before = last.over_since if last is not None else {}
    modes = dict(diagnosis.modes)
    since: dict[str, float] = {}
    for mode, (field, alert) in HELD_MODES.items():
        m = modes.get(mode)
        if m is None or not m.verdict:
            continue
        since[mode] = start = min(before.get(mode, now), now)
        hold_s, held_s = getattr(t, field), now - start
        if held_s < hold_s:
            modes[mode] = ModeVerdict(
                round(t.verdict_score - 0.01, 4),
                False,
                f"{m.reason}; at its line {_must_hold(held_s, hold_s, alert)}",
            )
    return dataclasses.replace(diagnosis, modes=modes, over_since=since)


def _must_hold(held_s: float, hold_s: float, alert: str) -> str:
    """How long a reading has held against the hold its alert's for: asks, as reasons say it."""
    return f"for {held_s:.0f} s of the {hold_s:g} s it must hold ({alert}'s for:)"


@dataclasses.dataclass(frozen=True)
class Diagnoser:
    """How a snapshot diagnoses a job: with these settings' thresholds, the shipped ones with
    the exporter's --set, those the rules were rendered with. Two compare equal when their
    settings do, so the store keeps a job's diagnosis from one snapshot to the next."""

    settings: Settings

    def __call__(
        self,
        ranks: Sequence[RankView],
        job_wide: JobWide | None,
        node_transfer: NodeInflation | None,
        last: Diagnosis | None = None,
    ) -> Diagnosis:
        return diagnose_job(
            ranks,
            self.settings,
            self.settings.thresholds,
            job_wide=job_wide,
            node_transfer=node_transfer,
            last=last,
            now=time.time(),
        )


def snapshot(store: Store, recent: int | None = None) -> StoreView:
    """The store's view (Store.view) with every job diagnosed: what the collectors, /v1/state
    and the status page read."""
    return store.view(Diagnoser(store.settings), recent)


def _diagnose(
    ranks: Sequence[RankView],
    settings: Settings,
    t: Thresholds,
    node_transfer: NodeInflation | None = None,
) -> tuple[Diagnosis, dict[str, float]]:
    """The node's diagnosis, and the share of step time each coupling mode it measured costs
    (sync_amplification: idle at the sync; runtime_jitter: lost to spikes) for the verdict."""
    live = [r for r in ranks if not r.stale and r.steps_total > 0]
    shares: dict[str, float] = {}
    if not live:
        return Diagnosis({}, None, None, 0), shares
    step = median([r.step_time_median_s for r in live if r.step_time_median_s]) or 0.0
    aligned = _aligned(live, t.window) if len(live) >= 2 else []
    enough = len(aligned) >= t.min_aligned_steps
    signal = _sync_signal(aligned) if enough else "wait_s"
    modes: dict[str, tuple[float, str]] = {}
    stages = {r.rank: r.pipeline_stage or 0 for r in live}
    arrivals = _arrivals(aligned, signal, stages)
    straggler, skew, threshold = _straggler_mode(
        modes, live, stages, step, arrivals, len(aligned) if enough else None, settings, t
    )
    _sync_modes(
        modes, shares, live, aligned, enough, step, arrivals, straggler, signal, node_transfer, t
    )
    _jitter_mode(modes, shares, live, t)
    _locality_mode(modes, live)
    verdicts = {
        m: ModeVerdict(round(s, 4), s >= t.verdict_score, why) for m, (s, why) in modes.items()
    }
    victims = _victims(live, straggler, t)
    return Diagnosis(
        verdicts, straggler, skew, len(aligned), victims=victims, skew_line_s=threshold
    ), shares


@dataclasses.dataclass(frozen=True)
class _Arrivals:
    """Per aligned step: who arrived last (per rank, the steps it alone was last in its
    pipeline stage), the transfer (the least time any rank spent at the sync) and the mean
    idle time at the sync over that transfer."""

    last_counts: dict[int, int]
    transfers: list[float]
    idles: list[float]
    syncs: list[dict[int, float]]  # per aligned step, each rank's time at the sync


def _arrivals(
    aligned: list[dict[int, RecentStep]], signal: str, stages: dict[int, int]
) -> _Arrivals:
    """Who arrived last, per step: the rank that spent the least time at the sync, among the
    ranks of its pipeline stage (every rank where the job is no pipeline)."""
    last_counts: dict[int, int] = {}
    transfers: list[float] = []
    idles: list[float] = []
    syncs: list[dict[int, float]] = []
    for by_rank in aligned:
        sync = {rank: _sync_time(rec, signal) for rank, rec in by_rank.items()}
        syncs.append(sync)
        floors: dict[int, float] = {}
        for rank, blocked in sync.items():
            if blocked < floors.get(stages[rank], math.inf):
                floors[stages[rank]] = blocked
        for stage, floor in floors.items():
            at_floor = [r for r, blocked in sync.items() if stages[r] == stage and blocked == floor]
            if len(at_floor) == 1:  # a tie names nobody
                last_counts[at_floor[0]] = last_counts.get(at_floor[0], 0) + 1
        transfers.append(min(floors.values()))
        # sum/len, not statistics.mean: this runs per step per scrape, and mean's exact
        # fractions cost ~1.5 ms a scrape (bench/bench_exporter.py)
        idles.append(sum(b - floors[stages[r]] for r, b in sync.items()) / len(sync))
    return _Arrivals(last_counts, transfers, idles, syncs)


# The lateness's lower confidence bound: the compared steps in LATENESS_BLOCKS consecutive blocks,
# whose means vary as the lateness does across the window (steps next to each other share a
# stall, blocks far less), and Student's t one-sided at 95 % for LATENESS_BLOCKS - 1 degrees of
# freedom.
LATENESS_BLOCKS = 8
LATENESS_T95 = 1.895


def lateness_bound(syncs: Sequence[Mapping[int, float]], slow: int, peer: int) -> float | None:
    """How much later than `peer` the rank `slow` arrives, at 95 % confidence: over the steps
    (each rank's time at the sync, `_Arrivals.syncs`), the mean of `peer`'s time at the sync
    less `slow`'s, less t times its standard error over blocks of consecutive steps. None with
    fewer than two steps a block."""
    n = len(syncs) // LATENESS_BLOCKS * LATENESS_BLOCKS
    if n < 2 * LATENESS_BLOCKS:
        return None
    late = [s[peer] - s[slow] for s in syncs[-n:]]
    size = n // LATENESS_BLOCKS
    blocks = [sum(late[i : i + size]) / size for i in range(0, n, size)]
    error = statistics.stdev(blocks) / math.sqrt(LATENESS_BLOCKS)
    return sum(blocks) / LATENESS_BLOCKS - LATENESS_T95 * error


def _straggler_mode(
    modes: dict[str, tuple[float, str]],
    live: list[RankView],
    stages: dict[int, int],
    step: float,
    arrivals: _Arrivals,
    aligned: int | None,
    settings: Settings,
    t: Thresholds,
) -> tuple[Straggler | None, float | None, float | None]:
    """The straggler mode into `modes`: the stage's root by arrival lead, named once its skew
    is over the line and it is persistently last (`aligned`: the steps aligned, None: too few
    to tell). Returns the straggler (None: nobody), the skew and the line."""
    here = {r.rank: r for r in live}
    leads = {r.rank: r.arrival_lead_s for r in live if r.arrival_lead_s is not None}
    root = stage_root(leads, stages)
    if root is None or step <= 0:
        return None, None, None
    root_rank, skew, first = root
    slow = here[root_rank]
    threshold = straggler_line(t, settings.skew_threshold_s, step)
    score = min(1.0, skew / step)
    peers_in_stage = sum(1 for r in live if stages[r.rank] == stages[slow.rank])
    need = max(t.last_arrival_share, 1.5 / peers_in_stage)
    share = arrivals.last_counts.get(slow.rank, 0) / aligned if aligned is not None else None
    if skew <= threshold:
        modes["straggler"] = (
            min(score, t.verdict_score - 0.01),
            f"arrival skew {skew * 1e3:.1f} ms is below {threshold * 1e3:.1f} ms",
        )
        return None, skew, threshold
    if share is not None and share < need:
        modes["straggler"] = (
            min(score, t.verdict_score - 0.01),
            f"arrival skew {skew * 1e3:.1f} ms, but no rank is persistently last "
            f"(rank {slow.rank} in {share:.0%} of steps): the last arrival rotates",
        )
        return None, skew, threshold
    # The skew is two means' difference, and on a busy host a rank can trail for seconds by
    # chance: named only where the lateness is over the line beyond the steps' own noise.
    bound = lateness_bound(arrivals.syncs[-LEAD_STEPS:], slow.rank, first)
    if bound is not None and bound <= threshold:
        modes["straggler"] = (
            min(score, t.verdict_score - 0.01),
            f"arrival skew {skew * 1e3:.1f} ms, but within the steps' noise: rank {slow.rank} "
            f"arrives at least {bound * 1e3:.1f} ms after rank {first} (95 % confidence), not "
            f"over {threshold * 1e3:.1f} ms",
        )
        return None, skew, threshold
    peers = [r for r in live if r is not slow and r.arrival_lead_s is not None]
    cause, why = straggler_cause(slow, peers, t)
    often = f", last in {share:.0%} of steps" if share is not None else ""
    modes["straggler"] = (
        max(score, t.verdict_score),
        f"rank {slow.rank} arrives {skew * 1e3:.1f} ms after the earliest peer"
        f"{_of_stage(slow.pipeline_stage)}{often}",
    )
    return Straggler(slow.rank, cause, why, skew, share), skew, threshold


def _sync_modes(
    modes: dict[str, tuple[float, str]],
    shares: dict[str, float],
    live: list[RankView],
    aligned: list[dict[int, RecentStep]],
    enough: bool,
    step: float,
    arrivals: _Arrivals,
    straggler: Straggler | None,
    signal: str,
    node_transfer: NodeInflation | None,
    t: Thresholds,
) -> None:
    """Synchronization amplification (idle at the sync, its share of step time into `shares`)
    and, where the ranks' exposed communication is the signal, fabric contention into
    `modes`: from the aligned steps where there are `enough`, else estimated from the ranks'
    mean waits."""
    mean_step = (
        statistics.mean(
            statistics.median(rec.step_s for rec in by_rank.values()) for by_rank in aligned
        )
        if enough
        else step
    )
    if enough and mean_step > 0:
        idle = statistics.mean(arrivals.idles) / mean_step
        shares["sync_amplification"] = idle
        blame = f", mostly for rank {straggler.rank}" if straggler is not None else ""
        modes["sync_amplification"] = (
            min(1.0, idle / t.idle_share_full),
            f"ranks sit idle at the sync {idle:.0%} of each step waiting for a later peer{blame}",
        )
        if signal == "comm_exposed":
            if node_transfer is not None:
                v = contention_verdict(
                    node_transfer.transfer,
                    node_transfer.transfer_s,
                    t,
                    "this node's ranks",
                    host=node_transfer.work,
                    held_s=node_transfer.held_s,
                )
                modes["fabric_contention"] = (v.score, v.reason)
            else:
                share = statistics.mean(arrivals.transfers) / mean_step
                modes["fabric_contention"] = (
                    0.0,
                    f"no baseline yet for the transfer (after the last rank arrives; "
                    f"{share:.0%} of each step): contention is its inflation against it",
                )
    else:
        waits = [r.wait_mean_s for r in live if r.wait_mean_s is not None]
        if waits and step > 0:
            idle = statistics.mean(waits) / step
            shares["sync_amplification"] = idle
            modes["sync_amplification"] = (
                min(1.0, idle / t.idle_share_full),
                f"ranks wait for peers {idle:.0%} of each step (estimated)",
            )


def _jitter_mode(
    modes: dict[str, tuple[float, str]],
    shares: dict[str, float],
    live: list[RankView],
    t: Thresholds,
) -> None:
    """Runtime jitter: the typical rank's share of step time lost to spikes in its own work."""
    spikes = [(s, r) for r in live if (s := _spike_share(r, t.window)) is not None]
    if not spikes:
        return
    typical = statistics.median(s for s, _ in spikes)
    worst, worst_rank = max(spikes, key=lambda x: x[0])
    cvs = [r.step_time_cv for r in live if r.step_time_cv is not None]
    cv = f"; step-time CV {statistics.median(cvs):.2f}" if cvs else ""
    shares["runtime_jitter"] = typical
    modes["runtime_jitter"] = (
        min(1.0, typical / t.spike_share_full),
        f"ranks lose {typical:.0%} of step time to irregular spikes in their own work "
        f"(worst: rank {worst_rank.rank}, {worst:.0%}){cv}",
    )


def _locality_mode(modes: dict[str, tuple[float, str]], live: list[RankView]) -> None:
    """Locality, over the ranks that report a GPU (a CPU rank's topology holds its network
    link alone)."""
    gpus = [r for r in live if has_gpu(r.topology)]
    if not gpus:
        return
    faults = [(r.rank, locality_fault(r.topology)) for r in gpus]
    faults = [(rank, f) for rank, f in faults if f]
    if faults:
        more = f" (+{len(faults) - 1} more ranks)" if len(faults) > 1 else ""
        reason = f"rank {faults[0][0]}: {faults[0][1]}{more}"
    else:
        reason = _no_locality_fault(gpus)
    modes["locality"] = (1.0 if faults else 0.0, reason)


def _no_locality_fault(gpus: Sequence[RankView]) -> str:
    """The locality reason where no rank has a fault: what was seen, and what was not read."""
    blind_link = [
        r.rank
        for r in gpus
        if (number((r.topology or {}).get("pcie_link_width")) or 0) <= 0
        or (number((r.topology or {}).get("pcie_link_max_width")) or 0) <= 0
    ]
    blind_numa = [r.rank for r in gpus if numa_mismatch(r.topology) is None]
    return "; ".join(
        (
            f"PCIe link width not read for {rank_list(blind_link)}"
            if blind_link
            else "PCIe links at full width",
            f"NUMA placement not known for {rank_list(blind_numa)}"
            if blind_numa
            else "processes on their GPU's NUMA node",
        )
    )


def _victims(
    live: Sequence[RankView],
    straggler: Straggler | None,
    t: Thresholds,
    job_leads: Mapping[int, float] | None = None,
    job_hops: Mapping[str, Mapping[int, int]] | None = None,
) -> tuple[Victim, ...]:
    """The wait chain to a named straggler; a rank waits if it waits a quarter of the lateness."""
    if straggler is None:
        return ()
    lateness = 0.25 * straggler.lateness_s
    return wait_chain(live, straggler.rank, lateness, t.window, job_leads, job_hops)


def _below_score(ratio: float, line: float, t: Thresholds) -> float:
    """0 at a ratio of 1, the verdict score at `line`, linear in the shortfall, at most 1."""
    return min(1.0, t.verdict_score * max(0.0, 1.0 - ratio) / max(1.0 - line, 1e-9))


def contention_verdict(
    inflation: float,
    transfer_s: float,
    t: Thresholds,
    source: str,
    host: float | None = None,
    held_s: float | None = None,
) -> ModeVerdict:
    """fabric_contention: the transfer per step against its own uncontended baseline (the same
    line as SyncscopeFabricContention): the verdict score where it reaches the line.

    `host`: the ranks' own work per step against its own baseline, where known. A host that
    slows everything (its CPUs shared with other work) inflates a host-driven transfer (gloo)
    with the work; only the transfer's inflation beyond the work's is the fabric's.

    `held_s`: how long the node's own reading has stayed over the line (node-local); it is a
    verdict only once that reaches the alert's for: (t.contention_hold_s). None: a reading
    the rules made (job-wide), whose alert applies its for: itself."""
    fabric = fabric_share(inflation, host)
    excess = max(0.0, fabric - 1.0) / max(t.contention_inflation - 1.0, 1e-9)
    score = min(1.0, excess * t.verdict_score)
    also = (
        f"; the ranks' own work is {host:.2f}× its own, so the fabric's share is {fabric:.2f}×"
        if host is not None and host > 1.0
        else ""
    )
    reason = (
        f"the transfer per step (after the last rank arrives) is {transfer_s * 1e3:.1f} ms, "
        f"{inflation:.2f}× its own baseline (line {t.contention_inflation:g}×; {source}){also}"
    )
    if score >= t.verdict_score and held_s is not None and held_s < t.contention_hold_s:
        score = t.verdict_score - 0.01
        reason += f"; over its line {_must_hold(held_s, t.contention_hold_s, 'SyncscopeFabricContention')}"
    return ModeVerdict(round(score, 4), score >= t.verdict_score, reason)


def _job_wide(
    local: Diagnosis,
    ranks: Sequence[RankView],
    settings: Settings,
    t: Thresholds,
    job_wide: JobWide | None,
    node_transfer: NodeInflation | None = None,
) -> Diagnosis:
    """The node's diagnosis, with what only the whole job can tell taken from Prometheus.
    The job-wide transfer's inflation is corrected, as the node-local one is, by this node's
    own work against its baseline (`node_transfer.work`): a host that slows this node's ranks
    slows a host-driven transfer (gloo) that every node waits on."""
    live = [r for r in ranks if not r.stale and r.steps_total > 0]
    elsewhere = max((r.world_size for r in live), default=0) - len(live)
    if not live or (job_wide is None and elsewhere <= 0):
        return local  # the whole job reports here: the node's view is the job's
    modes = dict(local.modes)
    straggler, skew, threshold = local.straggler, local.skew_s, local.skew_line_s
    step = median([r.step_time_median_s for r in live if r.step_time_median_s]) or 0.0

    def verdict(score: float, why: str) -> ModeVerdict:
        return ModeVerdict(round(score, 4), score >= t.verdict_score, why)

    if job_wide is None:
        modes["fabric_contention"] = verdict(
            0.0,
            f"node-local view ({len(live)} of {len(live) + elsewhere} ranks here): what this "
            "node's ranks wait for ranks elsewhere cannot be told from the transfer here; give "
            "the exporter --prometheus-url for the job-wide view",
        )
        return dataclasses.replace(local, modes=modes)

    # Where the whole job reports here the node's view, with its per-step count of last
    # arrivals, names the straggler (over the job-wide leads, exactly and without a hold);
    # the reading adds what the node cannot measure alone (amplification, the fabric).
    reading = _over_line(job_wide, t, settings.skew_threshold_s, step) if elsewhere > 0 else None
    if reading is not None:
        slow_rank, skew, threshold, window_step = reading
        score = min(1.0, skew / window_step)
        held = _held_for(job_wide, slow_rank, t, settings.skew_threshold_s, step)
        if skew <= threshold:
            straggler = None
            modes["straggler"] = verdict(
                min(score, t.verdict_score - 0.01),
                f"job-wide arrival skew {skew * 1e3:.1f} ms is below {threshold * 1e3:.1f} ms",
            )
        elif held is None or held < t.straggler_hold_s:
            straggler = None
            modes["straggler"] = verdict(
                min(score, t.verdict_score - 0.01),
                f"rank {slow_rank} arrives {skew * 1e3:.1f} ms after the earliest rank of the "
                f"job{_of_stage(job_wide.stages.get(slow_rank))}, over {threshold * 1e3:.1f} "
                f"ms for {held or 0:.0f} s of the {t.straggler_hold_s:g} s it must hold "
                "(SyncscopeStraggler's for: and window; job-wide, from Prometheus)",
            )
        else:
            here = {r.rank: r for r in live}
            slow = here.get(slow_rank)
            if slow is not None:
                cause, why = straggler_cause(slow, [r for r in live if r is not slow], t)
            else:
                cause, why = (
                    "unknown",
                    "it runs on another node; that node's exporter names the cause",
                )
            straggler = Straggler(slow_rank, cause, why, skew, None)
            modes["straggler"] = verdict(
                max(score, t.verdict_score),
                f"rank {slow_rank} arrives {skew * 1e3:.1f} ms after the earliest rank of the "
                f"job{_of_stage(job_wide.stages.get(slow_rank))} (job-wide, from Prometheus)",
            )
    if job_wide.amplification is not None:
        blame = f", mostly for rank {straggler.rank}" if straggler is not None else ""
        modes["sync_amplification"] = verdict(
            min(1.0, job_wide.amplification / t.idle_share_full),
            f"ranks of the job sit idle at collectives {job_wide.amplification:.0%} of each step "
            f"waiting for a later peer{blame} (job-wide, from Prometheus)",
        )
    if job_wide.transfer_inflation is not None and job_wide.transfer_s is not None:
        modes["fabric_contention"] = contention_verdict(
            job_wide.transfer_inflation,
            job_wide.transfer_s,
            t,
            "job-wide, from Prometheus",
            host=node_transfer.work if node_transfer is not None else None,
        )
    else:
        modes["fabric_contention"] = verdict(
            0.0, "no job-wide transfer baseline from Prometheus yet"
        )
    if job_wide.slowest_link is not None:
        node, ratio = job_wide.slowest_link
        modes["slow_link"] = verdict(
            _below_score(ratio, t.slow_link_ratio, t),
            f"node {node}'s link is known to carry {ratio:.0%} of what the job's median node's "
            f"does (line {t.slow_link_ratio:.0%}; job-wide, from Prometheus)",
        )
    return dataclasses.replace(
        local,
        modes=modes,
        straggler=straggler,
        skew_s=skew,
        skew_line_s=threshold,
        victims=_victims(live, straggler, t, job_wide.job_waits(), job_wide.hops),
    )
