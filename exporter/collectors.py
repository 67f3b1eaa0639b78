"""Scrape-time collectors: read the store's snapshot and yield metric families.

One function per concern, each timed and isolated by the framework at the bottom, the way
node_exporter does: a failing collector yields nothing, sets its success gauge to 0 and never
fails the scrape. Every family's name, help and labels come from its spec in syncscope.catalog.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from syncscope.exporter.diagnosis import snapshot
from syncscope.exporter.energy import collect_cpu_energy
from syncscope.exporter.gpu import collect_gpu, topology_number
from syncscope.exporter.store import RATIO_BUCKETS, STEP_BUCKETS, RankView, Store, StoreView

from syncscope import catalog as M
from syncscope.catalog import STEP_WINDOW, MetricSpec
from syncscope.wire import Phase, group_first


# A family from its catalog spec; the assert catches a spec handed to the wrong kind.
def gauge(spec: MetricSpec) -> GaugeMetricFamily:
    assert spec.type in ("gauge", "info"), spec
    return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)


def counter(spec: MetricSpec) -> CounterMetricFamily:
    assert spec.type == "counter", spec
    return CounterMetricFamily(spec.family, spec.help, labels=spec.labels)


def histogram(spec: MetricSpec) -> HistogramMetricFamily:
    assert spec.type == "histogram", spec
    return HistogramMetricFamily(spec.name, spec.help, labels=spec.labels)


def rank_views(view: StoreView) -> Iterator[tuple[RankView, list[str]]]:
    """Every rank with its values for the catalog's RANK labels."""
    for job, r in view.ranks():
        yield r, r.label_values(job)


def node_views(view: StoreView) -> Iterator[tuple[list[str], list[RankView]]]:
    """Every node of every job (its ranks' hostname) with its values for the catalog's NODE
    labels and its ranks. One exporter usually serves one node; the hostname tells them apart
    where it serves several (the emulated nodes of the tests share one machine's exporters)."""
    for job, data in view.jobs.items():
        by_node: dict[str, list[RankView]] = {}
        for r in data.ranks:
            by_node.setdefault(r.hostname, []).append(r)
        for node, ranks in sorted(by_node.items()):
            yield [job, node], ranks


# The histograms' bucket bounds as exposed: `le` label values, +Inf last.
BUCKET_BOUNDS = (*(repr(b) for b in STEP_BUCKETS), "+Inf")
RATIO_BOUNDS = (*(repr(b) for b in RATIO_BUCKETS), "+Inf")


def cumulative(bounds: tuple[str, ...], counts: Iterable[int]) -> list[tuple[str, float]]:
    """Per-bucket counts (not cumulative) as a histogram's (le, cumulative count) pairs."""
    total, buckets = 0.0, []
    for bound, count in zip(bounds, counts, strict=True):
        total += count
        buckets.append((bound, total))
    return buckets


def collect_steps(view: StoreView) -> Iterable[Metric]:
    """Per rank: steps, phases and what describes the rank alone; per node: the step-time
    histogram over every step of the node's ranks (in synchronous training they share one step
    time, so per-rank buckets would repeat one distribution eight times) and the world size."""
    hist = histogram(M.STEP_DURATION_SECONDS)
    ratio = histogram(M.STEP_DURATION_RATIO)
    world = gauge(M.WORLD_SIZE)
    for labels, ranks in node_views(view):
        counts = [sum(c) for c in zip(*(r.step_bucket_counts for r in ranks), strict=True)]
        hist.add_metric(
            labels, cumulative(BUCKET_BOUNDS, counts), sum(r.step_seconds_sum for r in ranks)
        )
        with_ratios = [r for r in ranks if r.step_ratio_bucket_counts]
        if with_ratios:
            counts = [
                sum(c) for c in zip(*(r.step_ratio_bucket_counts for r in with_ratios), strict=True)
            ]
            ratio.add_metric(
                labels, cumulative(RATIO_BOUNDS, counts), sum(r.step_ratio_sum for r in with_ratios)
            )
        world.add_metric(labels, max(r.world_size for r in ranks))
    steps = counter(M.STEPS_TOTAL)
    phases = counter(M.PHASE_SECONDS_TOTAL)
    sampling = gauge(M.PHASE_SAMPLING_EVERY)
    cv = gauge(M.STEP_TIME_CV)
    lead = gauge(M.ARRIVAL_LEAD_SECONDS)
    last = gauge(M.RANK_LAST_REPORT_TIMESTAMP_SECONDS)
    dropped = counter(M.AGENT_RECORDS_DROPPED_TOTAL)
    for r, labels in rank_views(view):
        steps.add_metric(labels, r.steps_total)
        stage = "" if r.pipeline_stage is None else str(r.pipeline_stage)  # "": no label
        for phase in Phase:
            phases.add_metric([*labels, phase.label, stage], r.phase_seconds_total[phase])
        if r.phase_every > 1:
            sampling.add_metric(labels, r.phase_every)
        if r.step_time_cv is not None:
            cv.add_metric(labels, r.step_time_cv)
        if r.node_lead_s is not None:
            lead.add_metric(labels, r.node_lead_s)
        last.add_metric(labels, r.last_report_unix_s)
        dropped.add_metric(labels, r.dropped_total)
    return [hist, ratio, world, steps, phases, sampling, cv, lead, last, dropped]


