"""The pacing controller: turns the waits a rank sees at collectives into a bounded delay.

This is the one place where the paper's coordination mechanism lives (§4.3, "Coordination
Control Mechanisms", and §5.3, "Coordination and Pacing Mechanism"): each rank keeps a rolling
window of the waits it saw at the step's collectives; when its lead over the last peer is
persistently above an adaptive threshold it delays its next iteration by a bounded fraction of
that lead, and it backs off by itself when the imbalance subsides. It never runs a collective of
its own and it can be switched off at any moment.

The controller is a pure object (waits in, delay out) and imports only the standard library. The
same class also runs *vectorised* over many ranks at once (``PacingController(cfg, ranks=n)``):
the simulator uses that form so that it exercises exactly this arithmetic, not a copy. Both
forms go through the single :meth:`PacingController.update`; only the handful of primitive
operations (min, max, select, sort) come from a small backend chosen at construction, and the
numpy backend is imported only when a vectorised controller is built.

The rule, per update (see docs/pacing.md for the argument behind each step):

1. ``u = wait + delay_applied``: the rank's *unpaced* earliness. Once a delay is applied the
   observed wait drops by about the delay, so adding it back gives a signal the controller's own
   output does not move, which is what keeps the loop from oscillating.
2. ``lead`` = the ``lead_quantile`` of ``u`` over the window (robust: a checkpoint stall or one
   late peer does not move it), ``noise`` = the window's interquartile range / 1.349.
3. ``threshold = max(min_threshold_s, engage_noise_factor * noise)``; engage when
   ``lead > threshold``, release when ``lead < release_ratio * threshold`` (hysteresis).
4. While engaged the target delay is ``gain * (lead - margin)``, with
   ``margin = max(margin_s, margin_noise_factor * noise)`` so that the observed wait is regulated
   towards a small positive margin rather than towards zero; otherwise the target is 0.
5. The delay moves towards the target (``rise`` up, ``decay`` down), is cut at once when the
   observed wait falls below the margin (this rank is becoming the new straggler), and is
   clipped to ``[0, min(max_delay_s, max_step_fraction * step_s)]``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["PacingConfig", "PacingController", "ENV_PREFIX"]

ENV_PREFIX = "SYNCSCOPE_PACING_"

# Interquartile range of a normal distribution in units of its standard deviation.
_IQR_PER_SIGMA = 1.3489795003921634
# Delays below this are returned as exactly 0 so that "decayed" means off, not 1e-300 s.
_SNAP_TO_ZERO_S = 1e-6


@dataclass(frozen=True)
class PacingConfig:
    """Every constant of the controller; each can be set through ``SYNCSCOPE_PACING_<NAME>``."""

    # Waits kept in the rolling window (one per step); the statistics below are over it.
    window: int = 32
    # Hard bound on any delay returned, in seconds.
    max_delay_s: float = 0.050
    # When the step time is known, a delay is also bounded by this fraction of it.
    max_step_fraction: float = 0.10
    # Samples needed before the controller may engage (statistics of fewer are noise).
    min_samples: int = 8
    # Quantile of the window taken as the rank's lead over the last peer. A low quantile is
    # robust to isolated long waits (a peer's checkpoint, a GC pause) and conservative.
    lead_quantile: float = 0.25
    # Adaptive threshold: engage when lead > max(min_threshold_s, engage_noise_factor * noise).
    engage_noise_factor: float = 3.0
    # Floor of the threshold, in seconds: leads below this are never worth pacing.
    min_threshold_s: float = 0.002
    # Hysteresis: once engaged, release only when lead < release_ratio * threshold.
    release_ratio: float = 0.5
    # Fraction of (lead - margin) inserted as delay. Below 1 so a rank is never paced into
    # becoming the straggler on an ordinary step.
    gain: float = 0.5
    # Observed wait the controller aims to leave, in seconds, at least...
    margin_s: float = 0.001
    # ...and at least this many noise units (noisier arrivals need more room).
    margin_noise_factor: float = 1.0
    # Fraction of the gap to the target closed per step when the delay grows (gentle).
    rise: float = 0.25
    # Fraction of the gap closed per step when it shrinks, and the geometric factor by which
    # the delay is cut when the observed wait fell below the margin.
    decay: float = 0.5
    # Waits above this (seconds) are clipped before they enter the window: a 30 s checkpoint
    # stall is evidence of "much earlier", not a number to average.
    earliness_cap_s: float = 1.0
    # Start engaged-capable; False starts the controller disabled (same as calling disable()).
    enabled: bool = True

    def __post_init__(self) -> None:
        checks = (
            (self.window >= 4, "window must be >= 4"),
            (1 <= self.min_samples <= self.window, "min_samples must be in [1, window]"),
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
        )
        for ok, message in checks:
            if not ok:
                raise ValueError(f"PacingConfig: {message}")

    @staticmethod
    def env_name(field_name: str) -> str:
        """``max_delay_s`` -> ``SYNCSCOPE_PACING_MAX_DELAY`` (values are in seconds)."""
        name = field_name[:-2] if field_name.endswith("_s") else field_name
        return ENV_PREFIX + name.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> PacingConfig:
        """Defaults overridden by ``SYNCSCOPE_PACING_*`` variables; a bad value raises ValueError."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            var = cls.env_name(f.name)
            raw = env.get(var)
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


