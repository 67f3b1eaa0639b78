"""The rule engines bench_scale.py measures, each started with the shipped configuration and
rules and read once a second: one Prometheus (PrometheusEngine), or the generated
VictoriaMetrics topology, vmagent shards remote-writing into one VictoriaMetrics and vmalert
evaluating against it (VictoriaMetricsEngine). Here too what a poll gathers (Watch), the
scrape configs pointing the shipped jobs at the emulated nodes and the emulated nodes' names
(hostname: the emulator's ranks report it, the engines' targets carry it as their instance).

bench_scale.py drives them: it runs the emulator, starts an engine per --engine, polls it
through a Watch while it settles and measures, and summarises and prints what the Watch
gathered. Nothing here imports bench_scale: it runs as a script (__main__), and an import by
name would load it a second time.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import re
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol

import yaml
from prometheus_client.parser import text_string_to_metric_families

from syncscope.lab.servers import Prometheus, VictoriaMetrics, VMAgent, VMAlert, free_port
from syncscope.monitoring import engines, victoriametrics
from syncscope.monitoring.prometheus_config import compose_config
from syncscope.monitoring.rules import STRAGGLER_LAG, write_rules
from syncscope.prometheus_api import PrometheusAPI
from syncscope.thresholds import duration_seconds, load_config

NODE_PREFIX = "node"  # hostnames nodeNNNN, instances nodeNNNN:9464


def hostname(node: int) -> str:
    """An emulated node's name: its ranks' hostname and, with :9464, its target's instance
    (one function, so that the emulator and the scrape configs agree)."""
    return f"{NODE_PREFIX}{node:04d}"


def unix_time(rfc3339: str) -> float:
    """Prometheus's RFC 3339 times (nanoseconds, Z) as unix seconds."""
    text = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(text).timestamp()


def emulated_targets(scrape: dict[str, Any], ports: Sequence[int]) -> None:
    """Point a shipped scrape job at the emulator: one target per node (`ports`: each node's
    emulator port, by node index), instance nodeNNNN:9464, its path /metrics/<node> set by the
    target's __metrics_path__."""
    path = scrape.get("metrics_path", "/metrics")
    scrape["static_configs"] = [
        {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {"__metrics_path__": f"{path}/{n}", "instance": f"{hostname(n)}:9464"},
        }
        for n, port in enumerate(ports)
    ]


def at_interval(config: dict[str, Any], interval: str | None) -> None:
    """Scrape (and evaluate, where the config does) every `interval` in place of the shipped
    interval (None: keep it); the scrape timeout shortened to fit."""
    if interval is None:
        return
    glob = config["global"]
    glob["scrape_interval"] = interval
    if duration_seconds(glob.get("scrape_timeout", interval)) > duration_seconds(interval):
        glob["scrape_timeout"] = interval
    if "evaluation_interval" in glob:
        glob["evaluation_interval"] = interval


def prometheus_config(
    ports: Sequence[int], rule_files: list[str], interval: str | None = None
) -> tuple[str, float]:
    """The shipped configuration (compose_config: its intervals, scrape job, honor_labels), one
    target per emulated node, no Alertmanager; and its evaluation interval in seconds.
    `interval`: scrape and evaluate that often instead (at_interval)."""
    config = yaml.safe_load(compose_config())
    config.pop("alerting", None)
    config["rule_files"] = rule_files
    (scrape,) = config["scrape_configs"]
    emulated_targets(scrape, ports)
    at_interval(config, interval)
    evaluation = config["global"].get("evaluation_interval", config["global"]["scrape_interval"])
    return yaml.safe_dump(config, sort_keys=False), duration_seconds(evaluation)


