"""Per-rank rolling state of every local rank, fed by ingest, read as typed views by every reader.

`Store.view()` is the exporter's one contract with its readers (the collectors, /v1/state and
the status page, through exporter.diagnosis.snapshot, which diagnoses each job; the diagnosis
reads the rank views): an immutable `StoreView` snapshot. `as_json` turns it into the JSON of
/v1/state.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import math
import statistics
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from syncscope.exporter.findings import NOT_IN_JSON, OMIT_IF_NONE, Diagnosis
from syncscope.exporter.jobwide import SMALL_GROUP, Interest, JobWide
from syncscope.exporter.pooling import JobPool, NodeInflation, Sample
from syncscope.exporter.settings import Settings
from syncscope.exporter.throughput import Throughput, ThroughputView

from syncscope.arrival import collective_key, key_text
from syncscope.catalog import BADPUT_CATEGORIES, LOST_PROGRESS, STEP_WINDOW
from syncscope.wire import (
    EVENT_CHECKPOINT_LOAD,
    EVENT_COMPILE,
    EVENT_STARTUP,
    GROUP_FACT,
    GROUP_FIRST_FACT,
    MAX_LABEL_LEN,
    MAX_TOPOLOGY_ENTRIES,
    MAX_TOPOLOGY_TEXT,
    OPS,
    P2P_OPS,
    PHASES,
    Batch,
    CollectiveSeconds,
    EventSeconds,
    PacingState,
    Phase,
    StepSeconds,
    blocked_s,
    group_first,
    group_ranks,
    pipeline_stage,
)

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
# Each step's duration over its rank's median step (RATIO_MEDIAN_EVERY steps old at most): the
# jitter histogram, alike at 10 ms and 10 s steps (absolute buckets 1, 2.5, 5 s cannot
# show 10 % jitter on a 1.2 s step). 1 is left out: the median splits steps half and half.
RATIO_BUCKETS = (0.5, 0.8, 0.9, 0.95, 1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0)
RATIO_MEDIAN_EVERY = 16
# Field metadata for `as_json`. BY_PHASE: the field holds one number per wire.Phase, in Phase
# order (index it with a Phase), and its JSON is an object keyed by phase label ({} when the
# tuple is empty). OMIT_IF_NONE and NOT_IN_JSON (findings, which store imports): the key is left
# out of the JSON while the field is None, or always.
BY_PHASE = {"json": "by_phase"}


@dataclass
class Ingest:
    """One validated batch, its records as rows in seconds whichever wire version it came in."""

    batch: Batch
    steps: list[StepSeconds]
    collectives: list[CollectiveSeconds]
    events: list[EventSeconds] = field(default_factory=list)

    @classmethod
    def of(cls, batch: Batch) -> Ingest:
        """Raises wire.BadRows for rows the schema's bounds let through but that make no sense."""
        return cls(batch, batch.step_rows(), batch.collective_rows(), batch.event_rows())


def clean_label(value: str, limit: int = MAX_LABEL_LEN) -> str:
    """Label values stay printable and short; the exposition format escapes the rest."""
    text = "".join(ch if ch.isprintable() else "_" for ch in value)[:limit]
    return text or "_"


# -- the views: what readers get ---------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class RecentStep:
    """One recent step of a rank. The store keeps these as they are, so views copy no step."""

    step: int
    step_s: float
    phases: tuple[float, ...] = field(metadata=BY_PHASE)
    wait_s: float  # this step's wait for the last peer on this node at collectives (pooling)
    # A warm-up step (Store._warm_up): its incarnation's first, or one a checkpoint load fell
    # in: compiling, lazy init, the loader's start. Left out of the rank's rolling figures and
    # the diagnosis; in /v1/state only where True.
    warm_up: bool | None = field(default=None, metadata=OMIT_IF_NONE)


@dataclass(frozen=True)
class CollectiveView:
    """A rank's totals for one (op, group), and per step over its last STEP_WINDOW steps (all
    its steps, before it has that many reported here): what the wait chain reads, so that a
    straggler that appears after hours of a clean job is followed where its victims wait now."""

    op: str
    group: str
    calls: int
    seconds: float
    bytes: float
    wait_seconds: float
    seconds_per_step: float
    wait_per_step: float