def _finite_nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0.0


def _parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(raw)


class _ScalarOps:
    """Primitive operations on Python floats and bools (the agent's path: stdlib only)."""

    inf = math.inf

    @staticmethod
    def sanitize(x: Any, cap: float) -> float:
        # Never raise, never let NaN through: anything unusable reads as "no earliness".
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
        if s > 0.0 and s != math.inf:
            return min(max_delay, fraction * s)
        return max_delay

    @staticmethod
    def new_window(window: int) -> list[float]:
        return [0.0] * window

    @staticmethod
    def store(buf: list[float], pos: int, u: float) -> None:
        buf[pos] = u

    @staticmethod
    def sorted_window(buf: list[float], count: int) -> list[float]:
        return sorted(buf if count == len(buf) else buf[:count])

    @staticmethod
    def column(sorted_buf: list[float], index: int) -> float:
        return sorted_buf[index]

    maximum = staticmethod(max)
    minimum = staticmethod(min)

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
    def zeros(_ranks: int | None) -> float:
        return 0.0

    @staticmethod
    def falses(_ranks: int | None) -> bool:
        return False

    @staticmethod
    def as_count(flag: bool) -> int:
        return 1 if flag else 0


class _ArrayOps:
    """The same primitives on numpy arrays of per-rank values (the simulator's path)."""

    def __init__(self) -> None:
        import numpy  # deferred: the agent never builds a vectorised controller

        self.np = numpy
        self.inf = numpy.inf
        self.maximum = numpy.maximum
        self.minimum = numpy.minimum
        self.where = numpy.where
        self.and_ = numpy.logical_and
        self.not_ = numpy.logical_not

    def sanitize(self, x: Any, cap: float) -> Any:
        np = self.np
        v = np.asarray(x, dtype=float)
        # NaN and +-inf read as "no earliness"; huge finite waits are clipped to the cap.
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

    def new_window(self, window: int) -> Any:
        raise NotImplementedError  # built with the rank count in PacingController.__init__

    @staticmethod
    def store(buf: Any, pos: int, u: Any) -> None:
        buf[:, pos] = u

    def sorted_window(self, buf: Any, count: int) -> Any:
        # Rows are ranks, columns the window: sorting along the contiguous axis is the fast one.
        return self.np.sort(buf if count == buf.shape[1] else buf[:, :count], axis=1)

    @staticmethod
    def column(sorted_buf: Any, index: int) -> Any:
        return sorted_buf[:, index]

    def zeros(self, ranks: int | None) -> Any:
        return self.np.zeros(ranks)

    def falses(self, ranks: int | None) -> Any:
        return self.np.zeros(ranks, dtype=bool)

    @staticmethod
    def as_count(flag: Any) -> Any:
        return flag.astype(int)


