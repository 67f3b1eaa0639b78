"""Each rank's throughput per GPU against its own best sustained level (exporter/throughput.py):
blocks of steps and of at least the rate window, warm-up left out, one fast block never the
baseline, and the baseline through the store, into the decision verdict, and across an exporter
restart (the state file)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from syncscope.exporter.app import parse_batch
from syncscope.exporter.diagnosis import snapshot
from syncscope.exporter.settings import Settings
from syncscope.exporter.state_file import StateFile
from syncscope.exporter.store import Store
from syncscope.exporter.throughput import (
    BLOCK_STEPS,
    BUCKET_S,
    SUSTAINED_BLOCKS,
    Throughput,
    ThroughputView,
)

DAY = 86_400.0
T0 = 1_700_000_000.0


def feed(t: Throughput, rates: list[float], samples: int = 32, at: float = T0) -> float:
    """One block per rate: BLOCK_STEPS steps of `samples` each at that many samples (or steps,
    where they say none) per second; returns the time after them. Blocks of steps alone: no
    shortest block."""
    for rate in rates:
        for _ in range(BLOCK_STEPS):
            d = max(samples, 1) / rate
            at += d
            t.add(d, samples, at, DAY, 0.0)
    return at


def test_a_block_holds_at_least_the_rate_window_of_step_time() -> None:
    t = Throughput()
    at = T0
    for _ in range(4999):  # 59.988 s of 12 ms steps: 49 blocks' steps, not a minute
        at += 0.012
        t.add(0.012, 32, at, DAY, 60.0)
    assert t.blocks == 0
    t.add(0.012, 32, at + 0.012, DAY, 60.0)
    assert t.blocks == 1


def test_warm_up_is_left_out_and_a_baseline_needs_sustained_blocks() -> None:
    t = Throughput()
    feed(t, [10.0])  # the first block: compilation, autotuning
    assert t.view() is None
    feed(t, [100.0] * 2)
    assert t.view() == ThroughputView("samples", None, None)
    feed(t, [100.0])
    assert t.view() == ThroughputView("samples", pytest.approx(100.0), None)  # 3 blocks
    feed(t, [100.0] * (SUSTAINED_BLOCKS - 3))
    assert t.view() == ThroughputView("samples", pytest.approx(100.0), pytest.approx(100.0))


def test_one_fast_block_does_not_lift_the_baseline() -> None:
    t = Throughput()
    feed(t, [50.0] + [100.0] * SUSTAINED_BLOCKS + [200.0] + [100.0] * SUSTAINED_BLOCKS)
    view = t.view()
    assert view is not None and view.baseline_per_s == pytest.approx(100.0)
    # and one slow block (a checkpoint) does not make a fall
    feed(t, [40.0, 100.0, 100.0])
    view = t.view()
    assert view is not None and view.current_per_s == pytest.approx(100.0)


def test_a_sustained_fall_reads_against_the_best_sustained_level() -> None:
    t = Throughput()
    feed(t, [50.0] + [100.0] * 8 + [75.0] * 3)
    view = t.view()
    assert view is not None
    assert view.current_per_s == pytest.approx(75.0)
    assert view.baseline_per_s == pytest.approx(100.0)


def test_steps_per_second_where_the_steps_say_no_samples() -> None:
    t = Throughput()
    feed(t, [10.0] * (1 + SUSTAINED_BLOCKS), samples=-1)  # 0.1 s steps, no work said
    assert t.view() == ThroughputView("steps", pytest.approx(10.0), pytest.approx(10.0))


def test_a_level_the_job_left_ages_out_after_the_trend_window() -> None:
    t = Throughput()
    at = feed(t, [50.0] + [100.0] * SUSTAINED_BLOCKS)
    # the job moves to 60 (a new phase): a fall against the day's best ...
    at = feed(t, [60.0] * SUSTAINED_BLOCKS, at=at + 2 * BUCKET_S)
    assert t.view() == ThroughputView("samples", pytest.approx(60.0), pytest.approx(100.0))
    # ... until a day after it last sustained 100: then 60 is its level
    feed(t, [60.0] * 3, at=at + DAY + 2 * BUCKET_S)
    assert t.view() == ThroughputView("samples", pytest.approx(60.0), pytest.approx(60.0))


def test_a_restart_warms_up_again_and_keeps_the_baseline() -> None:
    t = Throughput()
    feed(t, [50.0] + [100.0] * SUSTAINED_BLOCKS)
    t.restart()
    feed(t, [5.0])  # the new incarnation's warm-up: no current level from it
    assert t.view() == ThroughputView("samples", None, pytest.approx(100.0))


# -- through the store, the verdict and the state file -------------------------------------------
MS = 1_000_000


def batch(rank: int, first: int, n: int, step_ms: int, inc: str = "a") -> bytes:
    """Steps first..first+n-1 of `step_ms` each, 32 samples per step (wire version 2)."""
    base = int(T0 * 1e9)
    steps = [
        [k, base + k * step_ms * MS, step_ms * MS, 0, step_ms * MS // 2, 0, 0, 0, 0, 32, -1]
        for k in range(first, first + n)
    ]
    body: dict[str, Any] = {
        "schema_version": 2,
        "agent": {
            "job": "t",
            "rank": rank,
            "local_rank": rank,
            "world_size": 2,
            "incarnation": inc,
            "hostname": "n1",
        },
        "clock_offset_ns": 0,
        "steps": steps,
    }
    return json.dumps(body).encode()


def run(store: Store, first: int, blocks: int, step_ms: int, inc: str = "a") -> int:
    n = blocks * BLOCK_STEPS
    for rank in (0, 1):
        assert store.ingest(parse_batch(batch(rank, first, n, step_ms, inc)))["accepted"]
    return first + n


def test_a_fall_through_the_store_is_the_verdict_and_survives_an_exporter_restart(
    tmp_path,
) -> None:
    store = Store(Settings())
    at = run(store, 0, 1 + SUSTAINED_BLOCKS, step_ms=600)  # blocks of 60 s: 53.3 samples/s
    job = snapshot(store).jobs["t"]
    level = pytest.approx(32 / 0.6)
    assert [r.throughput for r in job.ranks] == [ThroughputView("samples", level, level)] * 2
    assert job.diagnosis.verdict is None  # steady

    path = str(tmp_path / "state.json")
    assert StateFile(path, store).save()
    after = Store(Settings())
    assert StateFile(path, after).load() == 2
    # the same processes go on, 25 % slower: the baseline came through the restart
    run(after, at, 3, step_ms=798)
    job = snapshot(after).jobs["t"]
    (view,) = {r.throughput for r in job.ranks}
    assert view is not None and view.baseline_per_s == pytest.approx(32 / 0.6)
    assert view.current_per_s == pytest.approx(32 / 0.798)
    v = job.diagnosis.verdict
    assert v is not None and (v.verdict, v.hardware) == ("coupling", "unknown")  # CPU ranks
    assert v.coupling == {"throughput_drop": pytest.approx(0.248, abs=1e-3)}
    assert v.reason.startswith(
        "structural coupling: throughput per GPU 75% of the job's own baseline "
        "(40.1 vs 53.3 samples/s per GPU"
    )


def test_seconds_of_fast_then_slow_short_steps_are_no_fall() -> None:
    """A 12 s run of 12 ms steps whose last 4 s run a third slower (a neighbour took the CPU):
    100-step blocks would read it as a 25 % fall; blocks of the rate window read no level."""
    store = Store(Settings())
    at = run(store, 0, 7, step_ms=12)
    run(store, at, 3, step_ms=16)
    job = snapshot(store).jobs["t"]
    assert [r.throughput for r in job.ranks] == [None, None]
    assert job.diagnosis.verdict is None


def test_a_restarted_rank_is_not_a_fall_while_it_warms_up() -> None:
    store = Store(Settings())
    at = run(store, 0, 1 + SUSTAINED_BLOCKS, step_ms=600)
    run(store, at, 2, step_ms=2400, inc="b")  # restarted: slow first steps, then one block
    job = snapshot(store).jobs["t"]
    views = [r.throughput for r in job.ranks]
    assert views == [ThroughputView("samples", None, pytest.approx(32 / 0.6))] * 2
    assert job.diagnosis.verdict is None


def test_a_state_file_from_before_the_baseline_loads_without_one(tmp_path) -> None:
    store = Store(Settings())
    run(store, 0, 1 + SUSTAINED_BLOCKS, step_ms=600)
    path = tmp_path / "state.json"
    StateFile(str(path), store).save()
    data = json.loads(path.read_text())
    for rank in data["ranks"]:
        del rank["throughput"]
    path.write_text(json.dumps(data))
    after = Store(Settings())
    assert StateFile(str(path), after).load() == 2
    assert all(s.throughput.view() is None for s in after.ranks.values())