def vmagent_config(ports: Sequence[int], interval: str | None = None) -> str:
    """The shards' shipped scrape config (victoriametrics.files: deploy/victoriametrics/
    vmagent.yml, the same generator), one target per emulated node; `interval`: at_interval."""
    shipped = victoriametrics.files(load_config())[victoriametrics.VMAGENT_PATH]
    config = yaml.safe_load(shipped)
    (scrape,) = config["scrape_configs"]
    emulated_targets(scrape, ports)
    at_interval(config, interval)
    return yaml.safe_dump(config, sort_keys=False)


def shipped_flags(service: str) -> list[str]:
    """A service's flags in the generated compose project (victoriametrics.compose)."""
    return [str(f) for f in victoriametrics.compose()["services"][service]["command"]]


def flag_value(flags: list[str], name: str) -> str:
    (value,) = [f.partition("=")[2] for f in flags if f.partition("=")[0] == name]
    return value


@dataclass
class Process:
    """One server process's memory and CPU, as its own /metrics reports them."""

    rss: list[tuple[float, float]] = field(default_factory=list)  # (unix time, bytes)
    cpu_s: list[tuple[float, float]] = field(default_factory=list)  # process_cpu_seconds_total

    def sample(self, now: float, name: str, value: float) -> None:
        if name == "process_resident_memory_bytes":
            self.rss.append((now, value))
        elif name == "process_cpu_seconds_total":
            self.cpu_s.append((now, value))


# Counters of samples lost on the way (scrape, remote write, storage) and of errors; any that
# grows while measured is reported (vmagent, VictoriaMetrics, vmalert 1.79 names).
LOSS_COUNTER = re.compile(r"dropped|ignored|skipped|invalid|failed|timed_out|errors")
NOT_LOSS = {"vm_metric_rows_skipped_total"}  # rows a query skipped, none lost
VMALERT_FLUSH_S = 5.0  # vmalert's -remoteWrite.flushInterval, its default (the compose's)
QUEUE_GAUGE = "vm_persistentqueue_bytes_pending"  # vmagent: scraped but not yet accepted


@dataclass
class Watch:
    """A rule engine's evaluations as they happen (per group and per rule, by evaluation), the
    storage's series, its processes' memory and CPU and its loss counters; `poll` reads them
    once through the engine."""

    engine: Engine
    groups: dict[str, dict[float, float]] = field(default_factory=dict)  # ts -> duration
    intervals: dict[str, float] = field(default_factory=dict)
    missed: dict[str, float] = field(default_factory=dict)  # the latest counter values
    rules: dict[str, dict[float, float]] = field(default_factory=dict)  # group/i name -> ...
    head_series: list[tuple[float, float]] = field(default_factory=list)  # the storage's
    processes: dict[str, Process] = field(default_factory=dict)
    counters: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # LOSS_COUNTER
    queued: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # QUEUE_GAUGE
    rule_group_of: dict[str, str] = field(default_factory=dict)  # rule name -> its group
    rule_errors: dict[str, str] = field(default_factory=dict)  # rule name -> its last error
    failed_polls: int = 0

    def poll(self) -> None:
        """Read the engine once; one too busy to answer within 10 s is read next time."""
        try:
            self.engine.poll(self)
        except OSError:  # timeouts included
            self.failed_polls += 1

    def process(self, name: str) -> Process:
        return self.processes.setdefault(name, Process())

    def read_rules(self, groups: list[dict[str, Any]], cumulative: bool = False) -> None:
        """Each rule's last evaluation and its duration from /api/v1/rules (Prometheus's and
        vmalert's have the same fields). `cumulative`: vmalert 1.79 gives every rule of an
        iteration the iteration's time and, as its evaluationTime, the time from then to the
        rule's end; a rule's own is the difference from the rule before it."""
        for g in groups:
            before: tuple[str, float] = ("", 0.0)  # the previous rule's (time, evaluationTime)
            for i, rule in enumerate(g["rules"]):
                self.rule_group_of.setdefault(rule["name"], g["name"])
                if rule.get("lastError"):
                    self.rule_errors[rule["name"]] = str(rule["lastError"])[:300]
                when = rule.get("lastEvaluation", "")
                if not when or when.startswith("0001-"):  # not evaluated yet
                    continue
                took = float(rule["evaluationTime"])
                if cumulative:
                    took, before = took - (before[1] if before[0] == when else 0.0), (when, took)
                key = f"{g['name']}/{i:02d} {rule['name']}"
                self.rules.setdefault(key, {}).setdefault(unix_time(when), took)

    def rule_evaluations(self, rule: str) -> list[float]:
        """When `rule` was evaluated, as far as polls saw."""
        return sorted(ts for key, e in self.rules.items() if key.endswith(f" {rule}") for ts in e)


