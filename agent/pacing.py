"""The pacing controller: turns the waits a rank sees at collectives into a bounded delay.

The paper's coordination mechanism (§4.3, §5.3): when a rank's lead over the last peer, from a
rolling window of its waits at collectives, stays above an adaptive threshold, it delays its next
iteration by a bounded fraction of that lead, and backs off when the imbalance subsides.

A pure object (waits in, delay out), standard library only (agent/step_pacing.py feeds it at
the step boundary). The same class runs *vectorised* over many ranks (``PacingController(cfg,
ranks=n)``) so that the simulator exercises exactly this arithmetic: both forms go through
:meth:`PacingController.update`, with min, max, select and sort from a backend chosen at
construction (numpy imported only for the vectorised form).

The rule, per update (the reasoning: docs/pacing.md):
1. ``u = wait + delay_applied``, the *unpaced* lead, which the controller's own output does not
   move (that keeps the loop from oscillating).
2. ``lead`` = the ``lead_quantile`` of ``u`` over the window; ``noise`` = the window's standard
   deviation without its two largest samples.
3. ``threshold = max(min_threshold_s, (engage_noise_factor + balanced_lead(world_size)) *
   noise)``; engage when ``lead > threshold``, release below ``release_ratio * threshold``.
4. Engaged, the target delay is ``gain * (lead - margin)``, ``margin = max(margin_s,
   margin_noise_factor * noise)``: the wait is regulated towards a small margin, never zero.
5. The delay moves towards the target (``rise`` up, ``decay`` down), is cut at once when the
   observed wait falls below the margin, and is clipped to ``[0, min(max_delay_s,
   max_step_fraction * step_s)]``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import Any

from syncscope.wire import PacingState

__all__ = ["ENV_PREFIX", "PacingConfig", "PacingController", "balanced_lead"]

ENV_PREFIX = "SYNCSCOPE_PACING_"

# Delays below this are returned as exactly 0, so that "decayed" means off rather than 1e-300 s.
_SNAP_TO_ZERO_S = 1e-6
# Samples dropped from the top of the window before taking the standard deviation: two, because
# one isolated spike (a peer's checkpoint, a GC pause) enters the window as one value but a
# spike in the *difference* of waits as two.
_TRIMMED = 2


@dataclass(frozen=True)
class PacingConfig:
    """Every constant of the controller; each can be set through ``SYNCSCOPE_PACING_<NAME>``."""

    # Waits kept in the rolling window (one per step); the statistics below are over it.
    window: int = 32
    # Hard bound on any delay returned, in seconds.
    max_delay_s: float = 0.050
    # When the step time is known, a delay is also bounded by this fraction of it.
    max_step_fraction: float = 0.25
    # Samples needed before the controller may engage (statistics of fewer are noise).
    min_samples: int = 16
    # Quantile of the window taken as the rank's lead over the last peer. A low quantile is
    # robust to isolated long waits and conservative.
    lead_quantile: float = 0.25
    # Adaptive threshold, in noise units on top of the balanced-group lead (see world_size).
    engage_noise_factor: float = 3.0
    # Floor of the threshold, in seconds: leads below this are never worth pacing.
    min_threshold_s: float = 0.002
    # Hysteresis: once engaged, release only when lead < release_ratio * threshold.
    release_ratio: float = 0.5
    # Fraction of (lead - margin) inserted as delay. Below 1 so that an ordinary noisy step does
    # not make this rank the straggler.
    gain: float = 0.5
    # Observed wait the controller leaves, in seconds, at least...
    margin_s: float = 0.001
    # ...and at least this many noise units (noisier arrivals need more room).
    margin_noise_factor: float = 1.0
    # Fraction of the gap to the target closed per step when the delay grows (gently).
    rise: float = 0.25
    # Fraction of the gap closed per step when it shrinks. When the observed wait fell below the
    # margin, the delay is instead cut by the shortfall and then multiplied by (1 - decay).
    decay: float = 0.5
    # Waits above this (seconds) are clipped before they enter the window: a 30 s checkpoint
    # stall says "much earlier", not a number to average.
    earliness_cap_s: float = 1.0
    # Ranks in the job (0: unknown). In a balanced group of N ranks every rank still waits for
    # the slowest one, about E[max of N normals] noise units; the threshold discounts that lead
    # so that a large balanced job is not mistaken for an imbalanced one. from_env falls back
    # to torchrun's WORLD_SIZE.
    world_size: int = 0
    # False starts the controller disabled (as if disable() had been called).
    enabled: bool = True

    def __post_init__(self) -> None:
        checks = (
            (self.window >= 4, "window must be >= 4"),
            (4 <= self.min_samples <= self.window, "min_samples must be in [4, window]"),
            (_finite_nonneg(self.max_delay_s), "max_delay_s must be finite and >= 0"),
            (0.0 < self.max_step_fraction <= 1.0, "max_step_fraction must be in (0, 1]"),
            (0.0 <= self.lead_quantile <= 0.5, "lead_quantile must be in [0, 0.5]"),
            (_finite_nonneg(self.engage_noise_factor), "engage_noise_factor must be >= 0"),
            (_finite_nonneg(self.min_threshold_s), "min_threshold_s must be >= 0"),
            (0.0 <= self.release_ratio <= 1.0, "release_ratio must be in [0, 1]"),
            (0.0 < self.gain <= 1.0, "gain must be in (0, 1]"),
            (_finite_nonneg(self.margin_s), "margin_s must be >= 0"),
            (_finite_nonneg(self.margin_noise_factor), "margin_noise_factor must be >= 0"),
            (0.0 < self.rise <= 1.0, "rise must be in (0, 1]"),
            (0.0 < self.decay <= 1.0, "decay must be in (0, 1]"),
            (
                math.isfinite(self.earliness_cap_s) and self.earliness_cap_s > 0,
                "earliness_cap_s must be finite and > 0",
            ),
            (self.world_size >= 0, "world_size must be >= 0"),
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"PacingConfig: {message}")

    @staticmethod
    def env_name(field_name: str) -> str:
        """``max_delay_s`` -> ``SYNCSCOPE_PACING_MAX_DELAY`` (values stay in seconds)."""
        name = field_name[:-2] if field_name.endswith("_s") else field_name
        return ENV_PREFIX + name.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PacingConfig:
        """Defaults overridden by ``SYNCSCOPE_PACING_*``.

        A bad value raises ValueError naming it."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = cls.env_name(f.name)
            raw = env.get(var)
            if (raw is None or raw.strip() == "") and f.name == "world_size":
                var, raw = "WORLD_SIZE", env.get("WORLD_SIZE")  # set by torchrun
            if raw is None or raw.strip() == "":
                continue
            default = f.default
            try:
                if isinstance(default, bool):
                    values[f.name] = _parse_bool(raw)
                elif isinstance(default, int):
                    values[f.name] = int(raw)
                else:
                    values[f.name] = float(raw)
            except ValueError:
                raise ValueError(f"{var}={raw!r} is not a valid {type(default).__name__}") from None
        return cls(**values)


