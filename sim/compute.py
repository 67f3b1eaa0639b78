"""Per-rank compute-time model: jitter, heavy tails, persistent and transient stragglers, drift.

Each rank's step is data wait + forward + backward + optimizer. The GPU phases of rank ``i`` at
step ``t`` take their mean times multiplied by a speed factor

    f_i(t) = (1 + static_i) · slow_i · episode_i(t) · (1 + drift_i(t)) · (1 + jitter · z_i(t))

- ``static_i``  ~ N(0, persistent_cv): silicon and locality differences, drawn once per run;
- ``slow_i``    = ``slow_factor`` for ``slow_ranks`` persistent stragglers (ranks 0, 1, ...
  unless ``slow_rank_stride`` spreads them), 1 for the others;
- ``episode_i`` = ``episode_factor`` while rank ``i`` is in a transient slow episode (a noisy
  neighbour, a background job): a two-state Markov chain entered with probability
  ``episode_prob`` per step and left after ``episode_steps`` steps on average;
- ``drift_i``   a slow AR(1) process with stationary sd ``drift_cv`` and correlation time
  ``drift_steps`` (thermal drift: clocks follow temperature, which moves over minutes);
- ``z_i(t)``    i.i.d. N(0, 1): step-to-step jitter (kernel timing, scheduling, memory).

On top, a heavy-tailed *hiccup* (OS noise, GC, page faults, ECC retries) adds a Pareto-
distributed delay (minimum ``tail_scale_s``, shape ``tail_alpha``, capped at ``tail_max_s`` when
that is > 0) with probability ``tail_prob`` per rank-step. The data wait carries the same
jitter draw but none of the GPU factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ComputeModel:
    """Mean phase times and the distributions around them (every field documented above)."""

    data_s: float = 0.0
    forward_s: float = 0.1
    backward_s: float = 0.2
    optimizer_s: float = 0.0
    jitter_cv: float = 0.0
    persistent_cv: float = 0.0
    slow_ranks: int = 0
    slow_factor: float = 1.0
    slow_rank_stride: int = 1
    episode_prob: float = 0.0
    episode_steps: float = 50.0
    episode_factor: float = 1.0
    drift_cv: float = 0.0
    drift_steps: float = 500.0
    tail_prob: float = 0.0
    tail_scale_s: float = 0.01
    tail_alpha: float = 2.5
    tail_max_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("data_s", "forward_s", "backward_s", "optimizer_s", "jitter_cv"):
            if not (getattr(self, name) >= 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"ComputeModel.{name} must be finite and >= 0")
        if self.forward_s + self.backward_s <= 0:
            raise ValueError("ComputeModel: forward_s + backward_s must be > 0")
        if not 0 <= self.tail_prob <= 1 or not 0 <= self.episode_prob <= 1:
            raise ValueError("ComputeModel: probabilities must be in [0, 1]")
        if self.tail_alpha <= 1.0:
            raise ValueError("ComputeModel.tail_alpha must be > 1 (finite mean)")
        if self.drift_steps < 1 or self.episode_steps < 1:
            raise ValueError("ComputeModel: drift_steps and episode_steps must be >= 1")
        if self.slow_factor <= 0 or self.episode_factor <= 0 or self.slow_rank_stride < 1:
            raise ValueError("ComputeModel: factors must be > 0 and slow_rank_stride >= 1")

    @property
    def gpu_s(self) -> float:
        """Mean forward + backward + optimizer time of an unperturbed rank."""
        return self.forward_s + self.backward_s + self.optimizer_s


@dataclass
class PhaseDraw:
    """One step's compute for every rank (arrays of shape (ranks,))."""

    data: np.ndarray
    factor: np.ndarray  # multiplies forward_s, backward_s and optimizer_s
    hiccup: np.ndarray  # extra seconds, spent before the backward pass ends


class ComputeSampler:
    """Draws per-rank compute times step by step; random numbers come in fixed-size blocks.

    Generating numbers for ``block`` steps at once keeps the per-step cost to a few numpy
    operations while memory stays constant however many steps are run.
    """

    def __init__(
        self, model: ComputeModel, ranks: int, rng: np.random.Generator, block: int = 128
    ) -> None:
        self.model = model
        self.ranks = ranks
        self.rng = rng
        self.block = block
        m = model
        base = 1.0 + m.persistent_cv * rng.standard_normal(ranks)
        slow = np.ones(ranks)
        if m.slow_ranks > 0:
            idx = (np.arange(m.slow_ranks) * m.slow_rank_stride) % ranks
            slow[idx] = m.slow_factor
        # A speed factor must stay positive even for absurd cv values.
        self.base = np.maximum(base, 0.05) * slow
        self._phi = math.exp(-1.0 / m.drift_steps)
        self._drift_kick = m.drift_cv * math.sqrt(1.0 - self._phi**2)
        self.drift = m.drift_cv * rng.standard_normal(ranks)  # start in the stationary state
        self._episode_exit = 1.0 / m.episode_steps
        self.in_episode = np.zeros(ranks, dtype=bool)
        self._zero = np.zeros(ranks)
        self._cursor = block  # forces a refill on the first step

    def _refill(self) -> None:
        m, rng, shape = self.model, self.rng, (self.block, self.ranks)
        self._jitter = rng.standard_normal(shape) if m.jitter_cv > 0 else None
        self._drift_noise = rng.standard_normal(shape) if m.drift_cv > 0 else None
        self._episode_u = rng.random(shape) if m.episode_prob > 0 else None
        self._hiccup = None
        if m.tail_prob > 0:
            hits = rng.random(shape) < m.tail_prob
            sizes = np.zeros(shape)
            count = int(hits.sum())
            if count:
                # Pareto(alpha) with minimum tail_scale_s: scale · U^(-1/alpha)
                drawn = m.tail_scale_s * rng.random(count) ** (-1.0 / m.tail_alpha)
                sizes[hits] = np.minimum(drawn, m.tail_max_s) if m.tail_max_s > 0 else drawn
            self._hiccup = sizes
        self._cursor = 0

    def draw(self) -> PhaseDraw:
        if self._cursor >= self.block:
            self._refill()
        k = self._cursor
        self._cursor += 1
        m = self.model
        factor = self.base
        if self._drift_noise is not None:
            self.drift = self._phi * self.drift + self._drift_kick * self._drift_noise[k]
            factor = factor * (1.0 + self.drift)
        if self._episode_u is not None:
            u = self._episode_u[k]
            self.in_episode = np.where(self.in_episode, u >= self._episode_exit, u < m.episode_prob)
            factor = factor * np.where(self.in_episode, m.episode_factor, 1.0)
        if self._jitter is not None:
            noise = 1.0 + m.jitter_cv * self._jitter[k]
            factor = factor * noise
            data = m.data_s * noise
        else:
            data = np.full(self.ranks, m.data_s)
        factor = np.maximum(factor, 0.05)
        data = np.maximum(data, 0.0)
        hiccup = self._hiccup[k] if self._hiccup is not None else self._zero
        return PhaseDraw(data=data, factor=factor, hiccup=hiccup)
