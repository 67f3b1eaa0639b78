"""Per-step pooling of a node's ranks: each rank's wait at collectives, step by step.

At step k a rank's time in one kind of collective (op, group, size class) is d(r,k) = T(k) +
W(r,k): the transfer after the last arrival plus its wait for the last rank, whose own d is T(k).
Once every rank reporting here has delivered step k, W(r,k) = d(r,k) − min over those ranks of
d(·,k): exact when the whole job reports here; on a multi-node job, the wait for the last rank
*on this node*. What they all wait for ranks elsewhere stays in the node's minimum, exported
(syncscope_collective_transfer_seconds_total, syncscope_pooled_steps_total) for Prometheus.

Across nodes the job's transfer per step is the min over nodes of each node's minimum *at the
same step*; a min over per-node means reads high when the last rank moves between nodes (and the
amplification low). So each exporter also keeps its minimum at sampled steps, in rings every
exporter indexes alike (`SAMPLE_STRIDES`, `SAMPLE_SLOTS`), and Prometheus takes per slot the min
over nodes holding the same step. Sampling by step number is independent of the values, so the
mean over slots is unbiased. The strides keep one ring agreed across nodes for steps of 10 ms to
10 s and scrapes every 1 to 15 s; slots set how long a sample stays visible, not how many a
window sees. Not a rolling minimum over many calls: that sits several standard deviations below
the typical transfer, and leads and amplification would read the bias as waiting. Nothing here
compares clocks across processes: reports arrive in step order, so a step is complete for a
rank once it has reported that step or a later one.

Cost is proportional to what a call receives or pools, never to the number of ranks (counts per
step, a heap of pending steps, means recomputed only when changed); pending rows hold only
numbers and interned keys, which the garbage collector stops tracking.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterable, Iterator, KeysView
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from itertools import takewhile
from typing import Any, NamedTuple, Protocol

from syncscope.arrival import Key
from syncscope.wire import Phase, blocked_s

Rank = int
SAMPLE_STRIDES = (8, 64, 512)  # steps between samples, a ring each; alike everywhere
SAMPLE_SLOTS = 6  # samples each ring keeps: slot = (step // stride) % SAMPLE_SLOTS
SAMPLE_FROM_STEP = 16  # the first steps connect, rebuild DDP's buckets and warm allocators
NO_STEP = -1  # the newest step of a rank that has delivered none


class WaitSink(Protocol):
    """Where the pool adds a collective's pooled wait: the rank's totals for its (op, group)."""

    wait_seconds: float


# One rank's step k, once its step row has arrived: (step_s, phases), and apart from it its time
# per collective kind, {key: seconds}. Neither holds anything the garbage collector must follow
# (numbers, and keys interned long since): the dict is never tracked, the tuple no longer once
# the collector has seen it, before it would promote it (see the module's docstring).
_RankStep = tuple[float, tuple[float, ...]]
BASELINE_BLOCKS = 10  # blocks before the node's transfer has a baseline
_NO_COLLECTIVES: dict[Key, float] = {}  # shared, never written to


class NodeInflation(NamedTuple):
    """The node's recent transfer per step against its own baseline, and the ranks' own work
    against its own: a host that slows everything (CPUs shared with other tenants) inflates
    both, contention on the fabric the transfer alone."""

    transfer_s: float  # the median of the recent blocks' transfer per step
    transfer: float  # it ÷ the 10th percentile of the baseline window's blocks
    work: float  # the same ratio for the node's work per step (step − exposed comm − pacing)
    # How long the fabric's share (fabric_share) has stayed at or over the pool's contention
    # line, block after block (s; 0: not over it now)
    held_s: float = 0.0


def fabric_share(transfer: float, work: float | None) -> float:
    """The transfer's inflation beyond the ranks' own work's (`work` None: not known): a host
    that slows everything (its CPUs shared) inflates a host-driven transfer (gloo) with the
    work, so only what the transfer gained beyond that is the fabric's."""
    return transfer / max(1.0, work or 1.0)


