"""Scrape-time collectors: read the store's snapshot and yield metric families.

One function per concern, each timed and isolated by the framework at the bottom, the way
node_exporter does: a failing collector yields nothing, sets its success gauge to 0 and never
fails the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from syncscope.exporter.gpu import collect_gpu
from syncscope.exporter.store import DIAGNOSIS_STEPS, STEP_BUCKETS, Store

from syncscope.wire import PHASES

RANK_LABELS = ["job", "rank", "local_rank"]
View = dict[str, Any]


def _ranks(view: View) -> Iterator[tuple[str, dict[str, Any], list[str]]]:
    for job, data in view["jobs"].items():
        for r in data["ranks"]:
            yield job, r, [job, str(r["rank"]), str(r["local_rank"])]


def collect_steps(view: View) -> Iterable[Metric]:
    hist = HistogramMetricFamily(
        "syncscope_step_duration_seconds", "Training step wall time.", labels=RANK_LABELS
    )
    steps = CounterMetricFamily("syncscope_steps", "Training steps completed.", labels=RANK_LABELS)
    phases = CounterMetricFamily(
        "syncscope_phase_seconds",
        "Time spent per step phase; phases add up to step time.",
        labels=[*RANK_LABELS, "phase"],
    )
    cv = GaugeMetricFamily(
        "syncscope_step_time_cv",
        "Coefficient of variation of step time over the last 100 steps.",
        labels=RANK_LABELS,
    )
    lead = GaugeMetricFamily(
        "syncscope_arrival_lead_seconds",
        "Rolling mean of how early this rank arrives at collectives relative to the last peer.",
        labels=RANK_LABELS,
    )
    world = GaugeMetricFamily(
        "syncscope_world_size", "World size the rank reports.", labels=RANK_LABELS
    )
    last = GaugeMetricFamily(
        "syncscope_rank_last_report_timestamp_seconds",
        "Unix time of the rank's last report.",
        labels=RANK_LABELS,
    )
    dropped = CounterMetricFamily(
        "syncscope_agent_records_dropped",
        "Records the rank's agent could not deliver.",
        labels=RANK_LABELS,
    )
    for _job, r, labels in _ranks(view):
        cumulative, buckets = 0, []
        for bound, count in zip(
            (*STEP_BUCKETS, float("inf")), r["step_bucket_counts"], strict=True
        ):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        hist.add_metric(labels, buckets, r["step_seconds_sum"])
        steps.add_metric(labels, r["steps_total"])
        for phase in PHASES:
            phases.add_metric([*labels, phase], r["phase_seconds_total"][phase])
        if r["step_time_cv"] is not None:
            cv.add_metric(labels, r["step_time_cv"])
        if r["arrival_lead_s"] is not None:
            lead.add_metric(labels, r["arrival_lead_s"])
        world.add_metric(labels, r["world_size"])
        last.add_metric(labels, r["last_report_unix_s"])
        dropped.add_metric(labels, r["dropped_total"])
    return [hist, steps, phases, cv, lead, world, last, dropped]


def collect_collectives(view: View) -> Iterable[Metric]:
    labels = [*RANK_LABELS, "op", "group"]
    families = {
        "calls": CounterMetricFamily(
            "syncscope_collective_calls", "Collective calls.", labels=labels
        ),
        "seconds": CounterMetricFamily(
            "syncscope_collective_seconds",
            "Collective time on this rank, entry to exit.",
            labels=labels,
        ),
        "bytes": CounterMetricFamily(
            "syncscope_collective_bytes", "Bytes moved by collectives.", labels=labels
        ),
        "wait_seconds": CounterMetricFamily(
            "syncscope_collective_wait_seconds",
            "Part of collective time spent waiting for the last peer.",
            labels=labels,
        ),
    }
    for _job, r, rank_labels in _ranks(view):
        for c in r["collectives"]:
            for field, family in families.items():
                family.add_metric([*rank_labels, c["op"], c["group"]], c[field])
    return families.values()


def collect_pacing(view: View) -> Iterable[Metric]:
    active = GaugeMetricFamily(
        "syncscope_pacing_active", "1 while the pacing controller is engaged.", labels=RANK_LABELS
    )
    total = CounterMetricFamily(
        "syncscope_pacing_delay_seconds", "Delay inserted by pacing.", labels=RANK_LABELS
    )
    current = GaugeMetricFamily(
        "syncscope_pacing_current_delay_seconds",
        "Delay pacing inserts before each iteration now.",
        labels=RANK_LABELS,
    )
    threshold = GaugeMetricFamily(
        "syncscope_pacing_threshold_seconds",
        "Current adaptive engage threshold.",
        labels=RANK_LABELS,
    )
    engagements = CounterMetricFamily(
        "syncscope_pacing_engagements", "Times pacing engaged.", labels=RANK_LABELS
    )
    for _job, r, labels in _ranks(view):
        p = r["pacing"]
        if not p:
            continue
        active.add_metric(labels, 1.0 if p["active"] else 0.0)
        total.add_metric(labels, p["total_delay_s"])
        current.add_metric(labels, p["current_delay_s"])
        threshold.add_metric(labels, p["threshold_s"])
        engagements.add_metric(labels, p["engagements"])
    return [active, total, current, threshold, engagements]


def collect_diagnosis(view: View) -> Iterable[Metric]:
    diag = GaugeMetricFamily(
        "syncscope_diagnosis", "Failure-mode score 0..1 (paper §3.3).", labels=["job", "mode"]
    )
    cause = GaugeMetricFamily(
        "syncscope_straggler_cause",
        "1 for the named straggler and its cause.",
        labels=["job", "rank", "cause"],
    )
    skew = GaugeMetricFamily(
        "syncscope_arrival_skew_seconds",
        "Max minus min arrival lead across this node's ranks.",
        labels=["job"],
    )
    for job, data in view["jobs"].items():
        d = data["diagnosis"]
        for mode, m in d["modes"].items():
            diag.add_metric([job, mode], m["score"])
        if d["straggler"]:
            cause.add_metric([job, str(d["straggler"]["rank"]), d["straggler"]["cause"]], 1.0)
        if d["skew_s"] is not None:
            skew.add_metric([job], d["skew_s"])
    return [diag, cause, skew]


def collect_exporter(view: View) -> Iterable[Metric]:
    start = GaugeMetricFamily(
        "syncscope_exporter_start_time_seconds", "Unix time the exporter started."
    )
    start.add_metric([], view["started_unix_s"])
    records = CounterMetricFamily(
        "syncscope_exporter_ingest_records", "Records accepted at ingest."
    )
    records.add_metric([], view["ingested_records"])
    rejected = CounterMetricFamily(
        "syncscope_exporter_ingest_rejected",
        "Requests or records refused at ingest.",
        labels=["reason"],
    )
    for reason, count in sorted(view["rejected"].items()):
        rejected.add_metric([reason], count)
    ranks = GaugeMetricFamily(
        "syncscope_exporter_ranks", "Ranks reporting (not stale).", labels=["job"]
    )
    for job, data in view["jobs"].items():
        ranks.add_metric([job], sum(1 for r in data["ranks"] if not r["stale"]))
    return [start, records, rejected, ranks]


COLLECTORS: dict[str, Callable[[View], Iterable[Metric]]] = {
    "steps": collect_steps,
    "collectives": collect_collectives,
    "pacing": collect_pacing,
    "diagnosis": collect_diagnosis,
    "exporter": collect_exporter,
    "gpu": collect_gpu,
}


class StoreCollector(Collector):
    """Reads one snapshot per scrape and runs every collector over it, timing each."""

    def __init__(
        self, store: Store, collectors: dict[str, Callable[[View], Iterable[Metric]]] | None = None
    ) -> None:
        self.store = store
        self.collectors = collectors or COLLECTORS

    def describe(self) -> Iterable[Metric]:
        return []  # series depend on what has been ingested; skip the describe-time collect

    def collect(self) -> Iterator[Metric]:
        duration = GaugeMetricFamily(
            "syncscope_exporter_collector_duration_seconds",
            "Time a collector took this scrape.",
            labels=["collector"],
        )
        success = GaugeMetricFamily(
            "syncscope_exporter_collector_success",
            "1 if the collector succeeded this scrape.",
            labels=["collector"],
        )
        t0 = time.perf_counter()
        try:
            view = self.store.view(recent=DIAGNOSIS_STEPS)
            ok = 1.0
        except Exception:  # noqa: BLE001 - a scrape always answers
            view, ok = None, 0.0
        duration.add_metric(["snapshot"], time.perf_counter() - t0)
        success.add_metric(["snapshot"], ok)
        for name, func in self.collectors.items():
            t0 = time.perf_counter()
            families: list[Metric] = []
            ok = 0.0
            if view is not None:
                try:
                    families = list(func(view))
                    ok = 1.0
                except Exception:  # noqa: BLE001
                    families = []
            duration.add_metric([name], time.perf_counter() - t0)
            success.add_metric([name], ok)
            yield from families
        yield duration
        yield success
