"""Per-rank rolling state of every local rank, fed by ingest, read by scrapes and /v1/state."""

from __future__ import annotations

import bisect
import math
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from syncscope.exporter.settings import Settings

from syncscope.arrival import ArrivalEstimator, collective_key, key_text
from syncscope.wire import OPS, PHASES, Batch, CollectiveSeconds, StepSeconds

# Steps the diagnosis and the shares look back over (diagnosis.py reads recent_steps[-100:]).
DIAGNOSIS_STEPS = 100
STEP_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
)


@dataclass
class Ingest:
    """One validated batch, its records as rows in seconds whichever wire version it came in."""

    batch: Batch
    steps: list[StepSeconds]
    collectives: list[CollectiveSeconds]

    @classmethod
    def of(cls, batch: Batch) -> Ingest:
        """Raises wire.BadRows for rows the schema's bounds let through but that make no sense."""
        return cls(batch, batch.step_rows(), batch.collective_rows())


def clean_label(value: str, limit: int = 64) -> str:
    """Label values stay printable and short; the exposition format escapes the rest."""
    text = "".join(ch if ch.isprintable() else "_" for ch in value)[:limit]
    return text or "_"


@dataclass
class CollectiveTotals:
    calls: int = 0
    seconds: float = 0.0
    bytes: float = 0.0
    wait_seconds: float = 0.0


@dataclass
class RankState:
    job: str
    rank: int
    local_rank: int = 0
    world_size: int = 1
    hostname: str = ""
    pid: int = 0
    incarnation: str = ""
    incarnations: int = 0
    started_unix_s: float = 0.0
    last_report_unix_s: float = 0.0
    steps_total: int = 0
    phase_seconds: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))
    step_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_seconds_sum: float = 0.0
    collectives: dict[tuple[str, str], CollectiveTotals] = field(default_factory=dict)
    dropped_before: int = 0  # records lost by earlier incarnations of this rank
    dropped_current: int = 0
    window: deque = field(default_factory=deque)  # recent step durations (CV)
    recent: deque = field(default_factory=deque)  # recent (step, duration, phases, wait)
    pacing: dict[str, Any] | None = None
    pacing_delay_before: float = 0.0
    pacing_engagements_before: int = 0
    topology: dict[str, Any] | None = None

    @property
    def dropped_total(self) -> int:
        return self.dropped_before + self.dropped_current

    def cv(self) -> float | None:
        n = len(self.window)
        if n < 5:
            return None
        # Plain float arithmetic: statistics.pstdev works in exact fractions, ~20x slower, and
        # this runs for every rank on every scrape.
        mean = sum(self.window) / n
        if mean <= 0:
            return None
        var = sum((x - mean) * (x - mean) for x in self.window) / n
        return math.sqrt(var) / mean


