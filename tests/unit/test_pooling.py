"""Per-step pooling of a node's ranks (exporter/pooling.py): exact waits, and the sampled rings
from which Prometheus takes the job's transfer per step across nodes."""

from __future__ import annotations

import random
from dataclasses import dataclass

from syncscope.exporter.pooling import (
    BASELINE_BLOCKS,
    SAMPLE_FROM_STEP,
    SAMPLE_SLOTS,
    SAMPLE_STRIDES,
    JobPool,
    NodeInflation,
)

from syncscope.arrival import collective_key

KEY = collective_key("ddp_grad_sync", "ddp", 8e6)


@dataclass
class Sink:
    wait_seconds: float = 0.0


def feed(
    pool: JobPool,
    d: dict[int, float],
    step: int,
    sinks: dict[int, Sink],
    phases: tuple[float, ...] = (),
) -> None:
    """Each rank's collective time in `step`, and its row: `phases` (Phase order) and the step
    time they add up to, or a 0.1 s step without phases."""
    for rank, seconds in d.items():
        pool.add_collective(rank, KEY, step, seconds, sinks[rank])
        pool.add_step(rank, step, sum(phases) if phases else 0.1, phases)


def test_the_nodes_transfer_per_step_counts_a_kind_that_skips_steps_only_where_it_ran():
    flag = collective_key("broadcast", "default_pg", 4.0)
    pool, sinks = JobPool(transfer_window=20), {0: Sink(), 1: Sink()}
    assert pool.transfer_per_step() is None
    for step in range(30):
        if step % 10 == 9:  # a stop flag's broadcast every tenth step: 5 ms
            for rank in (0, 1):
                pool.add_collective(rank, flag, step, 0.005, sinks[rank])
        feed(pool, {0: 0.030, 1: 0.040}, step, sinks)
    pool.complete([0, 1])
    means = pool.transfers()  # each kind over the steps it ran
    assert means.keys() == {KEY, flag}
    assert abs(means[KEY] - 0.030) < 1e-12 and abs(means[flag] - 0.005) < 1e-12
    # the last 20 steps: 30 ms each, and two of them 5 ms more: 30.5 ms, not 35
    assert abs(pool.transfer_per_step() - 0.0305) < 1e-12


def jittery_job(steps: int, seed: int = 1) -> list[dict[int, float]]:
    """d(r, k) for 4 ranks: a 20 ms transfer plus each rank's wait for the step's last arrival,
    the last rank drawn afresh every step (no persistent straggler)."""
    rng = random.Random(seed)
    out = []
    for _ in range(steps):
        arrival = {r: rng.uniform(0.0, 0.010) for r in range(4)}
        transfer = 0.020 + rng.uniform(0.0, 0.002)
        last = max(arrival.values())
        out.append({r: transfer + last - a for r, a in arrival.items()})
    return out


def test_waits_are_each_ranks_time_beyond_the_nodes_minimum_step_by_step():
    pool, sinks = JobPool(), {0: Sink(), 1: Sink()}
    feed(pool, {0: 0.030, 1: 0.010}, 0, sinks)
    feed(pool, {0: 0.012, 1: 0.016}, 1, sinks)
    pooled = pool.complete([0, 1])
    assert [(p.rank, p.step, round(p.wait_s, 6)) for p in pooled] == [
        (0, 0, 0.02),
        (1, 0, 0.0),
        (0, 1, 0.0),
        (1, 1, 0.004),
    ]
    assert round(sinks[0].wait_seconds, 6) == 0.02 and round(sinks[1].wait_seconds, 6) == 0.004
    assert pool.pooled_steps_total == 2
    assert round(pool.transfer_seconds_total, 6) == 0.022


