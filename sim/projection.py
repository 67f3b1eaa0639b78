"""Projection: fit per-rank compute and communication to a measured run, simulate it larger.

The fit (docs/simulator.md, "Projection"):

- **compute** per rank-step = step time − exposed communication − pacing (everything the rank
  did itself). Hiccups are the steps more than ``TAIL_SIGMAS`` robust sds above the rank's
  median; their excess over the median is fitted as a Pareto tail (maximum likelihood, the
  smallest excess as scale, capped at twice the largest). From the rest: ``persistent_cv`` = spread of per-rank means beyond what the
  within-rank noise explains; jitter and thermal drift from the residual autocovariance,
  ``γ(0) = σ_j² + σ_d²`` and ``γ(k) = σ_d² φ^k`` for ``k ≥ 1`` (white noise + AR(1)).
- **communication**: per step, the smallest exposed communication over ranks is the last
  arriving rank's, i.e. pure transfer (it waited for nobody). Its median per world size is
  fitted to the ring law ``t(N) = a · 2(N-1)/N + b · 2(N-1)`` (bandwidth term ``a``, per-hop
  latency ``b``); one world size gives ``a`` only.

The fitted model is a :class:`~syncscope.sim.params.SimParams` on a flat fabric with one bucket,
run by the same simulator at each target size. Uncertainty: the fit is repeated on bootstrap
resamples (ranks with replacement, steps in moving blocks so drift survives), each projected
with a fresh seed; bands are the 5th and 95th percentiles.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from syncscope.sim.compute import ComputeModel
from syncscope.sim.engine import Simulator
from syncscope.sim.fabric import FabricModel
from syncscope.sim.params import SimParams
from syncscope.sim.records import MeasuredRun, RankSeries

TAIL_SIGMAS = 6.0
# Pareto shape used when too few hiccups were seen to fit one.
DEFAULT_TAIL_ALPHA = 2.5
MIN_TAIL_EVENTS = 8


@dataclass
class CommLaw:
    """Transfer time of the gradient all-reduce versus world size (ring law)."""

    bandwidth_term_s: float  # a: gradient bytes / bandwidth
    latency_s: float  # b: per hop
    sizes: list[int]
    measured_s: list[float]

    def time(self, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        return self.bandwidth_term_s * 2 * (ranks - 1) / ranks + self.latency_s * 2 * (ranks - 1)


@dataclass
class FittedModel:
    """What the fit found, and how the measured runs looked."""

    compute: ComputeModel
    comm: CommLaw
    reference_size: int
    measured: dict[int, dict[str, float]]
    tail_events: int
    notes: list[str] = field(default_factory=list)

    def sim_params(self, samples_per_rank: float, steps: int, warmup_steps: int) -> SimParams:
        law = self.comm
        # One byte per nanosecond of bandwidth term keeps the numbers readable in dumps.
        fabric = FabricModel(
            gradient_bytes=max(law.bandwidth_term_s, 1e-12) * 1e9,
            nic_bandwidth_Bps=1e9,
            nic_latency_s=max(law.latency_s, 0.0),
            buckets=1,
            algorithm="ring",
        )
        return SimParams(
            name="projection",
            description="fitted to a measured run",
            samples_per_rank=samples_per_rank,
            compute=self.compute,
            fabric=fabric,
            nodes=(self.reference_size,),
            steps=steps,
            warmup_steps=warmup_steps,
        )

    def as_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {
            "compute": asdict(self.compute),
            "comm": asdict(self.comm),
            "reference_size": self.reference_size,
            "measured": self.measured,
            "tail_events": self.tail_events,
            "notes": self.notes,
        }


def _compute_matrix(series: list[RankSeries], skip: int) -> np.ndarray:
    """(steps, ranks) compute seconds, warm-up steps dropped."""
    return np.stack([r.compute_s[skip:] for r in series], axis=1)


def _autocovariance(resid: np.ndarray, max_lag: int) -> np.ndarray:
    """Mean over ranks of the lag-k autocovariance of each column (NaNs ignored)."""
    out = np.zeros(max_lag + 1)
    for k in range(max_lag + 1):
        a, b = resid[: len(resid) - k], resid[k:]
        out[k] = float(np.nanmean(a * b))
    return out


def fit_compute(
    run: MeasuredRun, skip_fraction: float = 0.05
) -> tuple[ComputeModel, int, list[str]]:
    """Fit the per-rank compute distribution of one run (see the module docstring)."""
    notes: list[str] = []
    _, series = run.aligned()
    steps = len(series[0].steps)
    if steps < 50:
        raise ValueError(f"{run.source}: {steps} common steps; the fit needs at least 50")
    skip = max(1, int(skip_fraction * steps))
    c = _compute_matrix(series, skip)
    t_steps, ranks = c.shape
    median = np.median(c, axis=0)
    rel = c / median - 1.0
    mad = float(np.median(np.abs(rel - np.median(rel))))
    robust_sd = 1.4826 * mad if mad > 0 else float(np.std(rel)) or 1e-9
    threshold_rel = TAIL_SIGMAS * robust_sd
    hits = rel > threshold_rel
    tail_events = int(hits.sum())
    clean = np.where(hits, np.nan, c)

    # Phase means only set the split between forward and backward (the projection runs one
    # bucket, no overlap). Data wait and unaccounted time count as forward work so that every
    # multiplicative factor of the model (jitter, spread, drift) applies to the whole compute.
    def phase_mean(name: str) -> float:
        return float(np.mean([r.phase(name)[skip:].mean() for r in series]))

    forward_s = phase_mean("data") + phase_mean("forward") + phase_mean("other")
    backward_s = phase_mean("backward")
    optimizer_s = phase_mean("optimizer")
    rank_means = np.nanmean(clean, axis=0)
    mu = float(np.mean(rank_means))
    # Phases can miss time (clock granularity, unhooked work): scale them to the compute total.
    phase_total = forward_s + backward_s + optimizer_s
    if phase_total > 0:
        scale = mu / phase_total
        forward_s, backward_s, optimizer_s = (
            x * scale for x in (forward_s, backward_s, optimizer_s)
        )
    else:
        forward_s, backward_s, optimizer_s = mu / 3, 2 * mu / 3, 0.0
        notes.append("no phase breakdown: compute split 1:2 between forward and backward")

    resid = clean / rank_means - 1.0
    max_lag = int(min(60, max(2, t_steps // 10)))
    gamma = _autocovariance(resid, max_lag)
    total_var = max(float(gamma[0]), 0.0)
    drift_var, phi = 0.0, 0.0
    positive = [k for k in range(1, max_lag + 1) if gamma[k] > 0.05 * total_var]
    # contiguous run of clearly positive lags starting at 1
    run_len = 0
    for k in positive:
        if k == run_len + 1:
            run_len = k
    if run_len >= 2:
        lags = np.arange(1, run_len + 1)
        slope, intercept = np.polyfit(lags, np.log(gamma[1 : run_len + 1]), 1)
        phi = float(min(math.exp(slope), 0.999))
        drift_var = float(min(math.exp(intercept), total_var))
    jitter_var = max(total_var - drift_var, 0.0)
    drift_steps = -1.0 / math.log(phi) if 0 < phi < 1 else 500.0
    # Demeaning over a finite series hides part of a slow drift's variance; add back the
    # expected loss (1 + φ)/(1 - φ)/T of it.
    inflation = (1 + phi) / (1 - phi) / t_steps if phi > 0 else 0.0
    drift_var_true = drift_var / max(1.0 - inflation, 0.5)

    # Spread of per-rank means beyond what within-rank noise and drift explain.
    between = float(np.var(rank_means / mu, ddof=1)) if ranks > 1 else 0.0
    expected_from_noise = (jitter_var + drift_var_true * (1 + phi) / (1 - phi)) / t_steps
    persistent_var = max(between - expected_from_noise, 0.0)
    if ranks < 4:
        notes.append(f"only {ranks} ranks measured: the persistent spread is a rough guess")

    tail_prob, tail_scale, tail_alpha, tail_max = 0.0, 0.01, DEFAULT_TAIL_ALPHA, 0.0
    if tail_events:
        # Pareto by maximum likelihood: scale = the smallest excess seen, shape from the rest.
        # (Fixed-size stalls come out as a very steep tail, i.e. nearly fixed size: right.)
        excess = (c - median)[hits]
        tail_prob = tail_events / (t_steps * ranks)
        tail_scale = float(excess.min())
        # A fitted shape below 2 has no variance: cap the tail at twice the largest excess seen
        # rather than extrapolate hiccups nobody observed.
        tail_max = 2.0 * float(excess.max())
        if tail_events >= MIN_TAIL_EVENTS:
            logs = np.log(excess / tail_scale)
            tail_alpha = float(max(1.1, (tail_events - 1) / max(float(logs.sum()), 1e-12)))
        else:
            notes.append(f"{tail_events} hiccups only: tail shape set to {DEFAULT_TAIL_ALPHA}")
    model = ComputeModel(
        data_s=0.0,
        forward_s=forward_s,
        backward_s=backward_s,
        optimizer_s=optimizer_s,
        jitter_cv=math.sqrt(jitter_var),
        persistent_cv=math.sqrt(persistent_var),
        drift_cv=math.sqrt(drift_var_true),
        drift_steps=max(drift_steps, 1.0),
        tail_prob=min(tail_prob, 1.0),
        tail_scale_s=max(tail_scale, 1e-6),
        tail_alpha=tail_alpha,
        tail_max_s=tail_max,
    )
    return model, tail_events, notes


def transfer_series(run: MeasuredRun, skip_fraction: float = 0.05) -> np.ndarray:
    """Per step, the smallest exposed communication over ranks: the last arrival's transfer."""
    _, series = run.aligned()
    comm = np.stack([r.phase("comm_exposed") for r in series], axis=1)
    skip = max(1, int(skip_fraction * len(comm)))
    return comm[skip:].min(axis=1)