def get_text(url: str, timeout: float = 10) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as reply:  # noqa: S310 - our own servers
        return str(reply.read().decode())


def samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield s.name, s.labels, s.value


class Engine(Protocol):
    """The metrics back end under test: the servers it runs, read through `poll`."""

    name: str
    url: str  # its Prometheus query API (Prometheus's own, VictoriaMetrics')
    rules_file: str
    interval: float  # the evaluation interval: shipped, or the one it was given
    storage: str  # the process holding the series

    def wait_ready(self, timeout: float) -> None: ...
    def stop(self) -> None: ...
    def poll(self, watch: Watch) -> None: ...
    def straggler_named(
        self, watch: Watch, first_scrape: float, end: float, intervals: dict[str, float]
    ) -> dict[float, set[str]]: ...
    def query_time(self, started: float, interval: float) -> float: ...


class PrometheusEngine:
    """One Prometheus with the shipped configuration and rules scraping every emulated node
    (`interval`: scraping and evaluating that often instead)."""

    name = "prometheus"
    storage = "prometheus"

    def __init__(
        self,
        ports: Sequence[int],
        workdir: str,
        cpus: set[int] | None,
        interval: str | None = None,
    ) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.rules_file = str(write_rules(os.path.join(workdir, "rules")))  # no overrides
        config, self.interval = prometheus_config(ports, [self.rules_file], interval)
        with pinned(cpus):
            self.prom = Prometheus(config, workdir)
        self.url = self.prom.url

    def wait_ready(self, timeout: float) -> None:
        self.prom.wait_ready(timeout)

    def stop(self) -> None:
        self.prom.stop()

    def poll(self, watch: Watch) -> None:
        """Prometheus's own /metrics and /api/v1/rules."""
        text = get_text(self.url + "/metrics")
        groups = PrometheusAPI(self.url, timeout=10).get("/api/v1/rules")["groups"]
        now = time.time()
        last_ts: dict[str, float] = {}
        last_duration: dict[str, float] = {}
        for name, labels, value in samples(text):
            group = labels.get("rule_group", "").rpartition(";")[2]
            if name == "prometheus_rule_group_last_evaluation_timestamp_seconds":
                last_ts[group] = value
            elif name == "prometheus_rule_group_last_duration_seconds":
                last_duration[group] = value
            elif name == "prometheus_rule_group_interval_seconds":
                watch.intervals[group] = value
            elif name == "prometheus_rule_group_iterations_missed_total":
                watch.missed[group] = value
            elif name == "prometheus_tsdb_head_series":
                watch.head_series.append((now, value))
            else:
                watch.process(self.name).sample(now, name, value)
        # Prometheus sets an evaluation's duration just before its timestamp: a poll between
        # the two pairs the new duration with the previous timestamp, seen already, so the
        # first value seen for a timestamp is kept.
        for group, ts in last_ts.items():
            if ts > 0 and group in last_duration:
                watch.groups.setdefault(group, {}).setdefault(ts, last_duration[group])
        watch.read_rules(groups)

    def straggler_named(
        self, watch: Watch, first_scrape: float, end: float, intervals: dict[str, float]
    ) -> dict[float, set[str]]:
        """The ranks the straggler rule named at each evaluation of its group after the first
        scrape (evaluations come at fixed multiples of the group's interval)."""
        group = watch.rule_group_of.get(STRAGGLER_LAG, "")
        after = sorted(ts for ts in watch.groups.get(group, {}) if ts > first_scrape)
        if not after:
            return {}
        found = self.prom.query_range(
            f"max by (rank) ({STRAGGLER_LAG})", after[0], end, intervals[group]
        )
        return {t: {key.removeprefix("rank=") for key in series} for t, series in found.items()}

    def query_time(self, started: float, interval: float) -> float:
        """The time an evaluation that started at `started` queries at: its start."""
        return started


