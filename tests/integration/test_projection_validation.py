"""Projection against real gloo jobs: fit 2- and 4-rank runs recorded by the agent, predict 8.

The workload spends its step in a sleep (like a GPU kernel: the CPU is free) plus a small real
DDP model, with 2 % of steps stalled 30 ms; the agent records JSON lines. With fewer cores than
ranks the measured 8-rank job is slowed by CPU oversubscription (gloo's reductions and the
Python hooks queue for the cores), which no fit of 2 and 4 ranks can foresee: on the 2-core
development machine the prediction came out 15-23 % short, the missing time being the all-reduce
(transfer 15.8 ms measured vs 8.8 ms predicted). So the tight check needs one core per rank.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from syncscope.sim.projection import project
from syncscope.sim.records import load_jsonl

from syncscope.lab.launch import launch, wait_all

pytestmark = pytest.mark.slow

WORKLOAD = [
    "--steps", "250", "--hidden", "64", "--layers", "2", "--batch", "16",
    "--data-ms", "30", "--jitter-prob", "0.02", "--jitter-ms", "30",
]  # fmt: skip


def record(world: int, path: Path) -> None:
    env = dict(os.environ, SYNCSCOPE_RECORD=str(path), SYNCSCOPE_JOB="projection")
    env.pop("SYNCSCOPE_EXPORTER", None)
    procs = launch(world, WORKLOAD, env=env)
    assert wait_all(procs, timeout=240) == [0] * world
    assert path.stat().st_size > 0


def test_projection_of_real_gloo_runs_to_a_held_out_size(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    runs = {}
    for world in (2, 4, 8):
        record(world, tmp_path / f"run{world}.jsonl")
        runs[world] = load_jsonl(tmp_path / f"run{world}.jsonl")
        assert runs[world].world_size == world and len(runs[world].ranks) == world
    result = project([runs[2], runs[4]], [8], bootstrap=10, steps=600)
    measured_steps = {
        w: sum(r.step_s[10:].mean() for r in run.ranks) / len(run.ranks) for w, run in runs.items()
    }
    # The fit reproduces the size it was fitted at...
    assert result.point(4).step_s[1] == pytest.approx(measured_steps[4], rel=0.10)
    predicted = result.point(8).step_s[1]
    error = predicted / measured_steps[8] - 1.0
    print(
        f"held-out 8 ranks: predicted {predicted * 1e3:.1f} ms "
        f"[{result.point(8).step_s[0] * 1e3:.1f}-{result.point(8).step_s[2] * 1e3:.1f}], "
        f"measured {measured_steps[8] * 1e3:.1f} ms, error {error:+.1%}"
    )
    # ...and predicts the held-out size: loosely where ranks share cores, tightly where not.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    tolerance = 0.10 if (cores or 1) >= 8 else 0.40
    assert abs(error) < tolerance, f"{error:+.1%} with {cores} cores"