def collect_work(view: StoreView) -> Iterable[Metric]:
    """Per rank the samples and tokens its steps reported; a rank whose steps never said how
    many has no series (not a zero: nothing says it did no work)."""
    samples = counter(M.RANK_SAMPLES_TOTAL)
    tokens = counter(M.RANK_TOKENS_TOTAL)
    for r, labels in rank_views(view):
        if r.samples_total is not None:
            samples.add_metric(labels, r.samples_total)
        if r.tokens_total is not None:
            tokens.add_metric(labels, r.tokens_total)
    return [samples, tokens]


def collect_goodput(view: StoreView) -> Iterable[Metric]:
    """Per node and job, over its ranks and their incarnations: badput by category, productive
    step time, the job's earliest process start (what the goodput rules divide by), when its
    latest rank's first step came in (what the job-wide rules wait a window after; now, while
    a rank has none) and the ranks' restarts."""
    badput = counter(M.NODE_BADPUT_SECONDS_TOTAL)
    productive = counter(M.NODE_PRODUCTIVE_SECONDS_TOTAL)
    started = gauge(M.JOB_STARTED_TIMESTAMP_SECONDS)
    latest = gauge(M.RANKS_STARTED_TIMESTAMP_SECONDS)
    restarts = counter(M.NODE_RESTARTS_TOTAL)
    for labels, ranks in node_views(view):
        latest.add_metric(labels, max(r.steps_since_unix_s or view.now_unix_s for r in ranks))
        restarts.add_metric(labels, sum(r.restarts for r in ranks))
        for category in M.BADPUT_CATEGORIES:
            badput.add_metric(
                [*labels, category], sum(r.badput_s.get(category, 0.0) for r in ranks)
            )
        productive.add_metric(labels, sum(r.productive_s for r in ranks))
        starts = [r.process_started_unix_s for r in ranks if r.process_started_unix_s]
        if starts:
            started.add_metric(labels, min(starts))
    return [badput, productive, started, latest, restarts]


def collect_price(view: StoreView) -> Iterable[Metric]:
    """The GPU-hour's price, per job and node this exporter serves, where it was given one."""
    price = gauge(M.GPU_HOUR_PRICE)
    if view.price_per_gpu_hour is not None:
        for labels, _ranks in node_views(view):
            price.add_metric(labels, view.price_per_gpu_hour)
    return [price]


def collect_collectives(view: StoreView) -> Iterable[Metric]:
    """Per rank its collective time (the straggler rules compare ranks by it); per node and
    (op, group) the sums the fabric rules read (bandwidth, transfer per call)."""
    per_rank = counter(M.RANK_COLLECTIVE_SECONDS_TOTAL)
    for r, labels in rank_views(view):
        by_group: dict[str, float] = {}
        for c in r.collectives:
            by_group[c.group] = by_group.get(c.group, 0.0) + c.seconds
        for group, secs in sorted(by_group.items()):
            first = group_first(r.topology, group)
            per_rank.add_metric([*labels, group, "" if first is None else str(first)], secs)
    calls = counter(M.COLLECTIVE_CALLS_TOTAL)
    seconds = counter(M.COLLECTIVE_SECONDS_TOTAL)
    nbytes = counter(M.COLLECTIVE_BYTES_TOTAL)
    wait = counter(M.COLLECTIVE_WAIT_SECONDS_TOTAL)
    for node_labels, ranks in node_views(view):
        sums: dict[tuple[str, str], list[float]] = {}
        for r in ranks:
            for c in r.collectives:
                total = sums.setdefault((c.op, c.group), [0.0, 0.0, 0.0, 0.0])
                total[0] += c.calls
                total[1] += c.seconds
                total[2] += c.bytes
                total[3] += c.wait_seconds
        for (op, group), (n, secs, b, w) in sorted(sums.items()):
            labels = [*node_labels, op, group]
            calls.add_metric(labels, n)
            seconds.add_metric(labels, secs)
            nbytes.add_metric(labels, b)
            wait.add_metric(labels, w)
    return [per_rank, calls, seconds, nbytes, wait]


