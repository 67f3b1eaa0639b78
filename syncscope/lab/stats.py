"""Bootstrap intervals for the benches' side-by-side ratios (noisy machines, few rounds)."""

from __future__ import annotations

import random
import statistics


def resample(rng: random.Random, count: int, groups: list[int] | None) -> list[int]:
    """Indices of one bootstrap sample of `count` rounds. With `groups` (each round's process),
    two-stage: processes with replacement, then rounds within each, so the interval also
    covers how much whole processes differ."""
    if groups is None:
        return rng.choices(range(count), k=count)
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    clusters = list(members.values())
    pick: list[int] = []
    for c in rng.choices(clusters, k=len(clusters)):
        pick += rng.choices(c, k=len(c))
    return pick


def median_ci(
    values: list[float], rng: random.Random, n: int = 2000, groups: list[int] | None = None
) -> tuple[float, float]:
    """A 90 % bootstrap interval of the median."""
    meds = sorted(
        statistics.median(values[i] for i in resample(rng, len(values), groups)) for _ in range(n)
    )
    return meds[int(0.05 * n)], meds[int(0.95 * n)]


def ratio_of_means_ci(
    a: list[float],
    b: list[float],
    rng: random.Random,
    n: int = 2000,
    groups: list[int] | None = None,
) -> tuple[float, float]:
    """A 90 % bootstrap interval of sum(a) / sum(b), resampling rounds (pairs stay paired)."""
    out = []
    for _ in range(n):
        pick = resample(rng, len(a), groups)
        out.append(sum(a[i] for i in pick) / sum(b[i] for i in pick))
    out.sort()
    return out[int(0.05 * n)], out[int(0.95 * n)]