class VictoriaMetricsEngine:
    """The generated VictoriaMetrics topology (victoriametrics.compose): `shards` vmagent
    shards, each given the shipped scrape config with every emulated node and keeping its share
    (-promscrape.cluster.*), remote-writing into one VictoriaMetrics; vmalert evaluating the
    shipped rules' vmalert variant (engines.write_rules) against it at the shipped interval,
    writing records and alert state back. Each runs with the compose project's flags. vmalert
    1.79 refuses alerting rules without a notifier and has no blackhole: alerts go to a port
    nobody listens on (a send error each, counted; none fire at the default --lag-ms)."""

    name = "vm"
    storage = "victoria-metrics"

    def __init__(
        self,
        ports: Sequence[int],
        workdir: str,
        cpus: set[int] | None,
        shards: int,
        interval: str | None = None,
    ) -> None:
        os.makedirs(workdir, exist_ok=True)
        self.rules_file = str(engines.write_rules(os.path.join(workdir, "rules"), engine="vmalert"))
        own = ("-storageDataPath=", "-retentionPeriod=")  # the class sets its own
        vm_flags = [f for f in shipped_flags("victoria-metrics") if not f.startswith(own)]
        evaluation = interval or flag_value(shipped_flags("vmalert"), "-evaluationInterval")
        self.interval = duration_seconds(evaluation)
        scrape = vmagent_config(ports, interval)
        self.servers: dict[str, Any] = {}
        with pinned(cpus):
            self.vm = VictoriaMetrics(workdir, query_flags=vm_flags)
            self.servers[self.storage] = self.vm
            self.vm.wait_ready(60)
            write = self.vm.url + "/api/v1/write"
            for i in range(shards):
                self.servers[f"vmagent-{i}"] = VMAgent(
                    scrape, workdir, write, shard=i, shards=shards, flush_interval=None
                )
            self.vmalert = VMAlert(
                self.rules_file,
                self.vm.url,
                notifier_url=f"http://127.0.0.1:{free_port()}",
                evaluation_interval=evaluation,
                flush_interval=None,  # vmalert's own, as the compose project runs it
            )
            self.servers["vmalert"] = self.vmalert
        self.url = self.vm.url
        self.iterations: dict[str, tuple[float, float]] = {}  # group -> (duration sum, count)

    def wait_ready(self, timeout: float) -> None:
        for server in self.servers.values():
            server.wait_ready(timeout)

    def stop(self) -> None:
        for server in reversed(self.servers.values()):
            server.stop()

    def targets_by_shard(self) -> dict[str, int]:
        return {
            name: len(server.scraped())
            for name, server in self.servers.items()
            if isinstance(server, VMAgent)
        }

    def poll(self, watch: Watch) -> None:
        """Every server's own /metrics, and vmalert's /api/v1/rules."""
        texts = {name: get_text(s.url + "/metrics") for name, s in self.servers.items()}
        groups = PrometheusAPI(self.vmalert.url, timeout=10).get("/api/v1/rules")["groups"]
        now = time.time()
        iterations: dict[str, list[float]] = {}
        for process, text in texts.items():
            for name, labels, value in samples(text):
                group = labels.get("group", "")
                if name == "vmalert_iteration_duration_seconds_sum":
                    iterations.setdefault(group, [0.0, 0.0])[0] = value
                elif name == "vmalert_iteration_duration_seconds_count":
                    iterations.setdefault(group, [0.0, 0.0])[1] = value
                elif name == "vmalert_iteration_interval_seconds":
                    watch.intervals[group] = value
                elif name == "vmalert_iteration_missed_total":
                    watch.missed[group] = value
                elif name == "vm_cache_entries" and labels.get("type") == "storage/hour_metric_ids":
                    watch.head_series.append((now, value))
                elif name == QUEUE_GAUGE:
                    watch.queued.setdefault(process, []).append((now, value))
                elif name.endswith("_total") and LOSS_COUNTER.search(name) and name not in NOT_LOSS:
                    key = f"{process} {name}" + (
                        "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
                        if labels
                        else ""
                    )
                    watch.counters.setdefault(key, []).append((now, value))
                else:
                    watch.process(process).sample(now, name, value)
        for group, (total, count) in iterations.items():
            for ts, duration in new_iterations(self.iterations.get(group), (total, count), now):
                watch.groups.setdefault(group, {})[ts] = duration
            self.iterations[group] = (total, count)
        watch.read_rules(groups, cumulative=True)

    def straggler_named(
        self, watch: Watch, first_scrape: float, end: float, intervals: dict[str, float]
    ) -> dict[float, set[str]]:
        """The ranks the straggler rule named at each of its evaluations after the first
        scrape: the samples vmalert wrote, as stored (VictoriaMetrics' export, no lookback:
        vmalert writes no staleness marker, so a query would still show a rank named up to
        5 min before), each given to the evaluation it came from."""
        evaluations = [t for t in watch.rule_evaluations(STRAGGLER_LAG) if t > first_scrape]
        # The last evaluation's records reach VictoriaMetrics once it ends and vmalert flushes.
        interval = intervals.get(watch.rule_group_of.get(STRAGGLER_LAG, ""), self.interval)
        time.sleep(max(0.0, end + interval + VMALERT_FLUSH_S + 1 - time.time()))
        stored = self.vm.export(STRAGGLER_LAG, first_scrape, end + 60)
        return named_by_evaluation(evaluations, stored)

    def query_time(self, started: float, interval: float) -> float:
        """The time an evaluation that started at `started` queries at: vmalert rounds it down
        to the group's interval (-datasource.queryTimeAlignment), so an evaluation that starts
        just after a window is full may still read a window that is not."""
        return started - started % interval


