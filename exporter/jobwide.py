"""The job-wide view read back from Prometheus, for an exporter that sees only its node's ranks.

Each exporter sees the ranks of its own node; Prometheus, scraping every node, computes the
job-wide figures (the recording rules of syncscope.monitoring.rules): every rank's lead, the
straggler and its lag, the job's transfer per step, its inflation, the amplification, the
mean step and the slowest link. Given `--prometheus-url`, the exporter reads back, every
`--prometheus-interval` seconds on a thread of its own, what its diagnosis, page, /v1/state
and the baselines it hands to agents need, and no more: the jobs it holds, the leads of its own
node's ranks, the job-level series (the straggler and the slowest link among them), and the
least blocked member of each group its ranks wait in (the wait chain's next hop). What reduces
over a job's ranks or nodes is recorded by the rules once an evaluation, so a cycle's queries,
replies and engine work grow with the node's ranks, groups and jobs, not the job's size; the
exporters' reads are spread over the interval. No gossip between exporters and no aggregator
of our own: Prometheus already is the job-wide engine.

A reading older than three intervals is dropped: the exporter then says its view is node-local
rather than show stale job-wide figures as current. Once a job's ranks here stop reporting (the
job ended, or hangs), the rules' windows run past its last steps and their values drift (one
rank's last batch leaves a window before another's); the exporter keeps the reading it had at
the job's last report instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from syncscope.exporter.findings import NOT_IN_JSON

from syncscope import recorded
from syncscope.prometheus_api import PrometheusAPI, PrometheusError

log = logging.getLogger("syncscope.exporter")
# How long an ended job's last reading is kept (the exporter expires the job itself sooner).
HOLD_S = 24 * 3600.0


@dataclass(frozen=True)
class JobWide:
    """What Prometheus computes over every node of one job, as far as this node needs it."""

    # rank -> s per step (the lead rule), for this node's ranks, the straggler and each of
    # their groups' least blocked members: not every rank of the job
    leads: Mapping[int, float] = field(default_factory=dict)
    transfer_s: float | None = None  # the job's transfer per step
    amplification: float | None = None  # idle share of rank-time at collectives
    read_unix_s: float = 0.0
    transfer_inflation: float | None = None  # transfer per step ÷ its own baseline
    # The job's node whose link carries least against the job's median node's, and that ratio.
    slowest_link: tuple[str, float] | None = None
    # rank -> pipeline stage, for a pipeline's ranks among `leads`: the lead rule's `stage`
    # label (a lead is over the least blocked rank of the rank's stage there)
    stages: Mapping[int, int] = field(default_factory=dict)
    # rank -> its blocked time per step beyond the job's least blocked rank, whatever its stage
    # (a pipeline's lead plus its stage's least blocked time over the job's): how long it
    # waits, for the wait chain. None: the leads are that (a job that is no pipeline).
    waits: Mapping[int, float] | None = None
    # The job's mean step over the rules' rate window (recorded.STEP_MEAN): what the leads, a
    # mean per step over a window, are a share of. The step a rank reports now is not: as a
    # job's steps lengthen or shorten, the leads still hold the window's steps.
    step_mean_s: float | None = None
    # The rank the others wait for and how much later than the earliest rank of its stage it
    # arrives, the job's arrival skew (recorded.STRAGGLER_LAG); None: no rank has a lead yet.
    straggler: tuple[int, float] | None = None
    # group label -> {its lowest rank: its least blocked member} (recorded.GROUP_NEXT_HOP), for
    # the groups of the ranks here too large to read whole; their leads are among `leads`
    hops: Mapping[str, Mapping[int, int]] = field(default_factory=dict)
    # The job's readings before this one, oldest first, over the reader's history (each with
    # no history of its own): how long a rank has been the straggler, for the hold. The
    # diagnosis's input, not part of the view: /v1/state leaves it out.
    earlier: tuple[JobWide, ...] = field(default=(), metadata=NOT_IN_JSON)

    def job_waits(self) -> Mapping[int, float]:
        """Each rank's blocked time per step beyond the job's least blocked rank."""
        return self.leads if self.waits is None else self.waits


def parse(replies: Mapping[str, list[dict[str, Any]]], now: float) -> dict[str, JobWide]:
    """Instant-query results of the rules, by recorded name -> one JobWide per job."""
    leads: dict[str, dict[int, float]] = {}
    stages: dict[str, dict[int, int]] = {}
    # job -> stage (None: ranks with none) -> its least blocked rank's time per step
    stage_least: dict[str, dict[int | None, float]] = {}
    transfer: dict[str, float] = {}
    amplification: dict[str, float] = {}
    inflation: dict[str, float] = {}
    step_mean: dict[str, float] = {}
    links: dict[str, tuple[str, float]] = {}
    stragglers: dict[str, tuple[int, float]] = {}
    hops: dict[str, dict[str, dict[int, int]]] = {}
    for name in (recorded.LEAD, recorded.GROUP_NEXT_HOP, recorded.STRAGGLER_LAG):
        for sample in replies.get(name, []):
            job, rank = sample["metric"].get("job"), sample["metric"].get("rank")
            value = _number(sample)
            if not job or rank is None or not rank.isdigit() or value is None:
                continue
            stage = sample["metric"].get("stage", "")
            if stage.isdigit():
                stages.setdefault(job, {})[int(rank)] = int(stage)
            if name == recorded.GROUP_NEXT_HOP:
                group, first = sample["metric"].get("group"), sample["metric"].get("group_first")
                if not group or first is None or not first.isdigit():
                    continue
                hops.setdefault(job, {}).setdefault(group, {})[int(first)] = int(rank)
            if name != recorded.STRAGGLER_LAG:
                leads.setdefault(job, {})[int(rank)] = value
                continue
            # The straggler's lead is 0 by construction; of ties, the lowest rank.
            leads.setdefault(job, {})[int(rank)] = 0.0
            if job not in stragglers or int(rank) < stragglers[job][0]:
                stragglers[job] = (int(rank), value)
    for sample in replies.get(recorded.SYNC_PER_STEP_STAGE_MIN, []):
        job, stage, value = (
            sample["metric"].get("job"),
            sample["metric"].get("stage", ""),
            _number(sample),
        )
        if job and (stage == "" or stage.isdigit()) and value is not None:
            stage_least.setdefault(job, {})[int(stage) if stage else None] = value
    for sample in replies.get(recorded.SLOWEST_LINK, []):
        job, node, value = (
            sample["metric"].get("job"),
            sample["metric"].get("node"),
            _number(sample),
        )
        if job and node and value is not None and (job not in links or value < links[job][1]):
            links[job] = (node, value)
    for name, into in (
        (recorded.TRANSFER_PER_STEP, transfer),
        (recorded.SYNC_AMPLIFICATION, amplification),
        (recorded.TRANSFER_INFLATION, inflation),
        (recorded.STEP_MEAN, step_mean),
    ):
        for sample in replies.get(name, []):
            job, value = sample["metric"].get("job"), _number(sample)
            if job and value is not None:
                into[job] = value
    return {
        job: JobWide(
            leads.get(job, {}),
            transfer.get(job),
            amplification.get(job),
            now,
            inflation.get(job),
            links.get(job),
            stages.get(job, {}),
            _waits(leads.get(job, {}), stages.get(job, {}), stage_least.get(job)),
            step_mean.get(job),
            stragglers.get(job),
            hops.get(job, {}),
        )
        for job in set(leads) | set(transfer) | set(amplification)
    }


def _waits(
    leads: Mapping[int, float],
    stages: Mapping[int, int],
    stage_least: Mapping[int | None, float] | None,
) -> dict[int, float] | None:
    """A pipeline's ranks' blocked time beyond the job's least blocked rank: each one's lead
    over its stage plus its stage's least blocked time over the job's (the least of the
    stages'). None where the job is no pipeline (its leads are that already) or the stages'
    least blocked times are not known."""
    if not stages or not stage_least:
        return None
    least = min(stage_least.values())
    return {
        rank: lead + stage_least.get(stages.get(rank), least) - least
        for rank, lead in leads.items()
    }


def _number(sample: dict[str, Any]) -> float | None:
    try:
        value = float(sample["value"][1])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return value if value == value and abs(value) != float("inf") else None


@dataclass(frozen=True)
class Interest:
    """What the exporter needs read back for one job it holds: the nodes its ranks here run on
    (the `node` label of their series), the members of each group of at most SMALL_GROUP ranks
    they collect in, and each larger group's (label, lowest rank): larger, or not listed."""

    nodes: frozenset[str]
    groups: frozenset[tuple[int, ...]] = frozenset()
    large: frozenset[tuple[str, int]] = frozenset()


# Series of one job each (or one per pipeline stage): read for the jobs held, in one query.
JOB_LEVEL = (
    recorded.STRAGGLER_LAG,
    recorded.SLOWEST_LINK,
    recorded.TRANSFER_PER_STEP,
    recorded.SYNC_AMPLIFICATION,
    recorded.TRANSFER_INFLATION,
    recorded.SYNC_PER_STEP_STAGE_MIN,
    recorded.STEP_MEAN,
)


def _any_of(values: Iterable[str]) -> str:
    """A PromQL string literal: a regex matching exactly these values."""
    return json.dumps("|".join(re.escape(v) for v in sorted(values)))


def cycle_queries(wanted: Mapping[str, Interest]) -> dict[str, str]:
    """The read-back's first queries, by what they return (the recorded name where one), for
    the jobs `wanted`: its node's ranks' leads, and the jobs' own series (the slowest link
    among them)."""
    jobs = _any_of(wanted)
    nodes = _any_of({node for interest in wanted.values() for node in interest.nodes})
    return {
        recorded.LEAD: f"{recorded.LEAD}{{job=~{jobs}, node=~{nodes}}}",
        "job": f"{{__name__=~{_any_of(JOB_LEVEL)}, job=~{jobs}}}",
    }


# Groups of up to this many ranks are read whole for the next hop; for larger ones the rules
# record the least blocked member (recorded.GROUP_NEXT_HOP).
SMALL_GROUP = 16


def hop_query(wanted: Mapping[str, Interest], known: Mapping[str, JobWide]) -> str | None:
    """The wait chain's next hops: every member of each small group of the ranks here whose
    members' leads are not known already (members elsewhere) and that does not hold the
    straggler (whom its members wait for), and each large group's least blocked member; None
    where there is no such group. The query and its reply grow with the node's groups, not
    with their members beyond SMALL_GROUP.

    A small group is read whole: a pipeline's pp group spans stages, whose leads are over
    different minima, so its least blocked member is found after their adjustment
    (JobWide.waits); a large group's members share a stage."""
    terms = []
    for job, interest in sorted(wanted.items()):
        reading = known.get(job)
        if reading is None:
            continue
        root = reading.straggler[0] if reading.straggler is not None else None
        for members in sorted(interest.groups):
            if root in members or all(m in reading.leads for m in members):
                continue
            ranks = json.dumps("|".join(str(m) for m in members))
            terms.append(f"{recorded.LEAD}{{job={json.dumps(job)}, rank=~{ranks}}}")
        firsts: dict[str, list[int]] = {}
        for label, first in interest.large:
            firsts.setdefault(label, []).append(first)
        for label, among in sorted(firsts.items()):
            terms.append(
                f"{recorded.GROUP_NEXT_HOP}{{job={json.dumps(job)}, group={json.dumps(label)}, "
                f"group_first=~{_any_of(str(f) for f in among)}}}"
            )
    return " or ".join(terms) or None


class PrometheusReader:
    """Polls Prometheus for the job-wide rules; `get(job)` is the latest fresh reading or None.

    `wanted` tells what the exporter holds now (job -> Interest); a cycle reads those jobs
    only: two queries, and a third for the next hops where groups reach other nodes."""

    QUERIES = 3  # the most a cycle sends

    def __init__(
        self,
        url: str,
        interval_s: float = 15.0,
        timeout_s: float = 2.0,
        history_s: float = 0.0,
        wanted: Callable[[], Mapping[str, Interest]] = dict,
    ) -> None:
        self.url = url.rstrip("/")
        self.api = PrometheusAPI(self.url, timeout_s)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.max_age_s = 3 * interval_s
        self.wanted = wanted
        self.last_error: str | None = None
        self.reads = 0
        self.failures = 0
        # The last cycle's queries, series and bytes returned (what its load on the engine is).
        self.last_cycle = (0, 0, 0)
        # The last cycle's queries by what they return ("hop": the next hops, where sent).
        self.last_queries: dict[str, str] = {}
        self._jobs: dict[str, JobWide] = {}
        self._held: dict[str, JobWide] = {}  # job -> the newest reading at its latest `as_of`
        # job -> its readings over the last `history_s` (and the one before), oldest first
        self.history_s = history_s
        self._history: dict[str, list[JobWide]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncscope-prometheus", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s * self.QUERIES + 1)

    def get(self, job: str, now: float | None = None, as_of: float | None = None) -> JobWide | None:
        """The job's reading as of `as_of` (default now; the exporter passes the job's last
        report here): the newest one read by then, or None if that one was older than three
        intervals at `as_of`. A call at a later `as_of` moves the held reading on."""
        now = time.time() if now is None else now
        as_of = now if as_of is None else min(as_of, now)
        with self._lock:
            reading = self._jobs.get(job)
            if reading is not None and reading.read_unix_s <= as_of:
                self._held[job] = reading
            else:
                reading = self._held.get(job)
        if reading is None or reading.read_unix_s > as_of:
            return None
        return reading if as_of - reading.read_unix_s <= self.max_age_s else None

    def _run(self) -> None:
        # Each exporter reads at its own offset in the interval: thousands of them started
        # together by one scheduler do not query the engine in the same second.
        self._stop.wait(random.uniform(0.0, self.interval_s))  # noqa: S311 - not for secrets
        while not self._stop.is_set():
            self.read_once()
            self._stop.wait(self.interval_s)

    def read_once(self) -> bool:
        wanted = self.wanted()
        if not wanted:  # no job here: nothing to ask
            return True
        received = self.api.received_bytes
        try:
            replies: dict[str, list[dict[str, Any]]] = {}
            queries = cycle_queries(wanted)
            for key, promql in queries.items():
                for sample in self.api.instant(promql):
                    name = key if key != "job" else sample["metric"].get("__name__", "")
                    replies.setdefault(name, []).append(sample)
            now = time.time()
            jobs = parse(replies, now)
            hops = hop_query(wanted, jobs)
            if hops is not None:
                for sample in self.api.instant(hops):
                    name = sample["metric"].get("__name__", recorded.LEAD)
                    replies.setdefault(name, []).append(sample)
                jobs = parse(replies, now)
        except (
            OSError,
            ValueError,
            KeyError,
            PrometheusError,
        ) as exc:  # unreachable, not Prometheus
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}"[:200]
            log.debug("syncscope: reading %s failed: %s", self.url, self.last_error)
            return False
        self.last_queries = {**queries, "hop": hops} if hops is not None else queries
        self.last_cycle = (
            len(self.last_queries),
            sum(len(samples) for samples in replies.values()),
            self.api.received_bytes - received,
        )
        with self._lock:
            for job, reading in jobs.items():
                kept = self._history.get(job, [])
                # the newest reading older than the history too: it tells what held that long
                old = [i for i, r in enumerate(kept) if now - r.read_unix_s > self.history_s]
                kept = kept[old[-1] :] if old else kept
                jobs[job] = dataclasses.replace(reading, earlier=tuple(kept))
                self._history[job] = [*kept, reading]
            for job in [j for j in self._history if j not in jobs]:
                del self._history[job]
            self._jobs = jobs
            for job in [j for j, r in self._held.items() if now - r.read_unix_s > HOLD_S]:
                del self._held[job]
        self.reads += 1
        self.last_error = None
        return True