@dataclass(frozen=True)
class RankView:
    """One rank as of the snapshot: totals, rolling figures over the last STEP_WINDOW steps."""

    rank: int
    local_rank: int
    world_size: int
    hostname: str
    pid: int
    incarnation: str
    restarts: int
    last_report_unix_s: float
    stale: bool
    steps_total: int
    step_seconds_sum: float
    step_bucket_counts: tuple[int, ...]  # per STEP_BUCKETS bound, then +Inf; not cumulative
    phase_seconds_total: tuple[float, ...] = field(metadata=BY_PHASE)
    step_time_mean_s: float | None
    step_time_median_s: float | None
    step_time_cv: float | None
    phase_shares: tuple[float, ...] = field(metadata=BY_PHASE)  # empty until steps take time
    # How early the rank arrives at collectives (mean of the last 64 steps): job-wide (lead_scope
    # "job", the rules' figure read back from Prometheus) where the exporter has one, else this
    # node's own (node_lead_s). The diagnosis, the page and /v1/state use this one.
    arrival_lead_s: float | None
    wait_mean_s: float | None
    collectives: tuple[CollectiveView, ...]
    dropped_total: int
    pacing: PacingState | None  # totals include earlier incarnations of the rank
    topology: Mapping[str, Any] | None
    recent_steps: tuple[RecentStep, ...]
    step_ratio_bucket_counts: tuple[int, ...] = ()  # per RATIO_BUCKETS bound, then +Inf
    step_ratio_sum: float = 0.0
    # This exporter's own lead (over the rank blocked least on this node), what the
    # syncscope_arrival_lead_seconds gauge exports.
    node_lead_s: float | None = None
    # Whose figure arrival_lead_s is: "job" (read back from Prometheus) or "node" (node_lead_s).
    lead_scope: str = "node"
    # Work the rank reported (samples, tokens): totals over the exporter's life (None: never
    # known, so no series), and per second over its last STEP_WINDOW steps that said.
    samples_total: int | None = None
    tokens_total: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    # The rank's life across its incarnations (exporter/store.py, "goodput"): the earliest
    # process start seen, productive step time (step less data wait, exposed communication,
    # pacing and checkpoint time inside steps), badput seconds by category
    # (catalog.BADPUT_CATEGORIES) and the steps its restarts ran again.
    process_started_unix_s: float | None = None
    # When its current incarnation started (its attach, else its first report here).
    started_unix_s: float = 0.0
    # When this exporter received that incarnation's first step (None: none yet): the job-wide
    # rules judge a job once every rank's is a straggler window old (recorded.WINDOW_FULL).
    steps_since_unix_s: float | None = None
    productive_s: float = 0.0
    badput_s: Mapping[str, float] = field(default_factory=dict)
    lost_steps: int = 0
    # Its throughput per GPU now and its own best sustained level (exporter.throughput).
    throughput: ThroughputView | None = field(default=None, metadata=OMIT_IF_NONE)
    # Its pipeline stage where it is a pipeline's rank: leads, the straggler and the idle at
    # the sync compare it with the ranks of its stage only (a pipeline's stages differ in work
    # by design; exporter.pooling).
    pipeline_stage: int | None = field(default=None, metadata=OMIT_IF_NONE)
    # Its phases are timed in one step of this many; the other steps' phases are estimates,
    # that step's shares of their totals (agent/phases.py, "Phase sampling"). 1: all timed.
    phase_every: int = 1
    # Steps its current incarnation delivered since its latest warm-up step (Store._warm_up):
    # the diagnosis names nothing until every rank has a settled window of them
    # (Thresholds.window). None: not known (a view replayed from before it was counted),
    # taken as settled.
    settled_steps: int | None = field(default=None, metadata=OMIT_IF_NONE)

    def label_values(self, job: str) -> list[str]:
        """Its values for the catalog's RANK labels (job, node, rank, local_rank)."""
        return [job, self.hostname, str(self.rank), str(self.local_rank)]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RankView:
        """The inverse of `as_json` for one rank: how recorded /v1/state snapshots are replayed."""

        def by_phase(values: Mapping[str, float]) -> tuple[float, ...]:
            return tuple(values[p] for p in PHASES) if values else ()

        return cls(
            **{
                **data,
                "step_bucket_counts": tuple(data["step_bucket_counts"]),
                "step_ratio_bucket_counts": tuple(data.get("step_ratio_bucket_counts", ())),
                "phase_seconds_total": by_phase(data["phase_seconds_total"]),
                "phase_shares": by_phase(data["phase_shares"]),
                "collectives": tuple(
                    CollectiveView(**_per_step(c, data["steps_total"])) for c in data["collectives"]
                ),
                "pacing": PacingState(**data["pacing"]) if data["pacing"] else None,
                "recent_steps": tuple(
                    RecentStep(
                        s["step"], s["step_s"], by_phase(s["phases"]), s["wait_s"], s.get("warm_up")
                    )
                    for s in data["recent_steps"]
                ),
                "throughput": ThroughputView(**data["throughput"])
                if data.get("throughput")
                else None,
            }
        )


@dataclass(frozen=True)
class Goodput:
    """The job's life as the ranks here saw it: goodput over the rank-seconds since its
    earliest process start, and each badput category's share of them (the recording rules'
    job-wide figures, over this node's ranks only)."""

    started_unix_s: float
    ranks: int
    ratio: float  # (productive - lost progress) / (ranks x (now - started))
    # category -> share: BADPUT_CATEGORIES, then data_wait, sync_wait, pacing and
    # nothing_running (the rest, not below 0); with the ratio they add up to 1.
    badput: Mapping[str, float]


# The shares besides BADPUT_CATEGORIES: from the phase counters, and what is left.
PHASE_BADPUT = (("data_wait", "data"), ("sync_wait", "comm_exposed"), ("pacing", "pacing"))
NOTHING_RUNNING = "nothing_running"


def goodput(ranks: Iterable[RankView], now: float) -> Goodput | None:
    """Goodput of `ranks` since the earliest of their processes started; None before any
    rank said when it started."""
    ranks = list(ranks)
    starts = [r.process_started_unix_s for r in ranks if r.process_started_unix_s]
    if not starts:
        return None
    started = min(starts)
    rank_seconds = len(ranks) * (now - started)
    if rank_seconds <= 0:
        return None
    productive = sum(r.productive_s for r in ranks)
    seconds = {c: sum(r.badput_s.get(c, 0.0) for r in ranks) for c in BADPUT_CATEGORIES}
    for name, phase in PHASE_BADPUT:
        at = PHASES.index(phase)
        seconds[name] = sum(r.phase_seconds_total[at] for r in ranks if r.phase_seconds_total)
    # Everything a rank-second was spent on but productive steps (lost progress is part of
    # those) and the categories above: no step, no startup, no checkpoint running.
    busy = productive + sum(v for c, v in seconds.items() if c != LOST_PROGRESS)
    seconds[NOTHING_RUNNING] = max(0.0, rank_seconds - busy)
    return Goodput(
        started_unix_s=started,
        ranks=len(ranks),
        ratio=(productive - seconds[LOST_PROGRESS]) / rank_seconds,
        badput={c: v / rank_seconds for c, v in seconds.items()},
    )


@dataclass(frozen=True)
class PackageEnergy:
    package: str  # the zone's name: "package-0"
    joules: float  # since the exporter first read the zone


@dataclass(frozen=True)
class CpuEnergy:
    """What one read of the host's CPU package energy found (exporter.energy reads it with each
    snapshot): the packages, or why there are none."""

    packages: tuple[PackageEnergy, ...]
    missing: str | None = None  # set exactly when `packages` is empty