def collect_pacing(view: StoreView) -> Iterable[Metric]:
    active = gauge(M.PACING_ACTIVE)
    total = counter(M.PACING_DELAY_SECONDS_TOTAL)
    current = gauge(M.PACING_CURRENT_DELAY_SECONDS)
    threshold = gauge(M.PACING_THRESHOLD_SECONDS)
    engagements = counter(M.PACING_ENGAGEMENTS_TOTAL)
    for r, labels in rank_views(view):
        p = r.pacing
        if p is None:
            continue
        active.add_metric(labels, 1.0 if p.active else 0.0)
        total.add_metric(labels, p.total_delay_s)
        current.add_metric(labels, p.current_delay_s)
        threshold.add_metric(labels, p.threshold_s)
        engagements.add_metric(labels, p.engagements)
    return [active, total, current, threshold, engagements]


def collect_diagnosis(view: StoreView) -> Iterable[Metric]:
    diag = gauge(M.DIAGNOSIS)
    cause = gauge(M.STRAGGLER_CAUSE)
    victim = gauge(M.VICTIM_WAIT_SECONDS)
    skew = gauge(M.ARRIVAL_SKEW_SECONDS)
    pooled = counter(M.NODE_POOLED_STEPS_TOTAL)
    transfer = counter(M.NODE_TRANSFER_SECONDS_TOTAL)
    sampled_step = gauge(M.NODE_SAMPLED_STEP)
    sampled = gauge(M.NODE_SAMPLED_TRANSFER_SECONDS)
    for job, data in view.jobs.items():
        d = data.diagnosis
        for mode, m in d.modes.items():
            diag.add_metric([job, mode], m.score)
        # The cause only where the straggler reports (its node's exporter compares its phases
        # with its peers'): an exporter naming a rank of another node from the job-wide view
        # has no cause for it ("unknown"), and a second series would contradict the first.
        slow = d.straggler
        if slow is not None:
            for r in data.ranks:
                if r.rank == slow.rank:
                    cause.add_metric([job, r.hostname, str(r.rank), slow.cause], 1.0)
                    break
        nodes = {r.rank: r.hostname for r in data.ranks}
        for v in d.victims:
            whom = "" if v.waits_for is None else str(v.waits_for)
            victim.add_metric([job, nodes.get(v.rank, ""), str(v.rank), v.group, whom], v.wait_s)
        if d.skew_s is not None:
            skew.add_metric([job], d.skew_s)
        pooled.add_metric([job], data.pooled_steps_total)
        transfer.add_metric([job], data.transfer_seconds_total)
        for sample in data.samples:
            labels = [job, str(sample.stride), str(sample.slot)]
            sampled_step.add_metric(labels, sample.step)
            sampled.add_metric(labels, sample.transfer_s)
    return [diag, cause, victim, skew, pooled, transfer, sampled_step, sampled]


def collect_verdict(view: StoreView) -> Iterable[Metric]:
    """The diagnosis's decision verdict per job (the evidence stays in /v1/state, off labels)."""
    verdict = gauge(M.JOB_VERDICT)
    for job, data in view.jobs.items():
        v = data.diagnosis.verdict
        if v is not None:
            verdict.add_metric([job, v.verdict, v.hardware], 1.0)
    return [verdict]