def fit_comm(sizes: list[int], transfer_s: list[float]) -> CommLaw:
    """Least-squares ring law through (world size, median transfer) points, non-negative."""
    x_bw = np.array([2 * (n - 1) / n for n in sizes])
    x_lat = np.array([2.0 * (n - 1) for n in sizes])
    y = np.array(transfer_s)
    a = b = 0.0
    if len(set(sizes)) >= 2:
        (a, b), *_ = np.linalg.lstsq(np.stack([x_bw, x_lat], axis=1), y, rcond=None)
    if len(set(sizes)) < 2 or a < 0 or b < 0:
        # One size, or a fit that wants a negative term: keep the one term that fits best.
        a_only = float(np.dot(x_bw, y) / np.dot(x_bw, x_bw)) if np.any(x_bw) else 0.0
        b_only = float(np.dot(x_lat, y) / np.dot(x_lat, x_lat)) if np.any(x_lat) else 0.0
        err_a = float(np.sum((y - a_only * x_bw) ** 2))
        err_b = float(np.sum((y - b_only * x_lat) ** 2))
        a, b = (a_only, 0.0) if len(set(sizes)) < 2 or err_a <= err_b else (0.0, b_only)
    return CommLaw(max(float(a), 0.0), max(float(b), 0.0), list(sizes), list(transfer_s))