@dataclass(frozen=True)
class JobView:
    """One job's ranks on this node and their diagnosis."""

    ranks: tuple[RankView, ...]  # by rank
    diagnosis: Diagnosis
    name: str
    pooled_steps_total: int = 0  # steps every rank here delivered (exporter.pooling)
    transfer_seconds_total: float = 0.0  # the sum over them of the node's per-step minimum
    samples: tuple[Sample, ...] = ()  # the node's minimum at sampled steps (exporter.pooling)
    # Prometheus's job-wide figures, read back (exporter.jobwide); None: a node-local view.
    job_wide: JobWide | None = None
    goodput: Goodput | None = None  # over this node's ranks (the rules have the job's)


@dataclass(frozen=True)
class StoreView:
    """A consistent snapshot of everything the exporter knows."""

    started_unix_s: float
    now_unix_s: float
    ingested_records: int
    rejected: Mapping[str, int]  # refusals by reason
    jobs: Mapping[str, JobView]  # by name
    # The host's CPU package energy (exporter.energy, read with the snapshot); None: not read.
    cpu_energy: CpuEnergy | None = None
    price_per_gpu_hour: float | None = None  # the exporter's setting (cost rules)

    def ranks(self) -> Iterator[tuple[str, RankView]]:
        """Every rank of every job, with its job's name."""
        for name, job in self.jobs.items():
            for r in job.ranks:
                yield name, r


def as_json(value: Any) -> Any:
    """A view (or any part of one) as JSON: what /v1/state serves.

    Dataclasses become objects with their fields in declaration order (the views declare them in
    /v1/state's key order), per-phase tuples objects keyed by phase label.
    """
    if value is None or isinstance(value, (str, int, float)):
        return value
    if isinstance(value, Mapping):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [as_json(v) for v in value]
    out: dict[str, Any] = {}
    cls: type = type(value)  # a dataclass: a view, or wire.PacingState inside one
    for name, by_phase, omit_if_none in json_fields(cls):
        v = getattr(value, name)
        if by_phase:
            out[name] = dict(zip(PHASES, v, strict=True)) if v else {}
        elif not (omit_if_none and v is None):
            out[name] = as_json(v)
    return out


@functools.cache
def json_fields(cls: type) -> tuple[tuple[str, bool, bool], ...]:
    # Looked up once per class: /v1/state?recent=300 renders thousands of RecentSteps.
    return tuple(
        (f.name, f.metadata == BY_PHASE, f.metadata == OMIT_IF_NONE)
        for f in dataclasses.fields(cls)
        if f.metadata != NOT_IN_JSON
    )


# -- the store's own state -----------------------------------------------------------------------
@dataclass
class CollectiveTotals:
    calls: int = 0
    seconds: float = 0.0
    bytes: float = 0.0
    wait_seconds: float = 0.0


Mark = tuple[int, int, dict[tuple[str, str], tuple[float, float]]]


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
    # When the current incarnation's first step came in (0.0: none yet). An agent reports its
    # first steps seconds after its attach (a compile, lazy init, the first flush), and a rank's
    # series start there: the job-wide rules wait a window after it, so that every rank's
    # rates span a whole window of its steps.
    steps_since_unix_s: float = 0.0
    last_report_unix_s: float = 0.0
    steps_total: int = 0
    phase_seconds: list[float] = field(default_factory=lambda: [0.0] * len(PHASES))
    step_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    step_seconds_sum: float = 0.0
    ratio_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(RATIO_BUCKETS) + 1))
    ratio_sum: float = 0.0
    median_s: float = 0.0  # of the window, every RATIO_MEDIAN_EVERY steps; 0: none yet
    collectives: dict[tuple[str, str], CollectiveTotals] = field(default_factory=dict)
    # (steps_total, the job's pooled steps, {(op, group): (seconds, wait_seconds)}) after each
    # of its reports, from the newest at or before STEP_WINDOW steps ago: its collectives'
    # figures over the window. A wait is added when its step is pooled (often at a peer's
    # report), so waits count per pooled step and seconds per step delivered.
    marks: deque[Mark] = field(default_factory=deque)
    dropped_before: int = 0  # records lost by earlier incarnations of this rank
    dropped_current: int = 0
    window: deque[float] = field(default_factory=deque)  # recent step durations (CV)
    samples_total: int | None = None  # None until a step says how many
    tokens_total: int | None = None
    work: deque[tuple[float, int, int]] = field(
        default_factory=deque
    )  # recent (d, samples, tokens)
    recent: deque[RecentStep] = field(default_factory=deque)
    pacing: PacingState | None = None  # as the current incarnation last reported it
    pacing_delay_before: float = 0.0
    pacing_engagements_before: int = 0
    topology: dict[str, Any] | None = None  # replaced whole, never changed in place
    # Its pipeline stage (wire.pipeline_stage), once a point-to-point op in a group whose
    # ranks its topology lists says it is one; None: not a pipeline's rank (or not known yet).
    stage: int | None = None
    phase_every: int = 1  # its current incarnation's phase sampling (wire.AgentInfo)
    # The rank's life (Store._events, _steps, _new_incarnation): what goodput is made of.
    process_started_unix_s: float = 0.0  # the earliest of its incarnations; 0: not known
    productive_s: float = 0.0
    badput_s: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(BADPUT_CATEGORIES, 0.0)
    )
    lost_steps: int = 0
    # In-step checkpoint seconds by step, until that step's row takes them out of productive.
    checkpoint_pending: dict[int, float] = field(default_factory=dict)
    # Step numbers across incarnations: the highest step an earlier incarnation reported, the
    # mean productive step time (its first step left out) of the latest earlier one with
    # steps; this incarnation's first and highest step, and its steps after the first with
    # their productive time.
    high_step: int = -1
    previous_step_s: float = 0.0
    # The latest incarnation with steps: its highest step, and its productive seconds so far
    # (productive_s) before each step a restart may resume at (its first step, each step a
    # checkpoint fell in and the one after; the latest RESUME_MARKS): what the steps a restart
    # runs again took the first time, exactly, where it resumes at one of them.
    previous_max_step: int = -1
    resume_marks: dict[int, float] = field(default_factory=dict)
    first_step: int = -1
    max_step: int = -1
    first_step_s: float = 0.0
    later_steps: int = 0
    later_steps_s: float = 0.0
    throughput: Throughput = field(default_factory=Throughput)
    # Warm-up (Store._warm_up): the latest warm-up step of this incarnation (-1: none yet) and
    # the steps it delivered after it. Not kept across the exporter's restarts: its recent
    # steps are not either, so its diagnosis starts over.
    warm_step: int = -1
    settled_steps: int = 0

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


