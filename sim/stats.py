"""Order statistics and streaming moments used by the simulator, the projection and their tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def expected_max_normal(n: int) -> float:
    """E[max of n i.i.d. standard normals], by quadrature of n·x·φ(x)·Φ(x)^(n-1).

    Accurate to ~1e-9 for n up to 10^6 (the integrand is smooth and decays as φ(x)).
    """
    if n < 1:
        raise ValueError("n must be >= 1")
    if n == 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 48001)
    phi = np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    cdf = 0.5 * (1.0 + _erf(x / math.sqrt(2.0)))
    # log-space power keeps Φ^(n-1) accurate where Φ is tiny and n is large
    with np.errstate(divide="ignore"):
        powered = np.exp((n - 1) * np.log(np.clip(cdf, 1e-300, 1.0)))
    integrand = n * x * phi * powered
    return float(np.trapezoid(integrand, x))


def _erf(x: np.ndarray) -> np.ndarray:
    return np.vectorize(math.erf, otypes=[float])(x)


@dataclass
class StreamingMoments:
    """Count, mean and variance of a stream of values in O(1) memory (Chan et al. merge)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0
    minimum: float = math.inf
    maximum: float = -math.inf

    def add_array(self, values: np.ndarray) -> None:
        n = int(values.size)
        if n == 0:
            return
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total
        self.minimum = min(self.minimum, float(values.min()))
        self.maximum = max(self.maximum, float(values.max()))

    @property
    def variance(self) -> float:
        return self.m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.variance)

    @property
    def cv(self) -> float:
        """Coefficient of variation (std / mean); 0 for an empty or zero-mean stream."""
        return self.std / self.mean if self.mean > 0 else 0.0


class QuantileSketch:
    """Approximate quantiles of a positive stream from a fixed log-spaced histogram (O(1) memory).

    Relative resolution 0.5 % between 1 µs and ~1 day: plenty for step-time percentiles.
    """

    def __init__(self, low: float = 1e-6, high: float = 1e5, bins: int = 5000) -> None:
        self._edges = np.geomspace(low, high, bins + 1)
        self._counts = np.zeros(bins + 2, dtype=np.int64)

    def add_array(self, values: np.ndarray) -> None:
        idx = np.searchsorted(self._edges, values, side="right")
        self._counts += np.bincount(idx, minlength=self._counts.size)

    def quantile(self, q: float) -> float:
        total = int(self._counts.sum())
        if total == 0:
            return math.nan
        target = q * (total - 1)
        cumulative = np.cumsum(self._counts)
        idx = int(np.searchsorted(cumulative, target, side="right"))
        if idx == 0:
            return float(self._edges[0])
        if idx > len(self._edges) - 1:
            return float(self._edges[-1])
        return float(math.sqrt(self._edges[idx - 1] * self._edges[idx]))