def test_rings_hold_the_nodes_minimum_at_sampled_steps_only():
    pool, sinks = JobPool(), {0: Sink(), 1: Sink()}
    minima = {}
    for step in range(70):
        low = 0.001 * step
        minima[step] = low
        feed(pool, {0: low, 1: low + 0.005}, step, sinks)
    # Step 72 delivered by rank 0 only: not pooled while rank 1 may still deliver it.
    pool.add_collective(0, KEY, 72, 0.9, sinks[0])
    pool.add_step(0, 72, 0.1, ())
    pool.complete([0, 1])
    assert 0 < min(SAMPLE_STRIDES) <= SAMPLE_FROM_STEP < 64 and 64 in SAMPLE_STRIDES
    want = {}
    for step in range(SAMPLE_FROM_STEP, 70):  # the warm-up steps are never samples
        for stride in SAMPLE_STRIDES:
            if step % stride == 0:
                want[(stride, step // stride % SAMPLE_SLOTS)] = step
    assert {k: s.step for k, s in pool.samples.items()} == want
    for (stride, slot), sample in pool.samples.items():
        assert (sample.stride, sample.slot) == (stride, slot)
        assert sample.transfer_s == minima[sample.step]


def test_min_over_nodes_of_agreed_samples_is_the_jobs_transfer_at_those_steps():
    """Two nodes of two ranks: per step, the smaller of the two nodes' sampled minima is the
    minimum over all four ranks, which the nodes' mean minima overstate under jitter."""
    steps = jittery_job(400)
    nodes = [(JobPool(), {0: Sink(), 1: Sink()}), (JobPool(), {2: Sink(), 3: Sink()})]
    for k, d in enumerate(steps):
        for pool, sinks in nodes:
            feed(pool, {r: d[r] for r in sinks}, k, sinks)
            pool.complete(sinks)
    a, b = (pool.samples for pool, _ in nodes)
    assert a.keys() == b.keys()
    agreed = [slot for slot in a if a[slot].step == b[slot].step]
    # 400 steps: the finest ring is full, the stride-64 one holds steps 64 … 384.
    assert len(agreed) == len(a) == SAMPLE_SLOTS + 6
    for slot in agreed:
        truth = min(steps[a[slot].step].values())
        assert min(a[slot].transfer_s, b[slot].transfer_s) == truth
    # What the fallback takes instead: the smaller node's mean minimum, well above the truth.
    means = [pool.transfer_seconds_total / pool.pooled_steps_total for pool, _ in nodes]
    true_mean = sum(min(d.values()) for d in steps) / len(steps)
    assert min(means) > true_mean + 0.001  # E[last of 4] − E[last of 2] ≈ 1.3 ms here


def _blocks(
    pool: JobPool, transfers: list[float], clock: list[float], block_s: float, work: float = 0.05
) -> None:
    """One block of `pool.transfer_window` steps per transfer, each `block_s` of clock apart;
    each rank's step is `work` of forward and its collective time exposed."""
    sinks = {0: Sink(), 1: Sink()}
    for seconds in transfers:
        for _ in range(pool.transfer_window):
            step = pool.pooled_steps_total + SAMPLE_FROM_STEP
            for rank, exposed in ((0, seconds), (1, seconds + 0.01)):
                phases = (0.0, work, 0.0, 0.0, exposed, 0.0, 0.0)
                feed(pool, {rank: exposed}, step, sinks, phases)
            pool.complete([0, 1])
        clock[0] += block_s


def test_the_nodes_transfer_history_gives_its_inflation_against_its_own_baseline(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("syncscope.exporter.pooling.time.monotonic", lambda: clock[0])
    pool = JobPool(transfer_window=8, recent_window_s=60.0)
    _blocks(pool, [0.02] * (BASELINE_BLOCKS - 1), clock, 1.0)
    assert pool.inflation() is None  # a 10th percentile of fewer blocks is the fastest one
    _blocks(pool, [0.02] * (40 - BASELINE_BLOCKS + 1), clock, 1.0)
    got = pool.inflation()
    assert got and abs(got.transfer_s - 0.02) < 1e-12 and abs(got.transfer - 1.0) < 1e-9
    # One block a stall of the machine inflated is not contention: the recent transfer is the
    # median of the last minute's blocks.
    _blocks(pool, [0.05], clock, 1.0)
    got = pool.inflation()
    assert got and abs(got.transfer_s - 0.02) < 1e-12 and got.transfer < 1.5
    # Inflated for most of the last minute, it is; the ranks' own work is not.
    _blocks(pool, [0.05] * 40, clock, 1.0)
    got = pool.inflation()
    assert got and abs(got.transfer_s - 0.05) < 1e-12 and abs(got.transfer - 2.5) < 1e-9
    assert abs(got.work - 1.0) < 1e-9
    # And it clears once the last minute is calm again, whatever the hour before held.
    _blocks(pool, [0.02] * 61, clock, 1.0)
    got = pool.inflation()
    assert got and abs(got.transfer_s - 0.02) < 1e-12 and abs(got.transfer - 1.0) < 1e-9
    # A host that slows everything inflates the ranks' own work with the transfer.
    _blocks(pool, [0.04] * 61, clock, 1.0, work=0.1)
    got = pool.inflation()
    assert got and abs(got.transfer - 2.0) < 1e-9 and abs(got.work - 2.0) < 1e-9


def test_the_pool_counts_how_long_the_fabric_share_has_held_over_its_line(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("syncscope.exporter.pooling.time.monotonic", lambda: clock[0])
    pool = JobPool(transfer_window=8, recent_window_s=10.0, contention_line=1.5)
    _blocks(pool, [0.02] * 30, clock, 1.0)
    assert pool.inflation().held_s == 0.0  # type: ignore[union-attr]
    # Inflated: over the line from the block at which the last 10 s's median crossed it.
    _blocks(pool, [0.05] * 40, clock, 1.0)
    got = pool.inflation()
    assert got and got.transfer >= 1.5 and 30.0 <= got.held_s <= 36.0, got
    # One calm block does not end it (the median holds), a calm stretch does.
    _blocks(pool, [0.02], clock, 1.0)
    assert pool.inflation().held_s > 30.0  # type: ignore[union-attr]
    _blocks(pool, [0.02] * 20, clock, 1.0)
    assert pool.inflation().held_s == 0.0  # type: ignore[union-attr]
    # The same inflation of the transfer with the ranks' own work as slow is the host's: no
    # hold starts.
    _blocks(pool, [0.05] * 40, clock, 1.0, work=0.125)
    got = pool.inflation()
    assert got and got.transfer >= 2.0 and got.work >= 2.0 and got.held_s == 0.0, got


def test_node_local_contention_is_the_inflation_not_the_share_of_the_step():
    from syncscope.exporter.diagnosis import diagnose_job
    from syncscope.exporter.settings import Settings

    from tests.unit.test_diagnosis import ranks_of

    ranks = ranks_of("balanced")  # the whole job on this node; transfer half of each step

    hold = Settings().thresholds.contention_hold_s  # SyncscopeFabricContention's for:
    assert hold == 15 * 60

    def contention(transfer_s: float, transfer: float, work: float, held_s: float = hold):
        inflation = NodeInflation(transfer_s, transfer, work, held_s)
        return diagnose_job(ranks, Settings(), node_transfer=inflation).modes["fabric_contention"]

    calm = contention(0.02, 1.1, 1.0)
    assert not calm.verdict and "1.10× its own baseline" in calm.reason
    hot = contention(0.05, 2.5, 1.0)
    assert hot.verdict and hot.score == 1.0
    # Over the line for less than the alert's for: no verdict yet, and the page says why.
    early = contention(0.05, 2.5, 1.0, held_s=40.0)
    assert not early.verdict and early.score < 0.5, early
    assert "over its line for 40 s of the 900 s it must hold" in early.reason, early
    # The same transfer while the ranks' own work is as slow: the host, not the fabric.
    host = contention(0.05, 2.5, 2.4)
    assert not host.verdict and "own work is 2.40×" in host.reason, host
    # Both: only the transfer's inflation beyond the work's counts.
    both = contention(0.05, 2.5, 1.25)
    assert both.verdict and "fabric's share is 2.00×" in both.reason, both


def test_a_pipelines_ranks_wait_only_beyond_their_own_stages_least_blocked_rank():
    """Two-stage pipelines {0,1} {2,3}: stage 0 (ranks 0, 2) is blocked 12 ms a step, stage 1
    (ranks 1, 3) 4 ms, by design; rank 2 is blocked 1 ms longer than rank 0. Each rank's wait is
    beyond its own stage's least blocked rank; without stages stage 0 would wait 8 ms."""
    exposed = {0: 0.012, 1: 0.004, 2: 0.013, 3: 0.0045}
    out = {}
    for staged in (True, False):
        pool, sinks = JobPool(), {r: Sink() for r in exposed}
        if staged:
            for rank in exposed:
                pool.set_stage(rank, rank % 2)
        for step in range(3):
            for rank, blocked in exposed.items():
                phases = (0.0, 0.01, 0.01, 0.0, blocked, 0.0, 0.0)
                pool.add_collective(rank, KEY, step, blocked, sinks[rank])
                pool.add_step(rank, step, sum(phases), phases)
        waits = {p.rank: p.wait_s for p in pool.complete(list(exposed)) if p.step == 2}
        out[staged] = {rank: round(w, 9) for rank, w in waits.items()}
    assert out[True] == {0: 0.0, 1: 0.0, 2: 0.001, 3: 0.0005}
    assert out[False] == {0: 0.008, 1: 0.0, 2: 0.009, 3: 0.0005}


def test_a_paced_ranks_delay_counts_in_its_wait():
    """Rank 0 is late (blocked 2 ms a step, its share of the transfer). Rank 1 waits 30 ms in
    the collective; rank 2 was paced 20 ms at the step boundary and waits 10 ms: both lost
    28 ms to rank 0, and the least blocked rank stays rank 0."""
    exposed, paced = {0: 0.002, 1: 0.032, 2: 0.012}, {0: 0.0, 1: 0.0, 2: 0.020}
    pool, sinks = JobPool(), {r: Sink() for r in exposed}
    for rank, blocked in exposed.items():
        phases = (0.0, 0.01, 0.01, 0.0, blocked, paced[rank], 0.0)
        pool.add_collective(rank, KEY, 0, blocked, sinks[rank])
        pool.add_step(rank, 0, sum(phases), phases)
    waits = {p.rank: round(p.wait_s, 9) for p in pool.complete(list(exposed))}
    assert waits == {0: 0.0, 1: 0.030, 2: 0.030}


def test_a_ranks_waits_per_group_never_exceed_the_time_it_was_blocked():
    """A pipeline posts its receives ahead: rank 1's `pp` receives take 90 ms issue to
    completion beyond rank 0's, and its ddp sync 10 ms, on a step where it was blocked 40 ms
    in all. Its per-group waits share those 40 ms in the proportions 9 : 1. Rank 2, a
    symmetric collective's late-comer blocked longer than its excess, keeps its excess whole."""
    recv = collective_key("recv", "pp", 4e5)
    exposed = {0: 0.0, 1: 0.040, 2: 0.030}
    excess = {0: {recv: 0.0, KEY: 0.0}, 1: {recv: 0.090, KEY: 0.010}, 2: {recv: 0.0, KEY: 0.020}}
    pool = JobPool()
    sinks = {r: {recv: Sink(), KEY: Sink()} for r in exposed}
    for rank, blocked in exposed.items():
        for key, extra in excess[rank].items():
            pool.add_collective(rank, key, 0, 0.005 + extra, sinks[rank][key])
        phases = (0.0, 0.03, 0.03, 0.0, blocked, 0.0, 0.0)
        pool.add_step(rank, 0, sum(phases), phases)
    pool.complete(list(exposed))
    waits = {r: {k[1]: round(s.wait_seconds, 9) for k, s in by.items()} for r, by in sinks.items()}
    assert waits == {
        0: {"pp": 0.0, "ddp": 0.0},
        1: {"pp": 0.036, "ddp": 0.004},
        2: {"pp": 0.0, "ddp": 0.02},
    }
