"""Clock-free arrival skew: how early each rank reaches its collectives, from durations alone.

A rank's collective duration is its wait for the last peer plus the transfer. The transfer is
the same for every rank of one call, so for each (op, group, size class) the smallest recent
duration seen on any rank estimates it (the last arriver waits for no one); what a rank spends
beyond that is waiting, i.e. how early it arrived. No clocks are compared across processes.
A baseline learnt elsewhere (the exporter's, from every rank of the node and the job's view)
replaces that local minimum for its key.

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
    """The last `window` calls of one rank for one key: durations and the steps they were in."""

    __slots__ = ("durations", "steps")

    def __init__(self, window: int) -> None:
        self.durations: deque[float] = deque(maxlen=window)
        self.steps: deque[int] = deque(maxlen=window)

    def add(self, duration: float, step: int) -> None:
        self.durations.append(duration)
        self.steps.append(step)


class ArrivalEstimator:
    """Rolling-minimum transfer baselines and per-rank arrival lead over a window of calls."""

    def __init__(self, window: int = 256, lead_steps: int = 64) -> None:
        self.window = window  # calls kept per (rank, key)
        self.lead_steps = lead_steps  # steps the arrival lead is averaged over
        self._series: dict[Hashable, dict[Key, _Series]] = {}
        self._external: dict[Key, float] = {}

    def observe(self, rank: Hashable, records: Iterable[tuple[Key, float, int]]) -> list[float]:
        """Add (key, duration_s, step) calls of one rank; return each call's wait (s, >= 0)."""
        per_key = self._series.setdefault(rank, {})
        touched: list[tuple[Key, float]] = []
        for key, duration, step in records:
            series = per_key.get(key)
            if series is None:
                series = per_key[key] = _Series(self.window)
            series.add(duration, step)
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
        """Transfer estimate: the one learnt elsewhere if any, else the smallest recent duration
        of this key on any rank.

        An external baseline (the exporter's mean per-step minimum over every rank of the node,
        corrected by the job's) wins over the local minimum rather than being compared with it:
        the smallest of hundreds of durations sits several noise units below the typical
        transfer, so on a noisy fabric every rank of a balanced job would read that gap as a
        lead of its own (measured: 8.5 ms of "wait" on 12 ms gloo steps, 5.6 ms of it transfer).
        """
        external = self._external.get(key)
        if external is not None:
            return external
        best = float("inf")
        for per_key in self._series.values():
            series = per_key.get(key)
            if series is not None and series.durations:
                low = min(series.durations)
                if low < best:
                    best = low
        return 0.0 if best == float("inf") else best

    def merge_baselines(self, baselines: dict[Key, float]) -> None:
        """Baselines learnt elsewhere (the node's exporter sees every local rank); each replaces
        the one it had for its key."""
        self._external.update(baselines)

    def baselines(self) -> dict[Key, float]:
        keys = {key for per_key in self._series.values() for key in per_key}
        return {key: self.baseline(key) for key in keys}

    def lead(self, rank: Hashable, baselines: dict[Key, float] | None = None) -> float | None:
        """Waiting per step over this rank's last `lead_steps` steps, or None before any call.

        Per step rather than per call: after the first collective of a step the ranks are in
        step, so later calls of the same step wait little; what a rank loses per step is the
        sum, and averaging per call would dilute it by however many small calls follow.
        `baselines` (from `baselines()`) saves recomputing them for every rank of a scrape.
        """
        per_key = self._series.get(rank)
        if not per_key:
            return None
        last = max((s.steps[-1] for s in per_key.values() if s.steps), default=None)
        if last is None:
            return None
        since = last - self.lead_steps
        first = last
        total = 0.0
        for key, series in per_key.items():
            base = baselines[key] if baselines is not None and key in baselines else None
            if base is None:
                base = self.baseline(key)
            for duration, step in zip(series.durations, series.steps, strict=True):
                if step > since:
                    if duration > base:
                        total += duration - base
                    if step < first:
                        first = step
        return total / (last - first + 1)

    def forget(self, rank: Hashable) -> None:
        self._series.pop(rank, None)

    def ranks(self) -> list[Hashable]:
        return list(self._series)