K = TypeVar("K", bound=Hashable)


class ByLastReport(Generic[K]):
    """Keys in the order of their last report's time, oldest first.

    Who is silent for longer than some limit is then a prefix, popped without scanning every
    rank on every ingest. Reports come in time order; if the wall clock steps back, the keys are
    sorted again, so the prefix stays exactly the keys older than the limit.
    """

    __slots__ = ("_at",)

    def __init__(self) -> None:
        self._at: OrderedDict[K, float] = OrderedDict()

    def touch(self, key: K, at: float) -> None:
        order = self._at
        order.pop(key, None)
        back = bool(order) and order[next(reversed(order))] > at
        order[key] = at
        if back:
            self._at = OrderedDict(sorted(order.items(), key=lambda item: item[1]))

    def pop_silent(self, now: float, limit: float) -> list[K]:
        """Remove and return the keys whose last report is more than `limit` before `now`."""
        order, out = self._at, []
        while order:
            key, at = next(iter(order.items()))
            if not now - at > limit:  # the readers' own test of staleness, rounding alike
                break
            order.popitem(last=False)
            out.append(key)
        return out

    def discard(self, key: K) -> None:
        self._at.pop(key, None)

    def __contains__(self, key: object) -> bool:
        return key in self._at

    def __len__(self) -> int:
        return len(self._at)


# How a snapshot diagnoses one job: its ranks here, Prometheus's job-wide view (None: node-local),
# the node's transfer and work per step against their baselines (exporter.pooling), and the
# job's last diagnosis (None: its first), which carries how long each mode has held.
# exporter.diagnosis.snapshot passes its rules under the store's settings; the store, below
# the diagnosis, does not import them.
Diagnose = Callable[
    [Sequence[RankView], JobWide | None, NodeInflation | None, Diagnosis | None], Diagnosis
]