class PacingController:
    """Waits in, bounded delay out; the per-rank controller of paper §4.3 / §5.3.

    ``PacingController(config)`` is the agent's form: ``update`` takes and returns floats and
    the state attributes are plain ``float``/``bool``/``int``. ``PacingController(config,
    ranks=n)`` is the same controller for ``n`` independent ranks at once: ``update`` takes a
    length-``n`` array (or sequence) of waits and returns an array of delays, and the state
    attributes are arrays (needs numpy).
    """

    def __init__(self, config: PacingConfig | None = None, *, ranks: int | None = None) -> None:
        self.config = config if config is not None else PacingConfig()
        self.ranks = ranks
        cfg = self.config
        if ranks is None:
            self._ops: Any = _ScalarOps
            self._window: Any = _ScalarOps.new_window(cfg.window)
        else:
            if ranks < 1:
                raise ValueError("ranks must be >= 1")
            self._ops = _ArrayOps()
            self._window = self._ops.np.zeros((ranks, cfg.window))
        ops = self._ops
        self._pos = 0
        self._count = 0
        self._enabled = cfg.enabled
        # Indices into the sorted window, per fill level, computed once.
        self._quantile_index = [
            (_rank_index(cfg.lead_quantile, n), _rank_index(0.25, n), _rank_index(0.75, n))
            for n in range(cfg.window + 1)
        ]
        self.active: Any = ops.falses(ranks)
        self.current_delay_s: Any = ops.zeros(ranks)
        self.threshold_s: Any = ops.zeros(ranks) + cfg.min_threshold_s
        self.engagements: Any = ops.zeros(ranks) if ranks is None else ops.np.zeros(ranks, int)
        if ranks is None:
            self.engagements = 0
        self.total_delay_s: Any = ops.zeros(ranks)
        # Last lead and noise estimates, exposed for status pages and tests.
        self.lead_s: Any = ops.zeros(ranks)
        self.noise_s: Any = ops.zeros(ranks)
        self._margin: Any = ops.zeros(ranks) + cfg.margin_s

    @property
    def enabled(self) -> bool:
        return self._enabled

    def disable(self) -> None:
        """Hard off switch: from now on every delay is 0 and ``active`` is False until enable()."""
        self._enabled = False
        ops = self._ops
        self.active = ops.falses(self.ranks)
        self.current_delay_s = ops.zeros(self.ranks)

    def enable(self) -> None:
        """Undo disable(); the window kept filling meanwhile, so decisions resume at once."""
        self._enabled = True

    def update(self, wait_s: Any, step_s: Any = None) -> Any:
        """Feed the wait this rank saw at this step's collectives (seconds it waited for the last
        peer, i.e. how early it arrived; includes the effect of delay already applied). Return the
        delay (s) to insert before the next iteration: 0 <= delay <= max_delay_s, always.

        Assumes the delay returned by the previous call was the one applied before this step.
        Never raises on bad numbers: NaN, infinities and negatives read as a wait of 0.
        """
        cfg = self.config
        ops = self._ops
        wait = ops.sanitize(wait_s, cfg.earliness_cap_s)
        applied = self.current_delay_s
        # Unpaced earliness. When the observed wait is below the margin this rank arrived (nearly)
        # last, so its true earliness is unknown and may be below the delay: record only what was
        # seen, which keeps the estimate conservative.
        below_margin = wait < self._margin
        unpaced = ops.minimum(ops.where(below_margin, wait, wait + applied), cfg.earliness_cap_s)
        ops.store(self._window, self._pos, unpaced)
        self._pos = (self._pos + 1) % cfg.window
        if self._count < cfg.window:
            self._count += 1
        count = self._count

        bound = ops.step_bound(step_s, cfg.max_step_fraction, cfg.max_delay_s)
        if count < cfg.min_samples or not self._enabled:
            target = ops.zeros(self.ranks)
            engaged = ops.falses(self.ranks)
        else:
            ordered = ops.sorted_window(self._window, count)
            i_lead, i_q1, i_q3 = self._quantile_index[count]
            lead = ops.column(ordered, i_lead)
            noise = (ops.column(ordered, i_q3) - ops.column(ordered, i_q1)) * (1.0 / _IQR_PER_SIGMA)
            threshold = ops.maximum(cfg.min_threshold_s, cfg.engage_noise_factor * noise)
            engaged = ops.where(
                self.active,
                ops.not_(lead < cfg.release_ratio * threshold),
                lead > threshold,
            )
            self.engagements = self.engagements + ops.as_count(
                ops.and_(engaged, ops.not_(self.active))
            )
            margin = ops.maximum(cfg.margin_s, cfg.margin_noise_factor * noise)
            target = ops.where(engaged, ops.maximum(cfg.gain * (lead - margin), 0.0), 0.0)
            self.threshold_s = threshold
            self.lead_s = lead
            self.noise_s = noise
            self._margin = margin

        # Grow gently, shrink faster; if this rank arrived within the margin of the last peer it
        # is about to become the straggler: cut by the shortfall and then geometrically.
        step_gain = ops.where(target > applied, cfg.rise, cfg.decay)
        delay = applied + step_gain * (target - applied)
        shortfall_cut = (applied - (self._margin - wait)) * (1.0 - cfg.decay)
        delay = ops.where(below_margin, ops.minimum(delay, shortfall_cut), delay)
        delay = ops.minimum(ops.maximum(delay, 0.0), bound)
        delay = ops.where(delay < _SNAP_TO_ZERO_S, 0.0, delay)
        if not self._enabled:
            delay = ops.zeros(self.ranks)

        self.active = engaged
        self.current_delay_s = delay
        self.total_delay_s = self.total_delay_s + delay
        return delay

    def state(self) -> dict[str, Any]:
        """A snapshot for reporting (scalar form: plain Python values)."""
        return {
            "enabled": self._enabled,
            "active": self.active,
            "current_delay_s": self.current_delay_s,
            "threshold_s": self.threshold_s,
            "engagements": self.engagements,
            "total_delay_s": self.total_delay_s,
        }


def _rank_index(q: float, n: int) -> int:
    """Index of the q-quantile in a sorted list of n values (nearest rank, lower side)."""
    if n <= 1:
        return 0
    return min(n - 1, max(0, int(q * (n - 1) + 0.5)))
