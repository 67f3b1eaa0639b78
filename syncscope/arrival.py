"""Clock-free arrival skew: how early each rank reaches its collectives, from durations alone.

A rank's collective duration is its wait for the last peer plus the transfer. The transfer is
the same for every rank of one call, so for each (op, group, size class) the smallest recent
duration seen on any rank estimates it (the last arriver waits for no one); what a rank spends
beyond that is waiting, i.e. how early it arrived. No clocks are compared across processes.

The exporter feeds every local rank into one estimator, so a steady straggler — whose peers
never see a wait-free call of their own — still sets the baseline. The agent keeps a
single-rank estimator as a fallback and merges the node-wide baselines the exporter returns.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterable

from syncscope.wire import size_bucket

Key = tuple[str, str, int]  # (op, group, size class)


def collective_key(op: str, group: str, nbytes: float) -> Key:
    return (op, group, size_bucket(nbytes))


def key_text(key: Key) -> str:
    return f"{key[0]}|{key[1]}|{key[2]}"


def parse_key_text(text: str) -> Key | None:
    parts = text.split("|")
    if len(parts) != 3:
        return None
    try:
        return (parts[0], parts[1], int(parts[2]))
    except ValueError:
        return None


class _Series:
    """The last `window` durations of one rank for one key, with their running sum."""

    __slots__ = ("durations", "total")

    def __init__(self, window: int) -> None:
        self.durations: deque[float] = deque(maxlen=window)
        self.total = 0.0

    def add(self, value: float) -> None:
        d = self.durations
        if len(d) == d.maxlen:
            self.total -= d[0]
        d.append(value)
        self.total += value


class ArrivalEstimator:
    """Rolling-minimum transfer baselines and per-rank arrival lead over a window of calls."""

    def __init__(self, window: int = 64) -> None:
        self.window = window
        self._series: dict[Hashable, dict[Key, _Series]] = {}
        self._external: dict[Key, float] = {}

    def observe(self, rank: Hashable, records: Iterable[tuple[Key, float]]) -> list[float]:
        """Add (key, duration_s) calls of one rank; return each call's wait (s, >= 0)."""
        per_key = self._series.setdefault(rank, {})
        touched: list[tuple[Key, float]] = []
        for key, duration in records:
            series = per_key.get(key)
            if series is None:
                series = per_key[key] = _Series(self.window)
            series.add(duration)
            touched.append((key, duration))
        baselines: dict[Key, float] = {}
        waits = []
        for key, duration in touched:
            base = baselines.get(key)
            if base is None:
                base = baselines[key] = self.baseline(key)
            waits.append(max(0.0, duration - base))
        return waits

    def baseline(self, key: Key) -> float:
        """Transfer estimate: the smallest recent duration of this key on any rank."""
        best = self._external.get(key, float("inf"))
        for per_key in self._series.values():
            series = per_key.get(key)
            if series is not None and series.durations:
                low = min(series.durations)
                if low < best:
                    best = low
        return 0.0 if best == float("inf") else best

    def merge_baselines(self, baselines: dict[Key, float]) -> None:
        """Baselines learnt elsewhere (the node's exporter sees every local rank)."""
        self._external.update(baselines)

    def baselines(self) -> dict[Key, float]:
        keys = {key for per_key in self._series.values() for key in per_key}
        return {key: self.baseline(key) for key in keys}

    def lead(self, rank: Hashable) -> float | None:
        """Mean wait over this rank's recent calls (all keys), or None before any call."""
        per_key = self._series.get(rank)
        if not per_key:
            return None
        total = 0.0
        count = 0
        for key, series in per_key.items():
            n = len(series.durations)
            if n:
                total += series.total - n * self.baseline(key)
                count += n
        return max(0.0, total / count) if count else None

    def forget(self, rank: Hashable) -> None:
        self._series.pop(rank, None)

    def ranks(self) -> list[Hashable]:
        return list(self._series)