class Store:
    """Thread-safe: ingest runs in the server's threads, scrapes in others.

    What an ingest costs is proportional to the records it brings and the steps they complete,
    not to the ranks there are: expiry and staleness pop the ranks silent too long
    from orders by last report (`ByLastReport`), and each job's pool keeps its reporting ranks.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.lock = threading.Lock()
        self.ranks: dict[tuple[str, int], RankState] = {}
        self.job_ranks: dict[str, dict[int, RankState]] = {}  # the same states, by job
        self.pools: dict[str, JobPool] = {}
        self._by_report: ByLastReport[tuple[str, int]] = ByLastReport()  # expiry
        # Per job, its live ranks (reported within stale_after_s), the ones its pool waits for.
        self._live: dict[str, ByLastReport[int]] = {}
        # job -> the job-wide view read back from Prometheus, if the exporter was given one.
        # (job, as_of=unix s) -> Prometheus's job-wide view as of then (exporter.jobwide)
        self.job_wide: Callable[..., JobWide | None] | None = None
        # Reads the host's CPU package energy with each snapshot (exporter.energy), if set.
        self.cpu_energy: Callable[[], CpuEnergy] | None = None
        self.started_unix_s = time.time()
        self.ingested_records = 0
        self.rejected: dict[str, int] = {}
        # The diagnosis runs on new data, not per scrape: per job, the batch count at its last
        # accepted batch, and its last diagnosis with what it was made from (Store.view).
        self._batches = 0
        self._changed: dict[str, int] = {}
        self._diagnosed: dict[str, tuple[tuple[Any, ...], JobWide | None, Diagnosis]] = {}

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
                if job not in self.pools and len(self.pools) >= self.settings.max_jobs:
                    self.rejected["too_many_jobs"] = self.rejected.get("too_many_jobs", 0) + 1
                    return {"accepted": False, "reason": "too many jobs"}
                state = self.ranks[key] = RankState(job=job, rank=a.rank)
                self.job_ranks.setdefault(job, {})[a.rank] = state
            pool = self.pools.get(job)
            if pool is None:
                pool = self.pools[job] = self._new_pool()
            if state.incarnation != clean_label(a.incarnation):
                new_incarnation(state, pool, self.settings)
            state.local_rank, state.world_size = a.local_rank, a.world_size
            state.hostname, state.pid = clean_label(a.hostname), a.pid
            state.incarnation = clean_label(a.incarnation)
            # The incarnation's attach; agents that do not say: its first report here.
            state.started_unix_s = a.started_unix_s or state.started_unix_s or now
            state.phase_every = a.phase_every
            # Agents before goodput do not say when their process started: their attach, else
            # the first time this exporter heard of them.
            started = a.process_started_unix_s or a.started_unix_s or now
            if not 0 < state.process_started_unix_s <= started:
                state.process_started_unix_s = started
            state.last_report_unix_s = now
            self._batches += 1
            self._changed[job] = self._batches
            self._by_report.touch(key, now)
            live = self._live.get(job)
            if live is None:
                live = self._live[job] = ByLastReport()
            live.touch(a.rank, now)
            pool.join(a.rank)
            state.dropped_current = max(state.dropped_current, batch.dropped_total)
            if batch.pacing is not None:
                state.pacing = batch.pacing
            if batch.topology is not None:
                state.topology = {
                    clean_label(k): clean_label(v, MAX_TOPOLOGY_TEXT) if isinstance(v, str) else v
                    for k, v in list(batch.topology.items())[:MAX_TOPOLOGY_ENTRIES]
                }
            fold_collectives(state, pool, ingest.collectives, self.settings, self.rejected)
            fold_events(state, ingest.events)  # before the steps: a step's checkpoints first
            fold_steps(state, pool, ingest.steps, self.settings)
            if ingest.steps and not state.steps_since_unix_s:
                state.steps_since_unix_s = now
            self._pool(job, pool, now)
            _mark(state, pool.pooled_steps_total)
            self.ingested_records += (
                len(ingest.steps) + len(ingest.collectives) + len(ingest.events)
            )
            transfers = pool.transfers()
            node_per_step = pool.transfer_per_step()
        job_wide = self.job_wide(job, as_of=now) if self.job_wide is not None else None
        if job_wide is not None and job_wide.transfer_s is not None and node_per_step:
            transfers = with_job_transfer(transfers, node_per_step, job_wide.transfer_s)
        return {"accepted": True, "baselines": {key_text(k): v for k, v in transfers.items()}}

    def _new_pool(self) -> JobPool:
        """A job's pool, its contention baseline over the rules' windows (with --set)."""
        t = self.settings.thresholds
        return JobPool(
            baseline_window_s=t.contention_baseline_s,
            recent_window_s=t.contention_recent_s,
            contention_line=t.contention_inflation,
        )

    def _pool(self, job: str, pool: JobPool, now: float) -> None:
        """Pool the steps every live rank of the job has delivered into the ranks' recent steps.

        Live: reported within stale_after_s. Those that went silent since stop being waited for
        until they report again (even should the wall clock step back meanwhile).
        """
        ranks = self.job_ranks.get(job, {})
        live = self._live.get(job)
        if live is not None:
            for rank in live.pop_silent(now, self.settings.stale_after_s):
                pool.leave(rank)
        for done in pool.completed():
            state = ranks.get(done.rank)
            if state is not None:
                warm = True if done.step <= state.warm_step else None
                state.recent.append(
                    RecentStep(done.step, done.step_s, done.phases, done.wait_s, warm)
                )

    def _expire(self, now: float) -> None:
        for key in self._by_report.pop_silent(now, self.settings.expire_after_s):
            state = self.ranks.pop(key)
            job_ranks = self.job_ranks.get(state.job, {})
            job_ranks.pop(state.rank, None)
            live = self._live.get(state.job)
            if live is not None:
                live.discard(state.rank)
            pool = self.pools.get(state.job)
            if pool is not None:
                pool.leave(state.rank)
                pool.forget(state.rank)
            if not job_ranks:
                self.job_ranks.pop(state.job, None)
                self.pools.pop(state.job, None)
                self._live.pop(state.job, None)

    def adopt(self, states: Iterable[RankState], pooled: Mapping[str, tuple[int, float]]) -> int:
        """Take in ranks' totals from an earlier run of the exporter (exporter/state_file.py),
        each as silent since now: they expire after expire_after_s unless they report again,
        and a rank that reports with the same incarnation carries on counting from them.
        `pooled`: per job, (pooled steps, transfer seconds). Ranks already known, and those
        beyond the rank and job limits, are left out. Returns the ranks taken in."""
        now = time.time()
        taken = 0
        with self.lock:
            for state in states:
                key = (state.job, state.rank)
                if key in self.ranks or len(self.ranks) >= self.settings.max_ranks:
                    continue
                if state.job not in self.pools:
                    if len(self.pools) >= self.settings.max_jobs:
                        continue
                    pool = self.pools[state.job] = self._new_pool()
                    steps, seconds = pooled.get(state.job, (0, 0.0))
                    pool.pooled_steps_total, pool.transfer_seconds_total = steps, seconds
                self.ranks[key] = state
                self.job_ranks.setdefault(state.job, {})[state.rank] = state
                self._by_report.touch(key, now)
                taken += 1
        return taken

    def interest(self) -> dict[str, Interest]:
        """What the job-wide read-back needs for each job held here: its ranks' nodes, the
        members of every small group they collect in and the (label, lowest rank) of every
        larger one (their topology's GROUP_FACT and GROUP_FIRST_FACT entries)."""
        with self.lock:
            held = [(s.job, s.hostname, s.topology) for s in self.ranks.values()]
        nodes: dict[str, set[str]] = {}
        groups: dict[str, set[tuple[int, ...]]] = {}
        large: dict[str, set[tuple[str, int]]] = {}
        for job, hostname, topology in held:
            nodes.setdefault(job, set()).add(hostname)
            small, big = groups.setdefault(job, set()), large.setdefault(job, set())
            for key in topology or {}:
                label = key.removeprefix(GROUP_FACT).removeprefix(GROUP_FIRST_FACT)
                if label == key:
                    continue
                members = group_ranks(topology, label)
                first = group_first(topology, label)
                if members and len(members) <= SMALL_GROUP:
                    small.add(members)
                elif first is not None:
                    big.add((label, first))
        return {
            job: Interest(frozenset(nodes[job]), frozenset(groups[job]), frozenset(large[job]))
            for job in nodes
        }

    # -- read side (callers hold no lock; this takes it) ------------------------------------------
    def view(self, diagnose: Diagnose, recent: int | None = None) -> StoreView:
        """A consistent snapshot of everything the collectors, state endpoint and page show,
        each job diagnosed by `diagnose` (readers take it through exporter.diagnosis.snapshot).

        `recent` bounds each rank's `recent_steps` (None: all kept); the diagnosis sees at least
        the last STEP_WINDOW whatever the caller keeps. Scrapes ask for STEP_WINDOW only, so the
        diagnosis aligns that many steps per rank rather than every step kept.
        """
        now = time.time()
        # The steps each rank view carries into the diagnosis: its window, or more if asked.
        shown = None if recent is None else max(recent, STEP_WINDOW)
        by_job: dict[str, list[RankView]] = {}
        with self.lock:
            self._expire(now)
            pooled: dict[str, tuple[int, float, tuple[Sample, ...]]] = {
                job: (
                    pool.pooled_steps_total,
                    pool.transfer_seconds_total,
                    tuple(v for _, v in sorted(pool.samples.items())),
                )
                for job, pool in self.pools.items()
            }
            inflation = {job: pool.inflation() for job, pool in self.pools.items()}
            for state in sorted(self.ranks.values(), key=lambda s: (s.job, s.rank)):
                by_job.setdefault(state.job, []).append(
                    _rank_view(state, now, self.settings.stale_after_s, shown)
                )
            started, ingested, rejected = (
                self.started_unix_s,
                self.ingested_records,
                dict(self.rejected),
            )
            changed = dict(self._changed)
        # Views are immutable, so the diagnosis runs outside the lock and never holds up ingest.
        jobs = {}
        for gone in set(self._diagnosed) - set(by_job):
            self._diagnosed.pop(gone, None)
        for name, ranks in by_job.items():
            # As of the job's last report here: once it has ended, the rules' windows drift.
            last = max(r.last_report_unix_s for r in ranks)
            job_wide = self.job_wide(name, as_of=last) if self.job_wide is not None else None
            if job_wide is not None and job_wide.leads:
                ranks = [
                    dataclasses.replace(r, arrival_lead_s=job_wide.leads[r.rank], lead_scope="job")
                    if r.rank in job_wide.leads
                    else r
                    for r in ranks
                ]
            diagnosis = self._diagnosis(
                name, diagnose, ranks, job_wide, inflation.get(name), (changed.get(name), shown)
            )
            if recent is not None and recent != shown:
                ranks = [
                    dataclasses.replace(r, recent_steps=r.recent_steps[-recent:] if recent else ())
                    for r in ranks
                ]
            jobs[name] = JobView(
                tuple(ranks),
                diagnosis,
                name,
                *pooled.get(name, (0, 0.0, ())),
                job_wide=job_wide,
                goodput=goodput(ranks, now),
            )
        cpu_energy = None
        if self.cpu_energy is not None:
            try:
                cpu_energy = self.cpu_energy()
            except Exception:  # noqa: BLE001 - energy is never worth a failed snapshot
                cpu_energy = None
        return StoreView(
            started, now, ingested, rejected, jobs, cpu_energy, self.settings.price_per_gpu_hour
        )

    def _diagnosis(
        self,
        job: str,
        diagnose: Diagnose,
        ranks: list[RankView],
        job_wide: JobWide | None,
        node: NodeInflation | None,
        data: tuple[Any, ...],
    ) -> Diagnosis:
        """The job's diagnosis: the last one while nothing it is made from has changed (no batch
        of the job since, the same ranks live, the same job-wide reading and node inflation),
        else a new one. `data`: the job's batch count at its last batch, and the steps shown."""
        key = (data, tuple((r.rank, r.stale) for r in ranks), node, diagnose)
        last = self._diagnosed.get(job)
        if last is not None and last[1] is job_wide and last[0] == key:
            return last[2]
        diagnosis = diagnose(ranks, job_wide, node, last[2] if last is not None else None)
        self._diagnosed[job] = (key, job_wide, diagnosis)
        return diagnosis


# What one batch does to one rank's state (Store.ingest, under its lock).


def new_incarnation(state: RankState, pool: JobPool, settings: Settings) -> None:
    """A restarted rank: keep the counters (they only grow), reset what describes "now"."""
    if state.incarnation:
        state.incarnations += 1
        state.dropped_before += state.dropped_current
        if state.pacing:
            state.pacing_delay_before += state.pacing.total_delay_s
            state.pacing_engagements_before += state.pacing.engagements
    if state.max_step >= 0:  # what the steps of a restart that go back are measured by
        state.high_step = max(state.high_step, state.max_step)
        state.previous_max_step = state.max_step
        state.previous_step_s = (
            state.later_steps_s / state.later_steps if state.later_steps else state.first_step_s
        )
    state.first_step = state.max_step = state.warm_step = -1
    state.started_unix_s = 0.0  # the new incarnation's attach, set as it reports
    state.steps_since_unix_s = 0.0  # and its first step's arrival
    state.settled_steps = 0
    state.first_step_s = state.later_steps_s = 0.0
    state.later_steps = 0
    state.checkpoint_pending = {}  # steps the old incarnation never finished
    state.dropped_current = 0
    state.pacing = None
    state.window = deque(maxlen=settings.step_window)
    state.work = deque(maxlen=settings.step_window)
    state.recent = deque(maxlen=settings.recent_steps)
    state.marks.clear()
    state.throughput.restart()
    pool.forget(state.rank)


def fold_collectives(
    state: RankState,
    pool: JobPool,
    rows: list[CollectiveSeconds],
    settings: Settings,
    rejected: dict[str, int],
) -> None:
    """A batch's collective records into the rank's totals and its job's pool (a series
    beyond max_series_per_rank is refused and counted in `rejected`)."""
    for op, group, nbytes, duration, step in rows:
        op = op if op in OPS else "other"
        group = clean_label(group)
        totals = state.collectives.get((op, group))
        if totals is None:
            if len(state.collectives) >= settings.max_series_per_rank:
                rejected["too_many_series"] = rejected.get("too_many_series", 0) + 1
                continue
            totals = state.collectives[(op, group)] = CollectiveTotals()
        totals.calls += 1
        totals.seconds += duration
        totals.bytes += nbytes
        if op in P2P_OPS and state.stage is None:
            state.stage = pipeline_stage(state.rank, group, state.topology)
            if state.stage is not None:
                pool.set_stage(state.rank, state.stage)
        # Its wait is added when the step is pooled with the other ranks' (exporter.pooling).
        pool.add_collective(state.rank, collective_key(op, group, nbytes), step, duration, totals)


def fold_events(state: RankState, rows: list[EventSeconds]) -> None:
    """Startup and checkpoint time: badput by category; a checkpoint inside a step also
    waits for that step's row, to be taken out of its productive time. A checkpoint load
    or a compile: the rank's steps up to its step are warm-up."""
    badput, pending = state.badput_s, state.checkpoint_pending
    for kind, step, _end_unix_s, duration in rows:
        if step >= 0 and kind in (EVENT_CHECKPOINT_LOAD, EVENT_COMPILE):
            warm_up(state, step)  # the steps after a load or a compile settle anew
        if kind not in badput or kind == LOST_PROGRESS:
            continue  # not badput (a compile), or a kind this exporter does not know
        badput[kind] += duration
        if step >= 0 and kind != EVENT_STARTUP:
            pending[step] = pending.get(step, 0.0) + duration
            if len(pending) > MAX_PENDING_CHECKPOINTS:  # rows that never came
                del pending[min(pending)]


def fold_steps(
    state: RankState, pool: JobPool, rows: list[StepSeconds], settings: Settings
) -> None:
    """A batch's step rows into the rank's totals, windows, goodput and its job's pool."""
    if not state.window.maxlen:
        state.window = deque(state.window, maxlen=settings.step_window)
        state.work = deque(state.work, maxlen=settings.step_window)
        state.recent = deque(state.recent, maxlen=settings.recent_steps)
    t = settings.thresholds
    for step, d, end_unix_s, values, samples, tokens in rows:
        if state.first_step < 0:  # the incarnation's first step: compiling, lazy init
            warm_up(state, step)
        warm = step <= state.warm_step
        if not warm:
            state.settled_steps += 1
        state.steps_total += 1
        state.step_seconds_sum += d
        state.step_bucket_counts[bisect.bisect_left(STEP_BUCKETS, d)] += 1
        if state.steps_total % RATIO_MEDIAN_EVERY == 0 and len(state.window) >= 8:
            state.median_s = statistics.median(state.window)  # amortised: 1 in 16 steps
        if state.median_s > 0:
            ratio = d / state.median_s
            state.ratio_bucket_counts[bisect.bisect_left(RATIO_BUCKETS, ratio)] += 1
            state.ratio_sum += ratio
        for i, v in enumerate(values):
            state.phase_seconds[i] += v
        life(state, step, d, values)
        if not warm:  # a compile's step would lift the CV for a whole window
            state.window.append(d)
        if samples >= 0 or tokens >= 0:  # work a step did not report is not zero work
            if samples >= 0:
                state.samples_total = (state.samples_total or 0) + samples
            if tokens >= 0:
                state.tokens_total = (state.tokens_total or 0) + tokens
            state.work.append((d, samples, tokens))
        state.throughput.add(d, samples, end_unix_s, t.throughput_horizon_s, t.throughput_block_s)
        pool.add_step(state.rank, step, d, values)


def warm_up(state: RankState, step: int) -> None:
    """Mark `step` and those before it in this incarnation as warm-up (its first step, in
    which a torch.compile, lazy init and the data loader's start fall; a step a checkpoint
    load fell in): the rank's settled steps count again from the next one."""
    if step >= state.warm_step:
        state.warm_step = step
        state.settled_steps = 0


def life(state: RankState, step: int, d: float, phases: tuple[float, ...]) -> None:
    """One step row in the rank's life: productive time, and at an incarnation's first
    step the steps it runs again (step numbers that continue across restarts go back to
    the checkpoint it resumed from: lost progress). A lost step costs its productive time:
    its data wait, exposed communication and pacing are already badput of their own, and
    counted again they would take goodput below zero on a data-bound job."""
    checkpoint = state.checkpoint_pending.pop(step, 0.0)
    waiting = phases[Phase.DATA] + blocked_s(phases)
    own = max(0.0, d - waiting - checkpoint)
    before = state.productive_s
    state.productive_s = before + own
    marks = state.resume_marks
    if state.first_step < 0:
        state.first_step, state.first_step_s = step, own
        if 0 <= step <= state.high_step:
            lost = state.high_step - step + 1
            state.lost_steps += lost
            state.badput_s[LOST_PROGRESS] += _lost_seconds(state, step, before)
        marks.clear()  # the earlier incarnation's: a later restart goes back into this one
        marks[step] = before
    else:
        state.later_steps += 1
        state.later_steps_s += own
    if checkpoint:  # a restart resumes at this step or the next
        marks[step], marks[step + 1] = before, before + own
        while len(marks) > RESUME_MARKS:
            del marks[min(marks)]
    if step > state.max_step:
        state.max_step = step


def with_job_transfer(
    transfers: dict[Any, float], node_per_step_s: float, job_transfer_s: float
) -> dict[Any, float]:
    """The node's per-kind transfers, corrected by the job's transfer per step.

    The node's transfer per step (`node_per_step_s`, JobPool.transfer_per_step: the quantity
    Prometheus takes the job's minimum of) exceeds the job's by what every rank here waits for
    ranks elsewhere; that wait happens at the step's first synchronising collective, the kind
    that takes longest, so its baseline comes down by the difference and agents on every node
    see their lead over the job's last rank (pacing paces the early ranks, never the straggler).

    Per step, not the sum of the kinds' means: a kind that skips steps counts there only as
    often as it runs. A sum lets a broadcast seen once at start, or a stop flag's every tenth
    step, outweigh the job's transfer and take the sync's baseline to zero, which an agent reads
    as "no baseline yet": the early node's ranks would never pace (docs/pacing.md, "Across
    nodes").
    Should the correction still reach zero, the kind keeps its share of the job's transfer
    (every kind scaled by job ÷ node).
    """
    gap = node_per_step_s - job_transfer_s
    if gap <= 0 or not transfers:
        return transfers
    sync = max(transfers, key=lambda k: transfers[k])
    corrected = transfers[sync] - gap
    if corrected <= 0:
        corrected = transfers[sync] * job_transfer_s / node_per_step_s
    return {**transfers, sync: corrected}


# Steps the node view's arrival lead averages the pooled waits over.
LEAD_STEPS = 64
# Steps whose in-step checkpoint time a rank keeps until their row comes.
MAX_PENDING_CHECKPOINTS = 64
RESUME_MARKS = 16  # RankState.resume_marks kept: the steps of the latest 8 checkpoints


def _lost_seconds(state: RankState, step: int, before: float) -> float:
    """The productive seconds of the steps from `step` to the highest any earlier incarnation
    reported, which a restart at `step` runs again, given the productive seconds `before` it:
    as the latest incarnation with steps took them where it marked `step` (resume_marks), the
    rest at that incarnation's mean productive step (a job's steps speed up and slow down over
    an incarnation: its mean is not what the last steps before a kill took)."""
    start = state.resume_marks.get(step)
    if start is None or state.previous_max_step < step:
        return (state.high_step - step + 1) * state.previous_step_s
    rest = state.high_step - state.previous_max_step
    return max(0.0, before - start) + rest * state.previous_step_s


def _per_step(c: Mapping[str, Any], steps: int) -> Mapping[str, Any]:
    """A recorded collective, with its figures per step over all steps where it has none
    (recorded before the window was kept)."""
    if "wait_per_step" in c or steps <= 0:
        return {"seconds_per_step": 0.0, "wait_per_step": 0.0, **c}
    return {
        **c,
        "seconds_per_step": c["seconds"] / steps,
        "wait_per_step": c["wait_seconds"] / steps,
    }


def _mark(state: RankState, pooled: int) -> None:
    """Note the rank's collective totals after a report; keep marks back to the window's start."""
    marks = state.marks
    totals = {k: (t.seconds, t.wait_seconds) for k, t in state.collectives.items()}
    if marks and marks[-1][0] == state.steps_total:  # no step since: at most one per step
        marks.pop()
    marks.append((state.steps_total, pooled, totals))
    start = state.steps_total - STEP_WINDOW
    while len(marks) > 1 and marks[1][0] <= start:
        marks.popleft()


def _collective_views(s: RankState) -> tuple[CollectiveView, ...]:
    """Its collectives' totals, and per step between its oldest and newest marks (over all its
    steps before it has two): a wait is added when its step is pooled, so waits count per
    pooled step between the marks, seconds per step delivered."""
    if len(s.marks) > 1:
        (first, pooled_first, base), (last, pooled_last, now) = s.marks[0], s.marks[-1]
        steps, pooled = last - first, pooled_last - pooled_first
    else:  # over all its steps
        steps = pooled = s.steps_total
        base, now = {}, {k: (t.seconds, t.wait_seconds) for k, t in s.collectives.items()}
    out = []
    for key, t in sorted(s.collectives.items()):
        seconds, wait = base.get(key, (0.0, 0.0))
        seconds_now, wait_now = now.get(key, (seconds, wait))
        out.append(
            CollectiveView(
                *key,
                t.calls,
                t.seconds,
                t.bytes,
                t.wait_seconds,
                (seconds_now - seconds) / steps if steps > 0 else 0.0,
                (wait_now - wait) / pooled if pooled > 0 else 0.0,
            )
        )
    return tuple(out)


def _rank_view(s: RankState, now: float, stale_after: float, keep: int | None) -> RankView:
    recent = tuple(s.recent)
    # The rolling figures leave warm-up steps out (a compile's step is no baseline).
    last = [r for r in recent[-STEP_WINDOW:] if not r.warm_up]
    lead_steps = last[-LEAD_STEPS:]
    lead = sum(r.wait_s for r in lead_steps) / len(lead_steps) if lead_steps else None
    durations = [r.step_s for r in last]
    total = sum(durations)
    shares: tuple[float, ...] = ()
    if total > 0:
        shares = tuple(
            sum(column) / total for column in zip(*(r.phases for r in last), strict=True)
        )
    if keep is not None:
        recent = recent[-keep:] if keep > 0 else ()
    pacing = s.pacing
    if pacing is not None:
        pacing = dataclasses.replace(
            pacing,
            total_delay_s=pacing.total_delay_s + s.pacing_delay_before,
            engagements=pacing.engagements + s.pacing_engagements_before,
        )
    return RankView(
        rank=s.rank,
        local_rank=s.local_rank,
        world_size=s.world_size,
        hostname=s.hostname,
        pid=s.pid,
        incarnation=s.incarnation,
        started_unix_s=s.started_unix_s,
        steps_since_unix_s=s.steps_since_unix_s or None,
        restarts=s.incarnations,
        last_report_unix_s=s.last_report_unix_s,
        stale=now - s.last_report_unix_s > stale_after,
        steps_total=s.steps_total,
        step_seconds_sum=s.step_seconds_sum,
        step_bucket_counts=tuple(s.step_bucket_counts),
        phase_seconds_total=tuple(s.phase_seconds),
        step_time_mean_s=(total / len(durations)) if durations else None,
        step_time_median_s=statistics.median(durations) if durations else None,
        step_time_cv=s.cv(),
        phase_shares=shares,
        arrival_lead_s=lead,
        node_lead_s=lead,
        wait_mean_s=(sum(r.wait_s for r in last) / len(durations)) if durations else None,
        collectives=_collective_views(s),
        dropped_total=s.dropped_total,
        pacing=pacing,
        topology=s.topology,
        recent_steps=recent,
        step_ratio_bucket_counts=tuple(s.ratio_bucket_counts),
        step_ratio_sum=s.ratio_sum,
        samples_total=s.samples_total,
        tokens_total=s.tokens_total,
        samples_per_s=_per_second(s.work, 1),
        tokens_per_s=_per_second(s.work, 2),
        process_started_unix_s=s.process_started_unix_s or None,
        productive_s=s.productive_s,
        badput_s=dict(s.badput_s),
        lost_steps=s.lost_steps,
        throughput=s.throughput.view(),
        pipeline_stage=s.stage,
        phase_every=s.phase_every,
        settled_steps=s.settled_steps,
    )


def _per_second(work: Iterable[tuple[float, int, int]], at: int) -> float | None:
    """Samples (at=1) or tokens (at=2) per second of the steps that reported them."""
    count, seconds = 0.0, 0.0
    for row in work:
        if row[at] >= 0:
            count += row[at]
            seconds += row[0]
    return count / seconds if seconds > 0 else None
