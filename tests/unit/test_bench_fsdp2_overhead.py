"""bench/bench_fsdp2_overhead.py's report from its ranks' round records: a round's figure is the
job's step (the ranks' slowest) with the agent over without it, and each round is printed so
that runs of the same job can be pooled. The figures below are worked out by hand."""

from __future__ import annotations

import argparse
import json
import re

from bench.bench_fsdp2_overhead import report


def arm(median_s: float, cpu_ns: int) -> dict:
    return {"median_s": median_s, "min_s": median_s - 0.005, "cpu_ns": cpu_ns}


def rank(rounds: list[tuple[float, float]], cpu: tuple[int, int]) -> dict:
    return {
        "rounds": [{"agent": arm(a, cpu[0]), "none": arm(n, cpu[1])} for a, n in rounds],
        "collectives_per_step": 24,
        "kernel": "c++",
    }


def test_each_round_is_the_slowest_ranks_step_with_the_agent_over_without(capsys):
    # round 1: slowest 0.102 over 0.100 (+2 %); round 2: 0.100 over 0.100; round 3: 0.099
    # over 0.100 (-1 %): the ranks' slowest in each arm, not the same rank's
    ranks = [
        rank([(0.102, 0.100), (0.100, 0.100), (0.099, 0.100)], cpu=(5_024_000, 5_000_000)),
        rank([(0.101, 0.099), (0.100, 0.098), (0.098, 0.099)], cpu=(4_024_000, 4_000_000)),
    ]
    args = argparse.Namespace(world=2, exporter="none", layers=8, hidden=512, steps=10)
    report(ranks, args)
    out = capsys.readouterr().out
    assert "3 rounds x 10 steps per arm; step 100.0 ms bare" in out
    assert "collectives per step (recorded by the agent): 24, timed by the c++ kernel" in out
    assert re.search(r"^step time, agent vs none: median \+0\.00% ", out, re.M), out
    assert "round ratios, median step, agent/none - 1 (%): [2.0, 0.0, -1.0]" in out
    # 24 µs more CPU a step on every rank and round: 1 µs a collective
    assert "agent minus none: +24 us (quartiles +24 .. +24); per collective +1.0 us" in out


def test_paired_ranks_hold_a_core_each_and_the_jobs_trade_sets_every_round(monkeypatch):
    from bench import bench_fsdp2_overhead as bench

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: set(range(16)))
    plan, rest = bench.paired_cores(4)
    # cores 0 and 1 left to the system and the exporter; the agent's job on 2-5 in even rounds
    # and 6-9 in odd ones, the bare job the other way round
    assert plan == "2,3,4,5/6,7,8,9|6,7,8,9/2,3,4,5"
    assert rest == {0, 1, *range(10, 16)}
    agent, bare = plan.split("|")
    assert bench._core_sets(agent) == [(2, 6), (3, 7), (4, 8), (5, 9)]
    assert bench._core_sets(bare)[0] == (6, 2)


def test_too_few_cores_for_pairs_fall_back_to_interleaved_unless_asked(monkeypatch):
    from bench import bench_fsdp2_overhead as bench

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda _pid: {0, 1})
    assert bench.paired_cores(4) is None
    plan, rest = bench.paired_cores(2, force=True)
    assert plan == "0,1/0,1|0,1/0,1" and rest == {0, 1}


def test_a_rank_cut_off_mid_line_reports_the_rounds_it_finished(tmp_path):
    from bench.bench_fsdp2_overhead import read_rank

    path = tmp_path / "agent-rank0.result"
    done = [
        {"round": {"agent": arm(0.1, 5)}, "late": False},
        {"round": {"agent": arm(0.1, 5)}, "late": True},
    ]
    lines = [json.dumps({"rank": 0, "collectives_per_step": 24, "kernel": "c++"})]
    lines += [json.dumps(d) for d in done]
    path.write_text("\n".join(lines) + '\n{"round": {"agent": {"median_s": 0.1')  # killed here
    got = read_rank(str(path))
    assert (got["rank"], got["collectives_per_step"], got["kernel"]) == (0, 24, "c++")
    assert got["rounds"] == [d["round"] for d in done]
    assert got["late_rounds"] == 1