def _measured_summary(run: MeasuredRun) -> dict[str, float]:
    _, series = run.aligned()
    step = np.mean(np.stack([r.step_s for r in series], axis=1), axis=1)
    skip = max(1, int(0.05 * len(step)))
    step = step[skip:]
    mean = float(step.mean())
    return {
        "world_size": float(run.world_size),
        "ranks_reported": float(len(series)),
        "steps": float(len(step)),
        "mean_step_s": mean,
        "cv": float(step.std(ddof=1) / mean) if mean > 0 else 0.0,
        "steps_per_s": 1.0 / mean if mean > 0 else 0.0,
    }


def fit(runs: list[MeasuredRun], transfer_s: list[float] | None = None) -> FittedModel:
    """Fit compute (from the largest run) and the communication law (from all runs).

    ``transfer_s`` replaces the per-run median transfer times (the bootstrap passes resampled
    ones), in the order of increasing world size.
    """
    if not runs:
        raise ValueError("no measured runs")
    runs = sorted(runs, key=lambda r: r.world_size)
    reference = runs[-1]
    compute, tail_events, notes = fit_compute(reference)
    sizes = [r.world_size for r in runs]
    if transfer_s is None:
        transfer_s = [float(np.median(transfer_series(r))) for r in runs]
    comm = fit_comm(sizes, transfer_s)
    measured = {r.world_size: _measured_summary(r) for r in runs}
    if len(runs) > 1:
        means = [float(np.mean([s.compute_s.mean() for s in r.aligned()[1]])) for r in runs]
        spread = max(means) / min(means) - 1.0
        if spread > 0.10:
            notes.append(
                f"per-rank compute differs by {spread:.0%} between world sizes "
                "(CPU or memory oversubscription?); the largest run's is projected"
            )
    for r in runs:
        notes.extend(r.notes)
    return FittedModel(compute, comm, reference.world_size, measured, tail_events, notes)


