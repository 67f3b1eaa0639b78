"""Simulator speed on one core: 1024 ranks x 10,000 steps, pacing off and on, against the 5 s target.

Run as ``python bench/bench_sim.py`` (``--quick`` for a 1,000-step smoke run). The process pins
itself to one CPU first, so the figure is a one-core figure even on a bigger machine. It also
reports the memory peak for 1x and 10x the steps (it must not grow with steps) and the cost of
one scalar ``PacingController.update`` (the agent's hot path).
"""

from __future__ import annotations

import argparse
import os
import time
import timeit
import tracemalloc

from syncscope.agent.pacing import PacingController
from syncscope.sim.compute import ComputeModel
from syncscope.sim.engine import Simulator
from syncscope.sim.fabric import FabricModel
from syncscope.sim.params import SimParams

TARGET_S = 5.0
RANKS = 1024


def workload() -> SimParams:
    """Every feature switched on: jitter, tails, stragglers, drift, hierarchy, contention, skew."""
    return SimParams(
        samples_per_rank=32,
        compute=ComputeModel(
            data_s=0.02,
            forward_s=0.3,
            backward_s=0.6,
            optimizer_s=0.04,
            jitter_cv=0.01,
            persistent_cv=0.01,
            slow_ranks=2,
            slow_factor=1.05,
            episode_prob=5e-5,
            episode_steps=40,
            episode_factor=1.1,
            drift_cv=0.015,
            drift_steps=300,
            tail_prob=1e-4,
            tail_scale_s=0.03,
            tail_alpha=2.0,
        ),
        fabric=FabricModel(
            gradient_bytes=2e9,
            buckets=16,
            gpus_per_node=8,
            nodes_per_leaf=4,
            oversubscription=4.0,
            background_utilization=0.12,
            background_sd=0.1,
            background_corr_steps=14,
            skew_coupling=0.65,
            park_limit_s=0.2,
        ),
        pacing={"max_delay_s": 0.3},
    )


def pin_to_one_core() -> str:
    try:
        core = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {core})
        return f"pinned to CPU {core}"
    except (AttributeError, OSError) as exc:  # not Linux, or not allowed
        return f"not pinned ({exc})"


def time_run(params: SimParams, nodes: int, steps: int, pacing: bool) -> float:
    sim = Simulator(params, nodes, pacing=pacing, seed=1)
    start = time.perf_counter()
    sim.run(steps, 0)
    return time.perf_counter() - start


def memory_peak(params: SimParams, nodes: int, steps: int) -> int:
    sim = Simulator(params, nodes, pacing=True, seed=1)
    tracemalloc.start()
    sim.run(steps, 0)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="1,000 steps instead of 10,000")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    steps = 1_000 if args.quick else 10_000
    print(pin_to_one_core())
    params = workload()
    nodes = RANKS // params.fabric.gpus_per_node
    print(
        f"{RANKS} ranks ({nodes} nodes x {params.fabric.gpus_per_node}), {steps} steps, "
        f"best of {args.repeats}"
    )
    for pacing in (False, True):
        best = min(time_run(params, nodes, steps, pacing) for _ in range(args.repeats))
        scaled = best * 10_000 / steps
        print(
            f"  pacing {'on ' if pacing else 'off'}: {best:6.2f} s"
            + (f" ({scaled:.2f} s scaled to 10,000 steps)" if steps != 10_000 else "")
            + f"   {scaled / TARGET_S:.2f} x the {TARGET_S:.0f} s target"
            + f"   {best / steps / RANKS * 1e9:.0f} ns per rank-step"
        )
    short, long = memory_peak(params, nodes, 500), memory_peak(params, nodes, 5_000)
    print(
        f"memory peak (tracemalloc): {short / 2**20:.1f} MiB at 500 steps, "
        f"{long / 2**20:.1f} MiB at 5,000 steps (ratio {long / short:.2f})"
    )
    controller = PacingController()
    waits = iter([0.03, 0.031, 0.029, 0.032] * 50_000)
    n = 100_000
    per_update = timeit.timeit(lambda: controller.update(next(waits), 0.1), number=n) / n
    print(f"scalar PacingController.update: {per_update * 1e6:.2f} us per call")


if __name__ == "__main__":
    main()