def balanced_lead(world_size: int) -> float:
    """Lead quantile of a rank's wait in a balanced group of ``world_size``, in noise units.

    Every rank waits for the maximum of N arrival times; with i.i.d. normal noise that is about
    E[max of N] (Blom's approximation) above its own mean, and the window's lower quartile sits
    0.674 noise units below that. Zero for unknown or tiny groups.
    """
    if world_size <= 2:
        return 0.0
    expected_max = NormalDist().inv_cdf((world_size - 0.375) / (world_size + 0.25))
    return max(0.0, expected_max - 0.674)


def _finite_nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0.0


def _parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


def _trimmed_sd_consistency(count: int) -> float:
    """Scale that makes the std of a normal sample without its top two values unbiased.

    Fitted to Monte-Carlo values for 16..64 samples (1.19, 1.12, 1.07 at 16, 32, 64).
    """
    return 1.0 + 1.29 * count**-0.69


class _ScalarOps:
    """Primitive operations on Python floats and bools (the agent's path: stdlib only)."""

    maximum = staticmethod(max)
    minimum = staticmethod(min)
    sqrt = staticmethod(math.sqrt)

    @staticmethod
    def sanitize(x: Any, cap: float) -> float:
        # Never raise, never let NaN through: anything unusable reads as "no lead".
        try:
            v = float(x)
        except (TypeError, ValueError):
            return 0.0
        if v > 0.0:  # False for NaN
            return v if v < cap else (cap if v != math.inf else 0.0)
        return 0.0

    @staticmethod
    def step_bound(step_s: Any, fraction: float, max_delay: float) -> float:
        if step_s is None:
            return max_delay
        try:
            s = float(step_s)
        except (TypeError, ValueError):
            return max_delay
        if 0.0 < s < math.inf:
            return min(max_delay, fraction * s)
        return max_delay

    @staticmethod
    def window(_ranks: int | None, size: int) -> list[float]:
        return [0.0] * size

    @staticmethod
    def swap(buf: list[float], pos: int, u: float) -> float:
        old = buf[pos]
        buf[pos] = u
        return old

    @staticmethod
    def sums(buf: list[float]) -> tuple[float, float]:
        return math.fsum(buf), math.fsum(x * x for x in buf)

    @staticmethod
    def sorted_window(buf: list[float], count: int) -> list[float]:
        return sorted(buf if count == len(buf) else buf[:count])

    @staticmethod
    def column(sorted_buf: list[float], index: int) -> float:
        return sorted_buf[index]

    @staticmethod
    def where(cond: bool, a: Any, b: Any) -> Any:
        return a if cond else b

    @staticmethod
    def and_(a: bool, b: bool) -> bool:
        return a and b

    @staticmethod
    def not_(a: bool) -> bool:
        return not a

    @staticmethod
    def full(_ranks: int | None, value: float) -> float:
        return value

    @staticmethod
    def falses(_ranks: int | None) -> bool:
        return False

    @staticmethod
    def counts(_ranks: int | None) -> int:
        return 0

    @staticmethod
    def as_count(flag: bool) -> int:
        return 1 if flag else 0