def _least_blocked(entries: dict[Rank, _RankStep], stages: dict[Rank, int]) -> dict[int, float]:
    """The least blocked time (wire.BLOCKED: exposed communication and pacing's delay) of the
    step's ranks, per pipeline stage (a rank of no stage: stage 0), or {} where no rank's row
    has exposed communication (an agent that times no waits: the per-kind collective waits are
    all there is)."""
    least: dict[int, float] = {}
    seen = False
    for rank, (_step_s, phases) in entries.items():
        if len(phases) <= Phase.COMM_EXPOSED:
            return {}
        seen = seen or phases[Phase.COMM_EXPOSED] > 0
        blocked = blocked_s(phases)
        stage = stages.get(rank, 0)
        if blocked < least.get(stage, float("inf")):
            least[stage] = blocked
    return least if seen else {}


@dataclass
class Pooled:
    """A finished step of one rank: its wait for the last peer on this node (0 if alone)."""

    rank: Rank
    step: int
    step_s: float
    phases: tuple[float, ...]
    wait_s: float


@dataclass(frozen=True)
class Sample:
    """A ring slot: the node's transfer (sum over collective kinds of its minima) at a step."""

    stride: int
    slot: int
    step: int
    transfer_s: float


def _push(heap: list[int], step: int, live: dict[int, Any]) -> None:
    """Push `step`, just added to `live`, onto a heap whose entries not in `live` are skipped
    when they come up; rebuilt from `live` once those outnumber the rest (amortised O(1))."""
    if len(heap) > 2 * len(live) + 64:
        heap[:] = live
        heapify(heap)
    else:
        heappush(heap, step)