def resample_ranks(run: MeasuredRun, rng: np.random.Generator) -> MeasuredRun:
    """The same steps, ranks drawn with replacement: how much hinges on which ranks we saw."""
    _, series = run.aligned()
    picks = rng.integers(0, len(series), size=len(series))
    return replace(
        run,
        ranks=[replace(series[p], rank=i) for i, p in enumerate(picks)],
    )


def resample_median(values: np.ndarray, rng: np.random.Generator, block: int) -> float:
    """Median of a moving-block bootstrap resample (blocks keep bursts and drift together)."""
    n = len(values)
    block = max(1, min(block, n // 4 or 1))
    starts = rng.integers(0, max(n - block, 1), size=math.ceil(n / block))
    idx = np.concatenate([np.arange(s, min(s + block, n)) for s in starts])[:n]
    return float(np.median(values[idx]))


@dataclass
class ProjectionPoint:
    """Projected figures at one world size: point estimate and 5th/95th percentile band."""

    ranks: int
    step_s: tuple[float, float, float]
    throughput: tuple[float, float, float]
    efficiency: tuple[float, float, float]
    cv: tuple[float, float, float]

    def as_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("ranks", "step_s", "throughput", "efficiency", "cv")}


@dataclass
class Projection:
    model: FittedModel
    samples_per_rank: float
    points: list[ProjectionPoint]
    bootstrap: int

    def point(self, ranks: int) -> ProjectionPoint:
        return next(p for p in self.points if p.ranks == ranks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.as_dict(),
            "samples_per_rank": self.samples_per_rank,
            "bootstrap": self.bootstrap,
            "points": [p.as_dict() for p in self.points],
        }


def default_targets(reference: int, max_ranks: int) -> list[int]:
    """2×, 4×, … the measured size, up to ``max_ranks``."""
    out, n = [], reference * 2
    while n <= max_ranks:
        out.append(n)
        n *= 2
    return out


def project(
    runs: list[MeasuredRun],
    targets: list[int],
    *,
    samples_per_rank: float = 1.0,
    bootstrap: int = 20,
    steps: int = 1000,
    warmup_steps: int = 100,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> Projection:
    """Fit, then simulate every target size for the fit and for each bootstrap refit."""
    model = fit(runs)
    reference = model.reference_size
    sizes = sorted(set([reference, *targets]))
    rng = np.random.default_rng(seed)

    def simulate_all(m: FittedModel, run_seed: int) -> dict[int, tuple[float, float]]:
        params = m.sim_params(samples_per_rank, steps, warmup_steps)
        out = {}
        for n in sizes:
            summary = Simulator(params, n, seed=run_seed).run(steps, warmup_steps)
            out[n] = (summary.mean_step_s, summary.cv)
            if progress is not None:
                progress(steps + warmup_steps)
        return out

    point = simulate_all(model, seed)
    draws = []
    runs_sorted = sorted(runs, key=lambda r: r.world_size)
    transfers = [transfer_series(r) for r in runs_sorted]
    for b in range(bootstrap):
        # Compute: which ranks were measured. Communication: step-to-step noise of the medians
        # (resampling ranks would drop the last-arriving rank and bias the transfer upwards).
        resampled = [resample_ranks(r, rng) for r in runs_sorted]
        medians = [resample_median(t, rng, block=50) for t in transfers]
        try:
            refit = fit(resampled, medians)
        except ValueError:
            continue
        draws.append(simulate_all(refit, seed + 1 + b))

    def metrics(sim: dict[int, tuple[float, float]], n: int) -> tuple[float, float, float, float]:
        step, cv = sim[n]
        thr = samples_per_rank * n / step
        ref_thr = samples_per_rank * reference / sim[reference][0]
        return step, thr, (thr / n) / (ref_thr / reference), cv

    points = []
    for n in sizes:
        est = metrics(point, n)
        if draws:
            table = np.array([metrics(d, n) for d in draws])
            lo, hi = np.percentile(table, 5, axis=0), np.percentile(table, 95, axis=0)
        else:
            lo = hi = np.array(est)
        points.append(
            ProjectionPoint(
                n,
                *(
                    (float(min(lo[i], est[i])), float(est[i]), float(max(hi[i], est[i])))
                    for i in range(4)
                ),
            )
        )
    return Projection(model, samples_per_rank, points, len(draws))