class _ArrayOps:
    """The same primitives on numpy arrays of per-rank values (the simulator's path)."""

    def __init__(self) -> None:
        import numpy  # deferred: the agent never builds a vectorised controller

        self.np = numpy
        self.maximum = numpy.maximum
        self.minimum = numpy.minimum
        self.sqrt = numpy.sqrt
        self.where = numpy.where
        self.and_ = numpy.logical_and
        self.not_ = numpy.logical_not

    def sanitize(self, x: Any, cap: float) -> Any:
        np = self.np
        v = np.asarray(x, dtype=float)
        # NaN and infinities read as "no lead"; huge finite waits are clipped to the cap.
        return np.where(np.isfinite(v), np.clip(v, 0.0, cap), 0.0)

    def step_bound(self, step_s: Any, fraction: float, max_delay: float) -> Any:
        if step_s is None:
            return max_delay
        np = self.np
        s = np.asarray(step_s, dtype=float)
        usable = np.isfinite(s) & (s > 0.0)
        return np.where(
            usable, np.minimum(max_delay, fraction * np.where(usable, s, 0.0)), max_delay
        )

    def window(self, ranks: int | None, size: int) -> Any:
        # Rows are ranks, columns the window: sorting along the contiguous axis is the fast one.
        return self.np.zeros((ranks, size))

    @staticmethod
    def swap(buf: Any, pos: int, u: Any) -> Any:
        old = buf[:, pos].copy()
        buf[:, pos] = u
        return old

    @staticmethod
    def sums(buf: Any) -> tuple[Any, Any]:
        return buf.sum(axis=1), (buf * buf).sum(axis=1)

    def sorted_window(self, buf: Any, count: int) -> Any:
        return self.np.sort(buf if count == buf.shape[1] else buf[:, :count], axis=1)

    @staticmethod
    def column(sorted_buf: Any, index: int) -> Any:
        return sorted_buf[:, index]

    def full(self, ranks: int | None, value: float) -> Any:
        return self.np.full(ranks, value)

    def falses(self, ranks: int | None) -> Any:
        return self.np.zeros(ranks, dtype=bool)

    def counts(self, ranks: int | None) -> Any:
        return self.np.zeros(ranks, dtype=int)

    @staticmethod
    def as_count(flag: Any) -> Any:
        return flag.astype(int)