class Store:
    """Thread-safe: ingest runs in the server's threads, scrapes in others."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.estimators: dict[str, ArrivalEstimator] = {}
        self.started_unix_s = time.time()
        self.ingested_records = 0
        self.rejected: dict[str, int] = {}

    def reject(self, reason: str, count: int = 1) -> None:
        with self.lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + count

    def ingest(self, ingest: Ingest) -> dict[str, Any]:
        """Fold one validated batch in; return the reply (node-wide baselines for the agent)."""
        batch = ingest.batch
        a = batch.agent
        job = clean_label(a.job)
        now = time.time()
        with self.lock:
            self._expire(now)
            key = (job, a.rank)
            state = self.ranks.get(key)
            if state is None:
                if len(self.ranks) >= self.settings.max_ranks:
                    self.rejected["too_many_ranks"] = self.rejected.get("too_many_ranks", 0) + 1
                    return {"accepted": False, "reason": "too many ranks"}
                if job not in self.estimators and len(self.estimators) >= self.settings.max_jobs:
                    self.rejected["too_many_jobs"] = self.rejected.get("too_many_jobs", 0) + 1
                    return {"accepted": False, "reason": "too many jobs"}
                state = self.ranks[key] = RankState(job=job, rank=a.rank)
            estimator = self.estimators.setdefault(job, ArrivalEstimator())
            if state.incarnation != clean_label(a.incarnation):
                self._new_incarnation(state, estimator)
            state.local_rank, state.world_size = a.local_rank, a.world_size
            state.hostname, state.pid = clean_label(a.hostname), a.pid
            state.incarnation = clean_label(a.incarnation)
            state.started_unix_s = a.started_unix_s
            state.last_report_unix_s = now
            state.dropped_current = max(state.dropped_current, batch.dropped_total)
            if batch.pacing is not None:
                state.pacing = {
                    "enabled": batch.pacing.enabled,
                    "active": batch.pacing.active,
                    "current_delay_s": batch.pacing.current_delay_s,
                    "threshold_s": batch.pacing.threshold_s,
                    "engagements": batch.pacing.engagements,
                    "total_delay_s": batch.pacing.total_delay_s,
                }
            if batch.topology is not None:
                state.topology = {
                    clean_label(k): clean_label(v, 256) if isinstance(v, str) else v
                    for k, v in list(batch.topology.items())[:64]
                }
            waits_by_step = self._collectives(state, estimator, ingest.collectives)
            self._steps(state, ingest.steps, waits_by_step)
            self.ingested_records += len(ingest.steps) + len(ingest.collectives)
            baselines = {key_text(k): v for k, v in estimator.baselines().items()}
        return {"accepted": True, "baselines": baselines}

    def _new_incarnation(self, state: RankState, estimator: ArrivalEstimator) -> None:
        # A restarted rank: keep the counters (they only grow), reset what describes "now".
        if state.incarnation:
            state.incarnations += 1
            state.dropped_before += state.dropped_current
            if state.pacing:
                state.pacing_delay_before += state.pacing.get("total_delay_s", 0.0)
                state.pacing_engagements_before += state.pacing.get("engagements", 0)
        state.dropped_current = 0
        state.pacing = None
        state.window = deque(maxlen=self.settings.step_window)
        state.recent = deque(maxlen=self.settings.recent_steps)
        estimator.forget(state.rank)

    def _collectives(
        self, state: RankState, estimator: ArrivalEstimator, rows: list[CollectiveSeconds]
    ) -> dict[int, float]:
        calls = []
        for op, group, nbytes, duration, step in rows:
            op = op if op in OPS else "other"
            group = clean_label(group)
            totals = state.collectives.get((op, group))
            if totals is None:
                if len(state.collectives) >= self.settings.max_series_per_rank:
                    self.rejected["too_many_series"] = self.rejected.get("too_many_series", 0) + 1
                    continue
                totals = state.collectives[(op, group)] = CollectiveTotals()
            calls.append((totals, step, collective_key(op, group, nbytes), duration, nbytes))
        waits = estimator.observe(state.rank, [(k, d, step) for _, step, k, d, _ in calls])
        by_step: dict[int, float] = {}
        for (totals, step, _key, duration, nbytes), wait in zip(calls, waits, strict=True):
            totals.calls += 1
            totals.seconds += duration
            totals.bytes += nbytes
            totals.wait_seconds += wait
            by_step[step] = by_step.get(step, 0.0) + wait
        return by_step

    def _steps(
        self, state: RankState, rows: list[StepSeconds], waits_by_step: dict[int, float]
    ) -> None:
        if not state.window.maxlen:
            state.window = deque(state.window, maxlen=self.settings.step_window)
            state.recent = deque(state.recent, maxlen=self.settings.recent_steps)
        for step, d, end_unix_s, values in rows:
            state.steps_total += 1
            state.step_seconds_sum += d
            state.step_bucket_counts[bisect.bisect_left(STEP_BUCKETS, d)] += 1
            for i, v in enumerate(values):
                state.phase_seconds[i] += v
            state.window.append(d)
            state.recent.append((step, d, values, waits_by_step.get(step, 0.0), end_unix_s))

    def _expire(self, now: float) -> None:
        limit = self.settings.expire_after_s
        for key in [k for k, s in self.ranks.items() if now - s.last_report_unix_s > limit]:
            state = self.ranks.pop(key)
            est = self.estimators.get(state.job)
            if est is not None:
                est.forget(state.rank)
                if not est.ranks() and not any(s.job == state.job for s in self.ranks.values()):
                    del self.estimators[state.job]

    # -- read side (callers hold no lock; these take it) -----------------------------------------
    def view(self, recent: int | None = None) -> dict[str, Any]:
        """A consistent snapshot of everything the collectors, state endpoint and page show.

        `recent` bounds the per-rank `recent_steps` materialised (None: all kept). Scrapes ask
        for DIAGNOSIS_STEPS only: building hundreds of dicts per rank was most of a scrape.
        """
        from syncscope.exporter.diagnosis import diagnose_job

        now = time.time()
        with self.lock:
            self._expire(now)
            jobs: dict[str, dict[str, Any]] = {}
            baselines: dict[str, dict[Any, float]] = {}
            for state in sorted(self.ranks.values(), key=lambda s: (s.job, s.rank)):
                est = self.estimators.get(state.job)
                lead = None
                if est is not None:
                    cache = baselines.get(state.job)
                    if cache is None:
                        cache = baselines[state.job] = est.baselines()
                    lead = est.lead(state.rank, cache)
                job = jobs.setdefault(state.job, {"ranks": []})
                job["ranks"].append(
                    _rank_view(state, lead, now, self.settings.stale_after_s, recent)
                )
            for name, job in jobs.items():
                job["diagnosis"] = diagnose_job(job["ranks"], self.settings)
                job["name"] = name
            return {
                "started_unix_s": self.started_unix_s,
                "now_unix_s": now,
                "ingested_records": self.ingested_records,
                "rejected": dict(self.rejected),
                "jobs": jobs,
            }


def _rank_view(
    s: RankState, lead: float | None, now: float, stale_after: float, keep: int | None = None
) -> dict[str, Any]:
    recent = list(s.recent)
    last = recent[-DIAGNOSIS_STEPS:]
    durations = [r[1] for r in last]
    total = sum(durations)
    shares = {}
    if total > 0:
        sums = [0.0] * len(PHASES)
        for r in last:
            for i, v in enumerate(r[2]):
                sums[i] += v
        shares = {phase: sums[i] / total for i, phase in enumerate(PHASES)}
    if keep is not None:
        recent = recent[-keep:] if keep > 0 else []
    pacing = dict(s.pacing) if s.pacing else None
    if pacing is not None:
        pacing["total_delay_s"] += s.pacing_delay_before
        pacing["engagements"] += s.pacing_engagements_before
    return {
        "rank": s.rank,
        "local_rank": s.local_rank,
        "world_size": s.world_size,
        "hostname": s.hostname,
        "pid": s.pid,
        "incarnation": s.incarnation,
        "restarts": s.incarnations,
        "last_report_unix_s": s.last_report_unix_s,
        "stale": now - s.last_report_unix_s > stale_after,
        "steps_total": s.steps_total,
        "step_seconds_sum": s.step_seconds_sum,
        "step_bucket_counts": list(s.step_bucket_counts),
        "phase_seconds_total": dict(zip(PHASES, s.phase_seconds, strict=True)),
        "step_time_mean_s": (total / len(durations)) if durations else None,
        "step_time_median_s": statistics.median(durations) if durations else None,
        "step_time_cv": s.cv(),
        "phase_shares": shares,
        "arrival_lead_s": lead,
        "wait_mean_s": (sum(r[3] for r in last) / len(durations)) if durations else None,
        "collectives": [
            {
                "op": op,
                "group": g,
                "calls": t.calls,
                "seconds": t.seconds,
                "bytes": t.bytes,
                "wait_seconds": t.wait_seconds,
            }
            for (op, g), t in sorted(s.collectives.items())
        ],
        "dropped_total": s.dropped_total,
        "pacing": pacing,
        "topology": s.topology,
        "recent_steps": [
            {
                "step": r[0],
                "step_s": r[1],
                "phases": dict(zip(PHASES, r[2], strict=True)),
                "wait_s": r[3],
            }
            for r in recent
        ],
    }
