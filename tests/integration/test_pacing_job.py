"""Issue 4 on real 4-rank gloo jobs: pacing stays off when balanced, paces only early ranks
behind a steady straggler, and its kill file turns it off within one step."""

from __future__ import annotations

import json
import os
import statistics
import time

import pytest

from tests.conftest import by_rank, parse_samples, wait_until

pytestmark = pytest.mark.slow
SLOW_RANK = 1


def records(tmp_path, world=4):
    out = {}
    for rank in range(world):
        with open(tmp_path / f"rec-{rank}.jsonl") as f:
            lines = [json.loads(line) for line in f]
            out[rank] = [r for r in lines if "event" not in r]  # steps, not the startup
    return out


def early_ranks_paced(exporter, world=4):
    """The per-rank pacing state once all four ranks report it and three are engaged."""
    active = by_rank(parse_samples(exporter.metrics_text(), "syncscope_pacing_active"))
    return active if len(active) == world and sum(active.values()) == world - 1 else None


def test_balanced_job_never_engages(exporter, job_factory, tmp_path):
    job = job_factory(
        4,
        ["--duration", "25", "--pacing"],
        exporter.url,
        SYNCSCOPE_RECORD=str(tmp_path / "rec-{rank}.jsonl"),
    )
    seen = []
    while job.running():
        seen.append(by_rank(parse_samples(exporter.metrics_text(), "syncscope_pacing_active")))
        time.sleep(1)
    job.wait()
    assert any(len(s) == 4 for s in seen), "pacing state never reported"
    assert all(v == 0.0 for s in seen for v in s.values()), seen
    rows = [r for ranks in records(tmp_path).values() for r in ranks]
    total_delay = sum(r["phases"]["pacing"] for r in rows)
    # 4 ranks on 2 shared cores see real transient imbalance from the scheduler; a brief
    # engagement on one is allowed, a throughput cost is not: under 1 % of the run's time.
    assert total_delay <= 0.01 * sum(r["step_s"] for r in rows), total_delay


def test_steady_straggler_early_ranks_paced_straggler_never(exporter, job_factory, tmp_path):
    job = job_factory(
        4,
        ["--duration", "30", "--slow-rank", str(SLOW_RANK), "--slow-ms", "30", "--pacing"],
        exporter.url,
        SYNCSCOPE_RECORD=str(tmp_path / "rec-{rank}.jsonl"),
    )
    active = wait_until(lambda: early_ranks_paced(exporter), timeout=25)
    assert active and active[SLOW_RANK] == 0.0, active
    job.wait()
    text = exporter.metrics_text()
    delay = by_rank(parse_samples(text, "syncscope_pacing_delay_seconds_total"))
    assert delay[SLOW_RANK] == 0.0
    assert all(delay[r] > 0 for r in range(4) if r != SLOW_RANK), delay
    assert all(
        v >= 1
        for r, v in by_rank(parse_samples(text, "syncscope_pacing_engagements_total")).items()
        if r != SLOW_RANK
    )
    rows = records(tmp_path)
    for rank, steps in rows.items():
        if rank == SLOW_RANK:
            assert all(s["phases"]["pacing"] == 0.0 for s in steps)
            continue
        first_paced = next(i for i, s in enumerate(steps) if s["phases"]["pacing"] > 0)
        assert first_paced >= 8, "engaged before it could have seen a window of waits"
        before, after = steps[3:first_paced], steps[len(steps) // 2 :]
        paced = statistics.mean(s["phases"]["pacing"] for s in after)
        # exposed communication is measured directly (no baseline involved): the time an early
        # rank spends waiting in DDP's all-reduce falls by about the delay it now sleeps instead
        comm_before = statistics.median(s["phases"]["comm_exposed"] for s in before)
        comm_after = statistics.median(s["phases"]["comm_exposed"] for s in after)
        assert paced > 0.001, (rank, paced)
        assert comm_after < comm_before - 0.5 * paced, (rank, comm_before, comm_after, paced)
        step_before = statistics.median(s["step_s"] for s in before)
        step_after = statistics.median(s["step_s"] for s in after)
        assert step_after <= 1.15 * step_before, (rank, step_before, step_after)


def test_kill_file_stops_pacing_within_one_step(exporter, job_factory, tmp_path):
    kill = tmp_path / "kill"
    job = job_factory(
        4,
        ["--duration", "30", "--slow-rank", str(SLOW_RANK), "--slow-ms", "30", "--pacing"],
        exporter.url,
        SYNCSCOPE_RECORD=str(tmp_path / "rec-{rank}.jsonl"),
        SYNCSCOPE_PACING_KILL_FILE=str(kill),
    )
    # every early rank must have engaged before the file appears, or "paced before the kill"
    # below is asserted of a rank that had not yet seen a window of waits (CI run of 160989b:
    # two ranks active, the third not, and its records rightly held no delay)
    active = wait_until(lambda: early_ranks_paced(exporter), timeout=25)
    assert active and active[SLOW_RANK] == 0.0, active
    time.sleep(2)
    kill.touch()
    killed_at = time.time()
    job.wait()
    for rank, steps in records(tmp_path).items():
        if rank == SLOW_RANK:
            continue
        after = [s for s in steps if s.get("end_unix_s", 0) > killed_at]
        assert len(after) > 20
        # the step that was running when the file appeared may still carry a delay; none after it
        assert all(s["phases"]["pacing"] == 0.0 for s in after[1:]), [
            s["phases"]["pacing"] for s in after[:5]
        ]
        before = [s for s in steps if s.get("end_unix_s", 0) <= killed_at]
        assert any(s["phases"]["pacing"] > 0 for s in before)
    assert os.path.exists(kill)