def new_iterations(
    before: tuple[float, float] | None, now_: tuple[float, float], now: float
) -> list[tuple[float, float]]:
    """vmalert's group iterations finished between two polls of its duration summary (sum and
    count, cumulative), as (when it started, seconds): one each, exact when a poll sees one at a
    time, the mean otherwise. The first poll only sets the baseline."""
    if before is None or now_[1] <= before[1]:
        return []
    count = int(now_[1] - before[1])
    duration = (now_[0] - before[0]) / count
    return [(now - duration - i * 1e-3, duration) for i in range(count)]


def named_by_evaluation(
    evaluations: list[float], stored: list[dict[str, Any]]
) -> dict[float, set[str]]:
    """{evaluation: the ranks of the samples written by it}. vmalert stamps what an evaluation
    records with its query's time, the evaluation's start rounded down to the group's interval
    (-datasource.queryTimeAlignment), so a sample belongs to the first evaluation that started
    at or after its timestamp."""
    evaluations = sorted(evaluations)
    out: dict[float, set[str]] = {t: set() for t in evaluations}
    for series in stored:
        rank = series["metric"].get("rank", "")
        for ts_ms in series["timestamps"]:
            i = bisect.bisect_left(evaluations, ts_ms / 1e3 - 1e-3)
            if i < len(evaluations):
                out[evaluations[i]].add(rank)
    return out


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """This thread (and what it starts) on `cpus` meanwhile; None: leave it be."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
