"""Per-step pooling of a node's ranks: each rank's wait at collectives, step by step.

At step k a rank's time in one kind of collective (op, group, size class) is d(r,k) = T(k) +
W(r,k): the transfer after the last arrival plus its wait for the last rank, whose own d is T(k).
Once every rank reporting here has delivered step k, W(r,k) = d(r,k) − min over those ranks of
d(·,k). That is exact when the whole job reports to this exporter. On a multi-node job it is the
wait for the last rank *on this node*; what the node's ranks all wait for ranks elsewhere stays in
the node's minimum, which the exporter exports (syncscope_collective_transfer_seconds_total,
syncscope_pooled_steps_total) for Prometheus to compare across nodes.

Across nodes Prometheus needs the job's transfer per step, min over nodes of each node's minimum
*at the same step*; a minimum over nodes of per-node means reads high whenever the last rank moves
between nodes from step to step (jitter), and the amplification then reads low (0.14 against a
pooled truth of 0.23 on two emulated nodes). So each exporter also keeps its minimum at sampled
steps, in rings every exporter indexes alike (`SAMPLE_STRIDES`, `SAMPLE_SLOTS`): Prometheus takes,
per slot, the minimum over nodes where every node holds the same step. Sampling by step number is
independent of the values, so the mean over slots is an unbiased estimate of the per-step
transfer. A ring agrees across nodes once it spans more steps than the nodes' reports and
scrapes lag each other; strides of 8 to 4096 steps keep one ring agreed whether steps take 10 ms
or 10 s and scrapes come every 1 or 15 s, at 64 series per node and job.

Issue 15 replaced a rolling minimum over 256 calls by this: the minimum of many samples sits
several standard deviations of the transfer below its typical value, and every rank's lead and
the amplification read that bias as waiting (3× the true amplification on a clean run).
Nothing here compares clocks across processes; ranks' reports arrive in step order, so a step
is complete for a rank once it has reported that step or a later one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from syncscope.arrival import Key

Rank = int
SAMPLE_STRIDES = (8, 64, 512, 4096)  # steps between samples, a ring each; alike everywhere
SAMPLE_SLOTS = 8  # samples each ring keeps: slot = (step // stride) % SAMPLE_SLOTS
SAMPLE_FROM_STEP = 16  # the first steps connect, rebuild DDP's buckets and warm allocators


class WaitSink(Protocol):
    """Where the pool adds a collective's pooled wait: the rank's totals for its (op, group)."""

    wait_seconds: float


@dataclass
class _RankStep:
    """One rank's step k, once its step row has arrived: its time per collective kind."""

    step_s: float
    phases: tuple[float, ...]
    by_key: dict[Key, tuple[float, WaitSink]]


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


@dataclass
class JobPool:
    """One job's ranks on this node, pooled per step."""

    transfer_window: int = 64  # pooled steps each kind's transfer estimate averages over
    max_open_steps: int = 512  # per rank: collectives of steps whose row never came are dropped
    max_pending_steps: int = 4096  # beyond it the oldest step is pooled without a silent rank
    pooled_steps_total: int = 0  # steps every reporting rank delivered
    transfer_seconds_total: float = 0.0  # the sum over those steps of the node's minima
    _open: dict[Rank, dict[int, dict[Key, tuple[float, WaitSink]]]] = field(default_factory=dict)
    _pending: dict[int, dict[Rank, _RankStep]] = field(default_factory=dict)
    _latest: dict[Rank, int] = field(default_factory=dict)  # newest step row per rank
    _transfer: dict[Key, deque[float]] = field(default_factory=dict)
    samples: dict[tuple[int, int], Sample] = field(default_factory=dict)  # by (stride, slot)

    def add_collective(
        self, rank: Rank, key: Key, step: int, duration: float, sink: WaitSink
    ) -> None:
        """A collective of `rank` in `step`, before or with that step's row."""
        by_step = self._open.setdefault(rank, {})
        by_key = by_step.get(step)
        if by_key is None:
            if len(by_step) >= self.max_open_steps:
                del by_step[min(by_step)]
            by_key = by_step[step] = {}
        seconds, _ = by_key.get(key, (0.0, sink))
        by_key[key] = (seconds + duration, sink)

    def add_step(self, rank: Rank, step: int, step_s: float, phases: tuple[float, ...]) -> None:
        by_key = self._open.get(rank, {}).pop(step, {})
        self._pending.setdefault(step, {})[rank] = _RankStep(step_s, phases, by_key)
        if step > self._latest.get(rank, -1):
            self._latest[rank] = step

    def complete(self, reporting: Iterable[Rank]) -> list[Pooled]:
        """Pool every step that each of `reporting` has delivered or passed; oldest first."""
        ranks = set(reporting)
        done: list[Pooled] = []
        for step in sorted(self._pending):
            entries = self._pending[step]
            waiting = any(r not in entries and self._latest.get(r, -1) <= step for r in ranks)
            if waiting and len(self._pending) <= self.max_pending_steps:
                break  # a rank may still deliver this step; later steps wait, in order
            del self._pending[step]
            done.extend(self._pool(step, entries, complete=ranks <= entries.keys()))
        return done

    def _pool(self, step: int, entries: dict[Rank, _RankStep], complete: bool) -> list[Pooled]:
        minima: dict[Key, float] = {}
        for entry in entries.values():
            for key, (seconds, _) in entry.by_key.items():
                if seconds < minima.get(key, float("inf")):
                    minima[key] = seconds
        if complete:
            # The node's minimum is its transfer only where every rank here took part (one
            # rank alone included: across nodes Prometheus takes the minimum over nodes).
            transfer = sum(minima.values())
            self.pooled_steps_total += 1
            self.transfer_seconds_total += transfer
            for stride in SAMPLE_STRIDES:
                if step % stride == 0 and step >= SAMPLE_FROM_STEP:
                    slot = step // stride % SAMPLE_SLOTS
                    self.samples[(stride, slot)] = Sample(stride, slot, step, transfer)
            for key, low in minima.items():
                series = self._transfer.get(key)
                if series is None:
                    series = self._transfer[key] = deque(maxlen=self.transfer_window)
                series.append(low)
        out = []
        for rank, entry in entries.items():
            wait = 0.0
            if len(entries) > 1:
                for key, (seconds, sink) in entry.by_key.items():
                    extra = seconds - minima[key]
                    sink.wait_seconds += extra
                    wait += extra
            out.append(Pooled(rank, step, entry.step_s, entry.phases, wait))
        return out

    def transfers(self) -> dict[Key, float]:
        """Each collective kind's transfer: the mean of its recent per-step node minima."""
        return {key: sum(s) / len(s) for key, s in self._transfer.items() if s}

    def forget(self, rank: Rank) -> None:
        """A rank restarted or expired: drop what it had not finished."""
        self._open.pop(rank, None)
        self._latest.pop(rank, None)
        for entries in self._pending.values():
            entries.pop(rank, None)
        for step in [s for s, entries in self._pending.items() if not entries]:
            del self._pending[step]
