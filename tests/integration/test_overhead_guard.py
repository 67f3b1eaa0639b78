"""The agent's cost on the training thread, guarded: the short version of
bench/bench_agent_overhead.py (`--guard`) on the tiny model, where the hooks are most of the
step. It fails when the cost per step is over the guard's line by more than this machine's
noise (the 90 % interval's lower end over the line); the full bench stays the reference.

The second test plants a per-step hook that sleeps 100 µs beside the agent and checks that the
guard catches it: a guard that cannot fail would guard nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "bench_agent_overhead.py"
ROUNDS = "40"  # pairs of 40-step arms after 30 untimed: ~15 s here


def run_guard(tmp_path: Path, plant_us: float = 0.0) -> dict:
    out = tmp_path / f"guard-{plant_us:g}.json"
    cmd = [sys.executable, str(BENCH), "--guard", ROUNDS, "--json", str(out)]
    if plant_us:
        cmd += ["--plant-us", str(plant_us)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    print(done.stdout)
    return json.loads(out.read_text())["guard"]


# Alone (`make test` runs the quiet tests after the rest): a core another test file's jobs
# share moves the timing the guard judges.
@pytest.mark.slow
@pytest.mark.quiet
def test_the_agent_stays_within_its_budget_on_the_training_thread(tmp_path):
    guard = run_guard(tmp_path)
    for name in ("thread_cpu", "wall"):
        figure = guard[name]
        lo, hi = figure["ci90_us"]
        assert not figure["over"], (
            f"{name}: {figure['median_us']:+.1f} µs per step (90 % CI {lo:+.1f} .. {hi:+.1f}) "
            f"is over the budget of {figure['budget_us']:.1f} µs "
            f"({figure['budget_share']:.0%} of the bare step's {figure['bare_us']:.0f} µs)"
        )


@pytest.mark.slow
@pytest.mark.quiet
def test_the_guard_catches_a_planted_100_us_sleep_per_step(tmp_path):
    guard = run_guard(tmp_path, plant_us=100)
    wall = guard["wall"]
    assert wall["over"], wall
    assert wall["median_us"] >= 100, wall  # the sleep itself, whatever else the step costs
