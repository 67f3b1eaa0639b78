"""The agent's own cost at job scale: measured per-rank pauses fed into the simulator.

In synchronous training a step ends when the last rank arrives, so a pause on any one rank
delays them all. Two ways the agent takes time from a rank are modelled, both as the compute
model's per-rank `hiccup` (extra seconds before the rank's backward pass ends, engine.py):

- `PeriodicPauses`: a background reporter that takes the GIL for one pause every `interval_s`
  of wall time, each rank at its own random phase (the HTTP reporter's flush). A rank pauses in
  a step when its own clock crosses a multiple of the interval; the pause is drawn from the
  measured durations.
- `PerStepCost`: work every rank does at the step boundaries every rank agrees on (the shm
  transport's pump, every `every`-th step), drawn per rank and step from the measured
  durations.

`project()` runs the same job (common random numbers) without and with each model and returns
the relative step-time cost per rank count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from syncscope.sim.compute import ComputeModel, PhaseDraw
from syncscope.sim.engine import Simulator
from syncscope.sim.fabric import FabricModel
from syncscope.sim.params import SimParams


@dataclass
class PeriodicPauses:
    """One pause per `interval_s` per rank, at a random phase per rank."""

    durations_s: Sequence[float]
    interval_s: float = 1.0
    per_step_s: float = 0.0  # a constant cost on every step besides (the hooks)
    name: str = "periodic"

    def hiccups(self, ranks: int, rng: np.random.Generator, step_s: float):
        durations = np.asarray(self.durations_s, dtype=float)
        clock = rng.uniform(0.0, self.interval_s, ranks)

        def draw() -> np.ndarray:
            nonlocal clock
            clock = clock + step_s
            hit = clock >= self.interval_s
            clock = np.where(hit, clock - self.interval_s, clock)
            extra = np.full(ranks, self.per_step_s)
            n = int(hit.sum())
            if n and len(durations):
                extra[hit] += rng.choice(durations, n)
            return extra

        return draw


@dataclass
class PerStepCost:
    """Every rank at every `every`-th step (the same steps on all ranks): a duration drawn per
    rank from the measured ones; `per_step_s` on every step besides (the hooks)."""

    durations_s: Sequence[float]
    every: int = 1
    per_step_s: float = 0.0
    name: str = "per-step"

    def hiccups(self, ranks: int, rng: np.random.Generator, step_s: float):
        durations = np.asarray(self.durations_s, dtype=float)
        step = 0

        def draw() -> np.ndarray:
            nonlocal step
            step += 1
            extra = np.full(ranks, self.per_step_s)
            if len(durations) and step % self.every == 0:
                extra += rng.choice(durations, ranks)
            return extra

        return draw


def cpu_job(step_s: float = 0.010, gpus_per_node: int = 8) -> SimParams:
    """A ~`step_s` data-parallel step (the bench's CPU step) with mild jitter and a fabric whose
    all-reduce is a small share of it: where a fixed pause weighs most."""
    compute = ComputeModel(
        data_s=0.05 * step_s,
        forward_s=0.3 * step_s,
        backward_s=0.55 * step_s,
        optimizer_s=0.05 * step_s,
        jitter_cv=0.02,
        persistent_cv=0.005,
    )
    fabric = FabricModel(gradient_bytes=2e7, buckets=4, gpus_per_node=gpus_per_node)
    return SimParams(name="cpu-job", compute=compute, fabric=fabric, steps=3000, warmup_steps=200)


def _with_hiccups(sim: Simulator, draw_extra) -> None:
    original = sim.compute.draw

    def draw() -> PhaseDraw:
        d = original()
        return PhaseDraw(data=d.data, factor=d.factor, hiccup=d.hiccup + draw_extra())

    sim.compute.draw = draw  # type: ignore[method-assign]


def project(
    params: SimParams,
    ranks: Sequence[int],
    models: Sequence[PeriodicPauses | PerStepCost],
    seed: int = 0,
) -> list[dict[str, float]]:
    """Per rank count: the baseline mean and p99 step, and each model's relative cost."""
    out = []
    per_node = params.fabric.gpus_per_node
    for n in ranks:
        nodes = max(1, n // per_node)
        base = Simulator(params, nodes, seed=seed).run()
        row: dict[str, float] = {
            "ranks": float(nodes * per_node),
            "mean_step_s": base.mean_step_s,
            "p99_step_s": base.p99_step_s,
        }
        for model in models:
            sim = Simulator(params, nodes, seed=seed)
            rng = np.random.default_rng([seed, n, 7])
            _with_hiccups(sim, model.hiccups(sim.ranks, rng, base.mean_step_s))
            s = sim.run()
            row[model.name] = s.mean_step_s / base.mean_step_s - 1.0
            row[model.name + " p99"] = s.p99_step_s / base.p99_step_s - 1.0
        out.append(row)
    return out