class PacingController:
    """Waits in, bounded delay out: the per-rank controller of paper §4.3 / §5.3.

    ``PacingController(config)`` is the agent's form: ``update`` takes and returns floats and the
    state attributes are plain ``float``/``bool``/``int``. ``PacingController(config, ranks=n)``
    is the same controller for ``n`` independent ranks at once (needs numpy): ``update`` takes a
    length-``n`` array of waits and returns an array of delays, and the state attributes are
    arrays.
    """

    def __init__(self, config: PacingConfig | None = None, *, ranks: int | None = None) -> None:
        self.config = cfg = config if config is not None else PacingConfig()
        if ranks is not None and ranks < 1:
            raise ValueError("ranks must be >= 1")
        self.ranks = ranks
        self._ops: Any = _ScalarOps if ranks is None else _ArrayOps()
        ops = self._ops
        self._window = ops.window(ranks, cfg.window)
        self._sum: Any = ops.full(ranks, 0.0)
        self._sum_sq: Any = ops.full(ranks, 0.0)
        self._pos = 0
        self._count = 0
        self._enabled = cfg.enabled
        self._engage_factor = cfg.engage_noise_factor + balanced_lead(cfg.world_size)
        # Per fill level: index of the lead quantile, and the trimmed-std consistency factor.
        self._lead_index = [
            min(n - 1, max(0, int(cfg.lead_quantile * (n - 1) + 0.5)))
            for n in range(cfg.window + 1)
        ]
        self._sd_scale = [
            _trimmed_sd_consistency(n) if n > _TRIMMED + 1 else 0.0 for n in range(cfg.window + 1)
        ]
        self._margin: Any = ops.full(ranks, cfg.margin_s)

        self.active: Any = ops.falses(ranks)
        self.current_delay_s: Any = ops.full(ranks, 0.0)
        self.threshold_s: Any = ops.full(ranks, cfg.min_threshold_s)
        self.engagements: Any = ops.counts(ranks)
        self.total_delay_s: Any = ops.full(ranks, 0.0)
        # Latest estimates, for status pages and tests.
        self.lead_s: Any = ops.full(ranks, 0.0)
        self.noise_s: Any = ops.full(ranks, 0.0)

    @property
    def enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        """Hard off switch: from now on every delay is 0 and ``active`` is False until enable()."""
        self._enabled = False
        self.active = self._ops.falses(self.ranks)
        self.current_delay_s = self._ops.full(self.ranks, 0.0)

    def enable(self) -> None:
        """Undo disable(). The window kept filling meanwhile, so decisions resume at once."""
        self._enabled = True

    def update(self, wait_s: Any, step_s: Any = None) -> Any:
        """Feed the wait this rank saw at this step's collectives (seconds it waited for the last
        peer, i.e. how early it arrived; includes the effect of delay already applied). Return the
        delay (s) to insert before the next iteration: 0 <= delay <= max_delay_s, always.

        Assumes the delay returned by the previous call is the one that was applied before this
        step. Never raises on bad numbers: NaN, infinities, negatives and non-numbers read as 0.
        """
        cfg = self.config
        ops = self._ops
        wait = ops.sanitize(wait_s, cfg.earliness_cap_s)
        applied = self.current_delay_s
        # Unpaced lead. An observed wait below the margin means this rank arrived (nearly) last,
        # so its true lead may be below the delay: record only what was seen (conservative).
        below_margin = wait < self._margin
        unpaced = ops.minimum(ops.where(below_margin, wait, wait + applied), cfg.earliness_cap_s)
        old = ops.swap(self._window, self._pos, unpaced)
        self._pos = (self._pos + 1) % cfg.window
        if self._pos == 0:  # once per window: exact sums, so rounding never accumulates
            self._sum, self._sum_sq = ops.sums(self._window)
        else:
            self._sum = self._sum + (unpaced - old)
            self._sum_sq = self._sum_sq + (unpaced * unpaced - old * old)
        if self._count < cfg.window:
            self._count += 1
        count = self._count

        if count < cfg.min_samples:
            target = ops.full(self.ranks, 0.0)
            engaged = ops.falses(self.ranks)
        else:
            ordered = ops.sorted_window(self._window, count)
            lead = ops.column(ordered, self._lead_index[count])
            top1 = ops.column(ordered, count - 1)
            top2 = ops.column(ordered, count - 2)
            kept = count - _TRIMMED
            mean = (self._sum - top1 - top2) * (1.0 / kept)
            mean_sq = (self._sum_sq - top1 * top1 - top2 * top2) * (1.0 / kept)
            variance = ops.maximum(mean_sq - mean * mean, 0.0) * (kept / (kept - 1.0))
            noise = ops.sqrt(variance) * self._sd_scale[count]
            threshold = ops.maximum(cfg.min_threshold_s, self._engage_factor * noise)
            engaged = ops.where(
                self.active, ops.not_(lead < cfg.release_ratio * threshold), lead > threshold
            )
            if not self._enabled:
                engaged = ops.falses(self.ranks)
            self.engagements = self.engagements + ops.as_count(
                ops.and_(engaged, ops.not_(self.active))
            )
            margin = ops.maximum(cfg.margin_s, cfg.margin_noise_factor * noise)
            target = ops.where(engaged, ops.maximum(cfg.gain * (lead - margin), 0.0), 0.0)
            self.threshold_s = threshold
            self.lead_s = lead
            self.noise_s = noise
            self._margin = margin

        # Grow gently, shrink faster; a rank that arrived within the margin of the last peer is
        # turning into the straggler, so its delay is cut by the shortfall and then geometrically.
        delay = applied + ops.where(target > applied, cfg.rise, cfg.decay) * (target - applied)
        cut = (applied - (self._margin - wait)) * (1.0 - cfg.decay)
        delay = ops.where(below_margin, ops.minimum(delay, cut), delay)
        bound = ops.step_bound(step_s, cfg.max_step_fraction, cfg.max_delay_s)
        delay = ops.minimum(ops.maximum(delay, 0.0), bound)
        delay = ops.where(delay < _SNAP_TO_ZERO_S, 0.0, delay)
        if not self._enabled:
            delay = ops.full(self.ranks, 0.0)

        self.active = engaged
        self.current_delay_s = delay
        self.total_delay_s = self.total_delay_s + delay
        return delay

    def state(self) -> PacingState:
        """A snapshot for the wire (scalar form only; the vectorised form's are arrays)."""
        return PacingState(
            enabled=bool(self._enabled),
            active=bool(self.active),
            current_delay_s=float(self.current_delay_s),
            threshold_s=float(self.threshold_s),
            engagements=int(self.engagements),
            total_delay_s=float(self.total_delay_s),
        )