@dataclass
class JobPool:
    """One job's ranks on this node, pooled per step.

    The reporting ranks (those a pending step waits for) are given to `complete`, or kept here
    by `join` and `leave` as they come and go, which the exporter's store does.

    A pipeline's ranks (`set_stage`) wait, step by step, only beyond the least blocked rank of
    their own stage: the stages of a pipeline do different work by design (the last one
    computes the head and the loss), so one stage's ranks always wait in its point-to-point
    ops longer than another's, and against the job's least blocked rank every rank of a
    lighter stage would read as waiting for a straggler. The waits per collective kind (which
    group a rank waits in, for the wait chain) and the node's transfer stay over all its
    ranks: a rank that waits in pp for a slow stage waits there whatever its stage.
    """

    transfer_window: int = 64  # pooled steps each kind's transfer estimate averages over
    max_open_steps: int = 512  # per rank: collectives of steps whose row never came are dropped
    max_pending_steps: int = 4096  # beyond it the oldest step is pooled without a silent rank
    pooled_steps_total: int = 0  # steps every reporting rank delivered
    transfer_seconds_total: float = 0.0  # the sum over those steps of the node's minima
    # rank -> step -> key -> seconds: collectives of steps whose row has not come yet.
    _open: dict[Rank, dict[int, dict[Key, float]]] = field(default_factory=dict)
    # rank -> key -> (the key, interned, and the sink its waits go to). A rank's sink per kind
    # stays the same object until forget(): its (op, group) totals in the store.
    _sinks: dict[Rank, dict[Key, tuple[Key, WaitSink]]] = field(default_factory=dict)
    _pending: dict[int, dict[Rank, _RankStep]] = field(default_factory=dict)
    # step -> rank -> key -> seconds: the same steps and ranks, in the same order.
    _pending_seconds: dict[int, dict[Rank, dict[Key, float]]] = field(default_factory=dict)
    _pending_order: list[int] = field(default_factory=list)  # heap of steps, some not pending
    _latest: dict[Rank, int] = field(default_factory=dict)  # newest step row per rank
    # The reporting ranks, each with the newest step it is counted at in _at_latest; ranks
    # whose newest step moved since are in _moved until complete() counts them again.
    _reporting: dict[Rank, int] = field(default_factory=dict)
    _at_latest: dict[int, int] = field(default_factory=dict)  # newest step -> reporting ranks
    _latest_order: list[int] = field(default_factory=list)  # heap of _at_latest's steps, + gone
    _moved: set[Rank] = field(default_factory=set)
    _transfer: dict[Key, deque[float]] = field(default_factory=dict)
    _transfer_mean: dict[Key, float] = field(default_factory=dict)  # _transfer's keys, in order
    _changed: dict[Key, None] = field(default_factory=dict)  # kinds whose mean is out of date
    samples: dict[tuple[int, int], Sample] = field(default_factory=dict)  # by (stride, slot)
    # The node's transfer and work per step over blocks of `transfer_window` pooled steps, for
    # the node-local contention verdict: (monotonic time the block closed, mean transfer, mean
    # work), the blocks of the last `baseline_window_s` (the rules' contention-baseline
    # window). Recent: the median of the blocks of the last `recent_window_s` (the rate window).
    baseline_window_s: float = 3600.0
    recent_window_s: float = 60.0
    # SyncscopeFabricContention's line: from the block at which the inflation (the fabric's
    # share) reached it, without a block under it since, the verdict's hold is counted
    contention_line: float = 1.5
    _over_since: float | None = None
    history: deque[tuple[float, float, float]] = field(default_factory=lambda: deque(maxlen=8192))
    _block: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # [transfer, work, n]
    # The node's transfer (sum of its minima) at each of the last `transfer_window` pooled
    # steps: per step as Prometheus takes it, a kind that skips steps counting 0 at those.
    _per_step: deque[float] = field(default_factory=deque)
    _stages: dict[Rank, int] = field(default_factory=dict)  # pipeline stage by rank, where known

    def set_stage(self, rank: Rank, stage: int) -> None:
        """`rank` is stage `stage` of a pipeline (wire.pipeline_stage)."""
        self._stages[rank] = stage

    def add_collective(
        self, rank: Rank, key: Key, step: int, duration: float, sink: WaitSink
    ) -> None:
        """A collective of `rank` in `step`, before or with that step's row.

        `sink` is the same object for a rank and kind until forget(rank) (the store's totals for
        the rank's (op, group)); given another, the rank's steps not yet pooled add to it.
        """
        by_step = self._open.get(rank)
        if by_step is None:
            by_step = self._open[rank] = {}
            self._sinks[rank] = {}
        sinks = self._sinks[rank]
        known = sinks.get(key)
        if known is None or known[1] is not sink:
            known = sinks[key] = (known[0] if known is not None else key, sink)
        key = known[0]
        by_key = by_step.get(step)
        if by_key is None:
            if len(by_step) >= self.max_open_steps:
                del by_step[min(by_step)]
            by_key = by_step[step] = {}
        by_key[key] = by_key.get(key, 0.0) + duration

    def add_step(self, rank: Rank, step: int, step_s: float, phases: tuple[float, ...]) -> None:
        by_step = self._open.get(rank)
        by_key = by_step.pop(step, None) if by_step else None
        entries = self._pending.get(step)
        if entries is None:
            entries = self._pending[step] = {}
            self._pending_seconds[step] = {}
            _push(self._pending_order, step, self._pending)
        entries[rank] = (step_s, phases)
        self._pending_seconds[step][rank] = by_key or _NO_COLLECTIVES
        if step > self._latest.get(rank, NO_STEP):
            self._latest[rank] = step
            if rank in self._reporting:
                self._moved.add(rank)

    def join(self, rank: Rank) -> None:
        """`rank` reports: pending steps wait for it until it has delivered or passed them."""
        if rank not in self._reporting:
            at = self._reporting[rank] = self._latest.get(rank, NO_STEP)
            self._count(at, 1)

    def leave(self, rank: Rank) -> None:
        """`rank` went silent: steps no longer wait for it."""
        at = self._reporting.pop(rank, None)
        if at is not None:
            self._count(at, -1)
            self._moved.discard(rank)

    @property
    def reporting(self) -> KeysView[Rank]:
        """The ranks pending steps wait for (as of the last join, leave or complete)."""
        return self._reporting.keys()

    def complete(self, reporting: Iterable[Rank] | None = None) -> list[Pooled]:
        """Pool every step that each reporting rank has delivered or passed; oldest first.

        `reporting`: the ranks to wait for, replacing those joined; None keeps them.
        """
        return list(self.completed(reporting))

    def completed(self, reporting: Iterable[Rank] | None = None) -> Iterator[Pooled]:
        """`complete`, one pooled rank-step at a time (a step's ranks together, in order).

        Consume it whole: each rank's wait goes to its sinks as its rank-step is yielded.
        """
        if reporting is not None:
            ranks = set(reporting)
            for rank in [r for r in self._reporting if r not in ranks]:
                self.leave(rank)
            for rank in ranks:
                self.join(rank)
        self._recount()
        pending, order = self._pending, self._pending_order
        while order:
            step = order[0]
            entries = pending.get(step)
            if entries is None:  # pooled or forgotten already
                heappop(order)
                continue
            if len(pending) <= self.max_pending_steps and self._waiting(step, entries):
                break  # a rank may still deliver this step; later steps wait, in order
            heappop(order)
            del pending[step]
            seconds = self._pending_seconds.pop(step)
            yield from self._pool(step, entries, seconds, complete=self._covers(entries))

    def _count(self, at: int, delta: int) -> None:
        n = self._at_latest.get(at, 0) + delta
        if n:
            self._at_latest[at] = n
            if delta > 0 and n == 1:  # new here: a step the heap may not hold
                _push(self._latest_order, at, self._at_latest)
        else:
            del self._at_latest[at]

    def _recount(self) -> None:
        """Count the reporting ranks whose newest step moved (or was forgotten) at the new one."""
        for rank in self._moved:
            at = self._reporting.get(rank)
            now = self._latest.get(rank, NO_STEP)
            if at is not None and at != now:
                self._count(at, -1)
                self._count(now, 1)
                self._reporting[rank] = now
        self._moved.clear()

    def _waiting(self, step: int, entries: dict[Rank, _RankStep]) -> bool:
        """Whether a reporting rank has neither delivered `step` nor passed it.

        A rank that delivered a step is counted at it or a later one, so with `low` the lowest
        newest step over the reporting ranks: steps below it wait for no one, steps above it wait
        for the ranks at `low`, and step `low` waits only for one of those missing from it (it
        delivered the step, which was pooled and delivered again by a rank not waited for then).
        """
        order, counts = self._latest_order, self._at_latest
        while order and order[0] not in counts:
            heappop(order)
        if not order or step < order[0]:
            return False
        low = order[0]
        if step > low:
            return True
        at_low = counts[low]
        if at_low > len(entries):
            return True
        reporting = self._reporting
        return sum(1 for r in entries if reporting.get(r) == low) < at_low

    def _covers(self, entries: dict[Rank, _RankStep]) -> bool:
        """Whether every reporting rank delivered this step."""
        return self._reporting.keys() <= entries.keys()  # False at once if more are reporting

    def _pool(
        self,
        step: int,
        entries: dict[Rank, _RankStep],
        by_rank: dict[Rank, dict[Key, float]],
        complete: bool,
    ) -> list[Pooled]:
        minima: dict[Key, float] = {}
        for by_key in by_rank.values():
            for key, seconds in by_key.items():
                if seconds < minima.get(key, float("inf")):
                    minima[key] = seconds
        if complete:
            # The node's minimum is its transfer only where every rank here took part (one
            # rank alone included: across nodes Prometheus takes the minimum over nodes).
            transfer = sum(minima.values())
            self.pooled_steps_total += 1
            self.transfer_seconds_total += transfer
            self._per_step.append(transfer)
            if len(self._per_step) > self.transfer_window:
                self._per_step.popleft()
            if step >= SAMPLE_FROM_STEP:
                for stride in SAMPLE_STRIDES:
                    if step % stride == 0:
                        slot = step // stride % SAMPLE_SLOTS
                        self.samples[(stride, slot)] = Sample(stride, slot, step, transfer)
                # The node's work: its fastest rank's step less exposed comm and pacing (the
                # least a rank here needed; a straggler's own slowness is not the host's).
                work = min(
                    step_s - blocked_s(phases)
                    if len(phases) > Phase.PACING  # rows in the wire's order (tests: fewer)
                    else step_s
                    for step_s, phases in entries.values()
                )
                self._close_block(transfer, work)
            for key, low in minima.items():
                series = self._transfer.get(key)
                if series is None:
                    series = self._transfer[key] = deque(maxlen=self.transfer_window)
                    self._transfer_mean[key] = low
                series.append(low)
                self._changed[key] = None
        alone = len(entries) <= 1
        stages = self._stages
        least_blocked = _least_blocked(entries, stages) if not alone else {}
        out = []
        for (rank, (step_s, phases)), by_key in zip(entries.items(), by_rank.values(), strict=True):
            wait = 0.0
            if not alone and by_key:
                extras = {key: seconds - minima[key] for key, seconds in by_key.items()}
                wait = sum(extras.values())
                # Issue to completion beyond the node's least, per kind and group: async ops
                # posted ahead (a pipeline's receives) overlap compute and each other, so their
                # sum can exceed the step. No rank waits longer than it was blocked: where the
                # agent times its waits, the kinds share that time in their proportions.
                scale = 1.0
                if least_blocked and wait > phases[Phase.COMM_EXPOSED]:
                    scale = phases[Phase.COMM_EXPOSED] / wait
                sinks = self._sinks[rank]
                for key, extra in extras.items():
                    sinks[key][1].wait_seconds += extra * scale
            if least_blocked:
                # The rank's wait is what it spent blocked (in collectives, or held back by
                # pacing) beyond the rank that was blocked least: async collectives overlap
                # compute, so their issue-to-completion times (the per-kind waits above) are
                # not all waiting.
                wait = blocked_s(phases) - least_blocked[stages.get(rank, 0)]
            out.append(Pooled(rank, step, step_s, phases, wait))
        return out

    def _close_block(self, transfer: float, work: float) -> None:
        block = self._block
        block[0] += transfer
        block[1] += work
        block[2] += 1
        if block[2] >= self.transfer_window:
            now = time.monotonic()
            self.history.append((now, block[0] / block[2], block[1] / block[2]))
            block[0] = block[1] = block[2] = 0.0
            while self.history and self.history[0][0] < now - self.baseline_window_s:
                self.history.popleft()
            got = self.inflation()
            if got is not None and fabric_share(got.transfer, got.work) >= self.contention_line:
                if self._over_since is None:
                    self._over_since = now
            else:
                self._over_since = None

    def inflation(self) -> NodeInflation | None:
        """The node's recent transfer and work per step against their own baselines, or None
        before BASELINE_BLOCKS blocks (a 10th percentile of fewer is the single fastest block).
        Recent: the median of the blocks closed in the last `recent_window_s` (the latest block
        at least), so that one block a stall of the machine inflated is not contention (a
        64-step block is ~1 s at 20 ms steps). Baseline: the 10th percentile of the blocks in
        the baseline window."""
        history = self.history
        if len(history) < BASELINE_BLOCKS:
            return None
        since = history[-1][0] - self.recent_window_s
        recent = list(takewhile(lambda b: b[0] >= since, reversed(history)))
        p10 = int(0.1 * (len(history) - 1))
        transfer, work = (statistics.median(b[i] for b in recent) for i in (1, 2))
        transfer_base, work_base = (sorted(b[i] for b in history)[p10] for i in (1, 2))
        if transfer_base <= 0:
            return None
        over = self._over_since
        return NodeInflation(
            transfer,
            transfer / transfer_base,
            work / work_base if work_base > 0 else 1.0,
            history[-1][0] - over if over is not None else 0.0,
        )

    def transfer_per_step(self) -> float | None:
        """The node's transfer per pooled step over the last `transfer_window` of them: the
        sum over kinds of `transfers()` weighted by how often each occurs; None before any."""
        per_step = self._per_step
        return sum(per_step) / len(per_step) if per_step else None

    def transfers(self) -> dict[Key, float]:
        """Each collective kind's transfer: the mean of its recent per-step node minima."""
        if self._changed:
            for key in self._changed:
                series = self._transfer[key]
                self._transfer_mean[key] = sum(series) / len(series)
            self._changed.clear()
        return dict(self._transfer_mean)

    def forget(self, rank: Rank) -> None:
        """A rank restarted or expired: drop what it had not finished."""
        self._open.pop(rank, None)
        self._sinks.pop(rank, None)
        self._latest.pop(rank, None)
        if rank in self._reporting:
            self._moved.add(rank)
        for entries in self._pending.values():
            entries.pop(rank, None)
        for by_rank in self._pending_seconds.values():
            by_rank.pop(rank, None)
        for step in [s for s, entries in self._pending.items() if not entries]:
            del self._pending[step]
            del self._pending_seconds[step]
