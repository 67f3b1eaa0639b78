"""Ingest cost linear in what the exporter receives (issue 20): the pool and the store do work
in proportion to the records they get and the steps those complete, never to the number of ranks;
and the incremental bookkeeping that makes it so says exactly what the old full scans said.

Work is counted as Python lines executed in exporter/store.py and exporter/pooling.py (a loop
over ranks runs a line per rank), never timed; bench/bench_exporter.py --ranks-scaling times it.
"""

from __future__ import annotations

import gc
import json
import random
import sys
from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import syncscope.exporter.pooling as pooling_module
import syncscope.exporter.store as store_module
from syncscope.exporter.app import parse_batch
from syncscope.exporter.diagnosis import snapshot
from syncscope.exporter.pooling import SAMPLE_FROM_STEP, SAMPLE_SLOTS, SAMPLE_STRIDES, JobPool
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import ByLastReport, Store

from syncscope.arrival import Key, collective_key

KEYS = [collective_key(op, "pg", n) for op, n in (("ddp_grad_sync", 8e6), ("all_reduce", 64))]


@dataclass
class Sink:
    wait_seconds: float = 0.0


# -- the pool as it was: every pending step checked against every reporting rank ----------------
@dataclass
class OldPool:
    """exporter/pooling.py's JobPool before issue 20, verbatim but for names: the reference."""

    transfer_window: int = 64
    max_open_steps: int = 512
    max_pending_steps: int = 4096
    pooled_steps_total: int = 0
    transfer_seconds_total: float = 0.0
    open: dict[int, dict[int, dict[Key, tuple[float, Sink]]]] = field(default_factory=dict)
    pending: dict[int, dict[int, tuple[float, dict[Key, tuple[float, Sink]]]]] = field(
        default_factory=dict
    )
    latest: dict[int, int] = field(default_factory=dict)
    transfer: dict[Key, deque[float]] = field(default_factory=dict)
    samples: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)

    def add_collective(self, rank: int, key: Key, step: int, duration: float, sink: Sink) -> None:
        by_step = self.open.setdefault(rank, {})
        by_key = by_step.get(step)
        if by_key is None:
            if len(by_step) >= self.max_open_steps:
                del by_step[min(by_step)]
            by_key = by_step[step] = {}
        seconds, _ = by_key.get(key, (0.0, sink))
        by_key[key] = (seconds + duration, sink)

    def add_step(self, rank: int, step: int, step_s: float) -> None:
        by_key = self.open.get(rank, {}).pop(step, {})
        self.pending.setdefault(step, {})[rank] = (step_s, by_key)
        if step > self.latest.get(rank, -1):
            self.latest[rank] = step

    def complete(self, reporting: set[int]) -> list[tuple[int, int, float, float]]:
        done = []
        for step in sorted(self.pending):
            entries = self.pending[step]
            waiting = any(r not in entries and self.latest.get(r, -1) <= step for r in reporting)
            if waiting and len(self.pending) <= self.max_pending_steps:
                break
            del self.pending[step]
            done.extend(self.pool(step, entries, reporting <= entries.keys()))
        return done

    def pool(self, step: int, entries: dict, complete: bool) -> list[tuple[int, int, float, float]]:
        minima: dict[Key, float] = {}
        for _, by_key in entries.values():
            for key, (seconds, _) in by_key.items():
                minima[key] = min(seconds, minima.get(key, float("inf")))
        if complete:
            transfer = sum(minima.values())
            self.pooled_steps_total += 1
            self.transfer_seconds_total += transfer
            for stride in SAMPLE_STRIDES:
                if step % stride == 0 and step >= SAMPLE_FROM_STEP:
                    self.samples[(stride, step // stride % SAMPLE_SLOTS)] = (step, transfer)
            for key, low in minima.items():
                self.transfer.setdefault(key, deque(maxlen=self.transfer_window)).append(low)
        out = []
        for rank, (step_s, by_key) in entries.items():
            wait = 0.0
            if len(entries) > 1:
                for key, (seconds, sink) in by_key.items():
                    sink.wait_seconds += seconds - minima[key]
                    wait += seconds - minima[key]
            out.append((rank, step, step_s, wait))
        return out

    def transfers(self) -> dict[Key, float]:
        return {key: sum(s) / len(s) for key, s in self.transfer.items() if s}

    def forget(self, rank: int) -> None:
        self.open.pop(rank, None)
        self.latest.pop(rank, None)
        for entries in self.pending.values():
            entries.pop(rank, None)
        for step in [s for s, entries in self.pending.items() if not entries]:
            del self.pending[step]


@pytest.mark.parametrize("seed", range(12))
def test_pooling_matches_the_old_full_scan_under_random_traffic(seed):
    """Ranks that lag, skip steps, deliver late, restart, go silent and come back, and a pending
    limit small enough to overflow: the pool given its ranks per call (complete(reporting)) and
    the pool kept by join/leave (the store's way) pool exactly what the old scan pooled."""
    rng = random.Random(seed)
    ranks = list(range(rng.choice((2, 5, 9))))
    limit = rng.choice((6, 40, 4096))
    old = OldPool(transfer_window=5, max_pending_steps=limit)
    given = JobPool(transfer_window=5, max_pending_steps=limit)
    kept = JobPool(transfer_window=5, max_pending_steps=limit)
    sinks = {
        name: {r: {k: Sink() for k in KEYS} for r in ranks} for name in ("old", "given", "kept")
    }
    nxt = dict.fromkeys(ranks, 0)
    reporting = set(ranks)
    for r in ranks:
        kept.join(r)
    for _ in range(600):
        r = rng.choice(ranks)
        roll = rng.random()
        if roll < 0.04:  # a restart: what it had not finished is dropped
            old.forget(r)
            given.forget(r)
            kept.forget(r)
            for name in sinks:
                sinks[name][r] = {k: Sink() for k in KEYS}
            nxt[r] = max(0, nxt[r] - rng.randint(0, 5))
        elif roll < 0.10:  # silent, or back
            if r in reporting:
                reporting.discard(r)
                kept.leave(r)
            else:
                reporting.add(r)
                kept.join(r)
        else:
            # Now and then a late or repeated step, or a gap.
            step = max(0, nxt[r] + rng.randint(-8, 3)) if roll < 0.15 else nxt[r]
            for key in rng.sample(KEYS, rng.randint(0, 2)):
                d = rng.choice((0.001, 0.002, 0.0035, 0.005)) * rng.randint(1, 4)
                old.add_collective(r, key, step, d, sinks["old"][r][key])
                given.add_collective(r, key, step, d, sinks["given"][r][key])
                kept.add_collective(r, key, step, d, sinks["kept"][r][key])
            step_s = 0.01 + step * 1e-6
            old.add_step(r, step, step_s)
            given.add_step(r, step, step_s, (step_s,))
            kept.add_step(r, step, step_s, (step_s,))
            nxt[r] = max(nxt[r], step + 1)
        want = old.complete(set(reporting))
        for pool, got in ((given, given.complete(reporting)), (kept, kept.complete())):
            assert [(p.rank, p.step, p.step_s, p.wait_s) for p in got] == want
            assert set(pool.reporting) == reporting
            assert pool.pooled_steps_total == old.pooled_steps_total
            assert pool.transfer_seconds_total == old.transfer_seconds_total
            assert {k: (s.step, s.transfer_s) for k, s in pool.samples.items()} == old.samples
            assert pool.transfers() == old.transfers()
    for name in ("given", "kept"):
        for r in ranks:
            for key in KEYS:
                assert sinks[name][r][key].wait_seconds == sinks["old"][r][key].wait_seconds


# -- work per call, counted in lines ----------------------------------------------------------
WATCHED = {pooling_module.__file__, store_module.__file__}


def lines_run(fn: Any, *args: Any) -> tuple[int, Any]:
    """Python lines executed in the pool's and the store's code while `fn(*args)` runs."""
    count = 0

    def local(frame: Any, event: str, _arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def trace(frame: Any, _event: str, _arg: Any) -> Any:
        return local if frame.f_code.co_filename in WATCHED else None

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        out = fn(*args)
    finally:
        sys.settrace(previous)
    return count, out


def pool_of(n: int, steps: int) -> tuple[JobPool, Sink]:
    """`n` ranks joined that have all delivered steps 0 … steps-1, pooled."""
    pool, sink = JobPool(), Sink()
    for r in range(n):
        pool.join(r)
    for step in range(steps):
        for r in range(n):
            pool.add_collective(r, KEYS[0], step, 0.002 + 0.001 * (r % 3), sink)
            pool.add_step(r, step, 0.01, ())
    assert len(pool.complete()) == n * steps
    return pool, sink


def test_a_step_still_waited_for_costs_the_same_whatever_the_ranks():
    """All ranks but the last deliver the next 20 steps, then rank 0 one more: nothing pools,
    and finding that out takes as many lines with 512 ranks as with 8 (the old scan asked every
    rank about the step, on every call)."""
    work = {}
    for n in (8, 512):
        pool, sink = pool_of(n, 3)
        for step in range(3, 23):
            for r in range(n - 1):
                pool.add_collective(r, KEYS[0], step, 0.002, sink)
                pool.add_step(r, step, 0.01, ())
        assert pool.complete() == []  # counts the ranks that moved: work they brought
        pool.add_step(0, 23, 0.01, ())
        work[n], done = lines_run(pool.complete)
        assert done == []
    assert work[512] == work[8]


def test_pooling_costs_lines_per_rank_step_pooled():
    """One rank falls silent and ten steps come without it: they pool in as many lines per
    pooled rank-step with 512 ranks as with 8."""
    work = {}
    for n in (8, 512):
        pool, sink = pool_of(n, 3)
        pool.leave(n - 1)
        for step in range(3, 13):
            for r in range(n - 1):
                pool.add_collective(r, KEYS[0], step, 0.002 + 0.001 * (r % 3), sink)
                pool.add_step(r, step, 0.01, ())
        lines, done = lines_run(pool.complete)
        assert len(done) == 10 * (n - 1)
        work[n] = lines / len(done)
    assert work[512] <= work[8] * 1.1


def wire_batch(job: str, rank: int, world: int, first: int, steps: int, inc: str = "a") -> bytes:
    ms = 1_000_000
    return json.dumps(
        {
            "schema_version": 2,
            "agent": {
                "job": job,
                "rank": rank,
                "local_rank": rank % 8,
                "world_size": world,
                "incarnation": inc,
                "hostname": "node-0",
                "pid": 100 + rank,
                "started_unix_s": 1.7e9,
            },
            "clock_offset_ns": 1_700_000_000 * 10**9,
            "steps": [[s, s * 10 * ms, 10 * ms, *[ms] * 6] for s in range(first, first + steps)],
            "collectives": [
                ["ddp_grad_sync", "default_pg", 25_000_000, (2 + rank % 3) * ms, s]
                for s in range(first, first + steps)
            ],
        }
    ).encode()


def test_an_ingest_costs_the_same_lines_with_256_ranks_as_with_8():
    """Expiry, staleness and pooling: none of them walks the job's ranks on every ingest."""
    work = {}
    for n in (8, 256):
        store = Store(Settings(max_ranks=4096))
        for first in (0, 10):
            for r in range(n):
                store.ingest(parse_batch(wire_batch("j", r, n, first, 10)))
        ahead = parse_batch(wire_batch("j", 0, n, 20, 10))  # rank 0 ahead: nothing completes
        work[n], reply = lines_run(store.ingest, ahead)
        assert reply["accepted"]
    assert work[256] == work[8]


# -- the transfer means, kept up to date only where a pooled step changed them ------------------
def test_transfer_means_equal_a_recomputation_through_the_window_wrapping_around():
    rng = random.Random(5)
    pool, sink = JobPool(transfer_window=7), Sink()
    minima: dict[Key, list[float]] = {}
    for r in (0, 1, 2):
        pool.join(r)
    for step in range(120):
        kinds = KEYS[:1] if step < 30 else KEYS if step < 90 else KEYS[1:]  # one stops, one starts
        for key in kinds:
            d = {r: rng.uniform(0.001, 0.01) for r in (0, 1, 2)}
            for r, seconds in d.items():
                pool.add_collective(r, key, step, seconds, sink)
            minima.setdefault(key, []).append(min(d.values()))
        for r in (0, 1, 2):
            pool.add_step(r, step, 0.01, ())
        pool.complete()
        if step % 3 == 0:  # read now and then: several pooled steps between reads
            want = {k: sum(v[-7:]) / len(v[-7:]) for k, v in minima.items()}
            assert pool.transfers() == pytest.approx(want, rel=1e-12)
    got = pool.transfers()
    assert list(got) == KEYS  # in the order the kinds first appeared, as before
    assert got == pytest.approx({k: sum(v[-7:]) / 7 for k, v in minima.items()}, rel=1e-12)
    got[KEYS[0]] = -1.0  # the caller's copy
    assert pool.transfers()[KEYS[0]] != -1.0


def test_steps_pooled_without_every_rank_leave_the_transfer_means_alone():
    """A step pooled past max_pending_steps while a rank still owes it is not the node's
    transfer: the means stay as they were."""
    pool, sink = JobPool(max_pending_steps=2), Sink()
    for r in (0, 1):
        pool.join(r)
    for r, seconds in ((0, 0.004), (1, 0.002)):
        pool.add_collective(r, KEYS[0], 0, seconds, sink)
        pool.add_step(r, 0, 0.01, ())
    assert len(pool.complete()) == 2
    assert pool.transfers() == {KEYS[0]: 0.002}
    for step in (1, 2, 3):  # rank 1 lags: step 1 is pooled with rank 0 alone
        pool.add_collective(0, KEYS[0], step, 0.0001, sink)
        pool.add_step(0, step, 0.01, ())
    assert [(p.rank, p.step) for p in pool.complete()] == [(0, 1)]
    assert pool.pooled_steps_total == 1
    assert pool.transfers() == {KEYS[0]: 0.002}


# -- live ranks and expiry, kept in order of last report --------------------------------------
class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def time(self) -> float:
        return self.now


@pytest.mark.parametrize(("stale", "expire"), [(30.0, 100.0), (100.0, 30.0)])
def test_live_ranks_are_those_reporting_within_stale_after_as_ranks_fall_silent_and_return(
    monkeypatch, stale, expire
):
    clock = Clock()
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=clock.time))
    store = Store(Settings(stale_after_s=stale, expire_after_s=expire))
    rng = random.Random(3)
    world = 6
    nxt = dict.fromkeys(range(world), 0)
    inc = dict.fromkeys(range(world), "a")
    last: dict[int, float] = {}  # rank -> when it last reported
    quiet: dict[int, float] = {}  # rank -> until when it sends nothing
    came_back = 0
    for _ in range(400):
        clock.now += rng.choice((0.5, 1.0, 3.0, 12.0))
        r = rng.randrange(world)
        if quiet.get(r, 0.0) > clock.now:
            continue
        roll = rng.random()
        if roll < 0.05:
            quiet[r] = clock.now + rng.choice((20.0, 45.0, 150.0))  # stale, or expired too
        elif roll < 0.08:
            inc[r] += "x"  # a restart
            nxt[r] = 0
        came_back += r in last and clock.now - last[r] > min(stale, expire)
        store.ingest(parse_batch(wire_batch("j", r, world, nxt[r], 3, inc[r])))
        last[r] = clock.now
        nxt[r] += 3
        now = clock.now
        # The old definitions: kept while reported within expire_after_s, waited for (live)
        # while reported within stale_after_s.
        assert {rank for _, rank in store.ranks} == {
            rank for rank, t in last.items() if now - t <= expire
        }
        live = {
            rank for rank, s in store.job_ranks["j"].items() if now - s.last_report_unix_s <= stale
        }
        assert set(store.pools["j"].reporting) == live
    assert came_back > 10  # the scenario does exercise ranks returning from silence
    clock.now += 31.0
    for _, r in snapshot(store).ranks():
        assert r.stale == (clock.now - r.last_report_unix_s > stale)


def test_ranks_silent_longer_than_expire_after_are_forgotten_even_if_the_clock_steps_back(
    monkeypatch,
):
    clock = Clock()
    monkeypatch.setattr(store_module, "time", SimpleNamespace(time=clock.time))
    store = Store(Settings(stale_after_s=30.0, expire_after_s=100.0))
    for r, at in ((0, 1_000.0), (1, 1_050.0), (2, 1_020.0), (3, 1_060.0)):  # 2: stepped back
        clock.now = at
        store.ingest(parse_batch(wire_batch("j", r, 4, 0, 2)))
    clock.now = 1_095.0
    snapshot(store)
    assert sorted(rank for _, rank in store.ranks) == [0, 1, 2, 3]
    clock.now = 1_120.5  # 0 (1000) and 2 (1020) are over 100 s old; 1 and 3, after 2, are not
    snapshot(store)
    assert sorted(rank for _, rank in store.ranks) == [1, 3]
    assert set(store.pools["j"].reporting) <= {1, 3}
    clock.now = 1_200.0
    snapshot(store)
    assert not store.ranks and not store.pools and not store.job_ranks


def test_by_last_report_pops_exactly_the_keys_older_than_the_limit():
    rng = random.Random(9)
    order: ByLastReport[int] = ByLastReport()
    at: dict[int, float] = {}
    now = 0.0
    for _ in range(2_000):
        now += rng.uniform(-2.0, 3.0)  # mostly forward, sometimes back
        key = rng.randrange(40)
        order.touch(key, now)
        at[key] = now
        if rng.random() < 0.2:
            limit = rng.uniform(0.0, 30.0)
            want = {k for k, t in at.items() if now - t > limit}
            assert set(order.pop_silent(now, limit)) == want
            for k in want:
                del at[k]
        assert len(order) == len(at) and all(k in order for k in at)


# -- what stays pending is not the collector's to walk ------------------------------------------
def test_pending_rows_are_untracked_by_the_collector_once_it_has_seen_them():
    """With hundreds of ranks a step waits for hundreds of ingests; rows the collector still
    tracked when it promotes what survives (the second generation's collection) would be
    walked by every full collection."""
    pool, sink = JobPool(), Sink()
    for r in (0, 1):
        pool.join(r)
    for op in ("ddp_grad_sync", "all_reduce"):  # the kinds are known, as they soon are
        pool.add_collective(0, collective_key(op, "pg", 8e6), 100, 0.003, sink)
    gc.collect()
    for step in range(5):
        for op in ("ddp_grad_sync", "all_reduce"):  # each call builds its key anew
            pool.add_collective(0, collective_key(op, "pg", 8e6), step, 0.003, sink)
        pool.add_step(0, step, 0.01, (0.002, 0.008))
    rows = [row for entries in pool._pending.values() for row in entries.values()]
    seconds = [d for by_rank in pool._pending_seconds.values() for d in by_rank.values()]
    assert len(rows) == len(seconds) == 5 and all(gc.is_tracked(row) for row in rows)
    assert all(len(d) == 2 for d in seconds) and not any(gc.is_tracked(d) for d in seconds)
    gc.collect(0)
    gc.collect(1)
    assert not any(gc.is_tracked(row) for row in rows)
    assert len(pool.complete()) == 0  # rank 1 is still waited for