def collect_links(view: StoreView) -> Iterable[Metric]:
    """Each node's link, as its ranks report it (agent/link.py): the node is the ranks'
    hostname, so a job's nodes are told apart even where one exporter serves several."""
    capacity = gauge(M.NODE_LINK_CAPACITY_BYTES_PER_SECOND)
    moved = counter(M.NODE_LINK_BYTES_TOTAL)
    links: dict[tuple[str, str, str], dict[str, float]] = {}
    for job, r in view.ranks():
        topology = r.topology or {}
        interface = topology.get("link_interface")
        if not isinstance(interface, str) or not interface:
            continue
        seen = links.setdefault((job, r.hostname, interface), {})
        for key in ("link_capacity_bytes_per_second", "link_tx_bytes", "link_rx_bytes"):
            value = topology_number(topology.get(key))
            if value is not None:  # the ranks of a node read one interface: take the newest
                seen[key] = max(value, seen.get(key, 0.0))
    for (job, node, interface), seen in sorted(links.items()):
        if "link_capacity_bytes_per_second" in seen:
            capacity.add_metric([job, node, interface], seen["link_capacity_bytes_per_second"])
        for direction in ("tx", "rx"):
            if f"link_{direction}_bytes" in seen:
                moved.add_metric([job, node, interface, direction], seen[f"link_{direction}_bytes"])
    return [capacity, moved]


def collect_exporter(view: StoreView) -> Iterable[Metric]:
    start = gauge(M.EXPORTER_START_TIME_SECONDS)
    start.add_metric([], view.started_unix_s)
    records = counter(M.EXPORTER_INGEST_RECORDS_TOTAL)
    records.add_metric([], view.ingested_records)
    rejected = counter(M.EXPORTER_INGEST_REJECTED_TOTAL)
    for reason, count in sorted(view.rejected.items()):
        rejected.add_metric([reason], count)
    ranks = gauge(M.EXPORTER_RANKS)
    job_wide = gauge(M.EXPORTER_JOB_WIDE_VIEW)
    for job, data in view.jobs.items():
        ranks.add_metric([job], sum(1 for r in data.ranks if not r.stale))
        job_wide.add_metric([job], 1.0 if data.job_wide is not None else 0.0)
    return [start, records, rejected, ranks, job_wide]


COLLECTORS: dict[str, Callable[[StoreView], Iterable[Metric]]] = {
    "steps": collect_steps,
    "collectives": collect_collectives,
    "pacing": collect_pacing,
    "diagnosis": collect_diagnosis,
    "verdict": collect_verdict,
    "links": collect_links,
    "exporter": collect_exporter,
    "gpu": collect_gpu,
    "work": collect_work,
    "goodput": collect_goodput,
    "energy": collect_cpu_energy,
    "price": collect_price,
}


class StoreCollector(Collector):
    """Reads one snapshot per scrape and runs every collector over it, timing each: the whole
    scrape's time and each collector's success as series, each collector's time and success
    of the last scrape in `last` (for /v1/state)."""

    def __init__(
        self,
        store: Store,
        collectors: dict[str, Callable[[StoreView], Iterable[Metric]]] | None = None,
    ) -> None:
        self.store = store
        self.collectors = collectors or COLLECTORS
        self.last: dict[str, dict[str, float | bool]] = {}

    def describe(self) -> Iterable[Metric]:
        return []  # series depend on what has been ingested; skip the describe-time collect

    def collect(self) -> Iterator[Metric]:
        success = gauge(M.EXPORTER_COLLECTOR_SUCCESS)
        last: dict[str, dict[str, float | bool]] = {}
        start = t0 = time.perf_counter()
        view: StoreView | None
        try:
            view = snapshot(self.store, recent=STEP_WINDOW)
        except Exception:  # noqa: BLE001 - a scrape always answers
            view = None
        last["snapshot"] = {"seconds": time.perf_counter() - t0, "ok": view is not None}
        for name, func in self.collectors.items():
            t0 = time.perf_counter()
            families: list[Metric] = []
            ok = False
            if view is not None:
                try:
                    families = list(func(view))
                    ok = True
                except Exception:  # noqa: BLE001
                    families = []
            last[name] = {"seconds": time.perf_counter() - t0, "ok": ok}
            yield from families
        for name, timing in last.items():
            success.add_metric([name], 1.0 if timing["ok"] else 0.0)
        duration = gauge(M.EXPORTER_COLLECT_DURATION_SECONDS)
        duration.add_metric([], time.perf_counter() - start)
        self.last = last
        yield duration
        yield success
