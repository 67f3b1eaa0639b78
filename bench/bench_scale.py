"""Prometheus at scale: N emulated node exporters scraped by a real Prometheus with the shipped
configuration and rules, a straggler planted on one rank; or by the VictoriaMetrics topology
(vmagent shards, VictoriaMetrics, vmalert), or by both in turn (--engine).

Each emulated node is an exporter's own Store (exporter.store, default Settings) fed by its
ranks through the real ingest path (app.parse_batch, then Store.ingest) with agent bodies in
wire schema 2: one job of nodes x ranks-per-node ranks (node n holds ranks n*R .. n*R+R-1,
hostname nodeNNNN), stepping every --step-s seconds of wall time, each rank's steps ending a
little apart, a DDP gradient sync every step, an all_reduce every other one, an all_gather or
a broadcast every tenth (all in the world group), pacing state, a full GPU topology, the world
group as the agent reports it and the node's network link. Rank
nodes//2*R+3 is the planted straggler: it arrives at the gradient sync --lag-ms late, so its
collectives are short (it waits for nobody) and every other rank's are longer by the lag.
Every rank sends all the steps it completed once per --feed-s (the agent flushes every second;
the emulator batches more to fit its CPU). Expositions come from the exporter's own collectors
(StoreCollector in a CollectorRegistry, generate_latest), rendered at most once per feed, when a
scrape asks; one HTTP server on 127.0.0.1 serves every node at /metrics/<node>. With
--workers K the nodes are spread over K forked processes (node n in worker n mod K), each with
its own feeder and server, the targets pointing at each node's (EmulatorPool). With --replicate
only node 0 and the straggler's node are fed; every other node serves node 0's exposition with
its own hostname, rank numbers and GPU UUIDs (Template): the same series and the same number
of samples per scrape, values copied, for sizes whose ingest and rendering this machine cannot
emulate.

Prometheus runs with the shipped configuration (compose_config: scrape and evaluation interval,
scrape job, honor_labels), the shipped rules (rules.write_rules, no overrides) and one target
per node (instance nodeNNNN:9464, its path set by the target's __metrics_path__), no
Alertmanager. It is pinned to the first CPU and the emulator to the others (--no-pin: both
share every CPU); an evaluation's duration is wall time, so on a busy CPU it includes waiting
for the scrapes and the other groups. After a settle time from the first scrape (default: the
straggler window plus two of the longest group interval, so the 1 and 5 min windows are full;
the 10 min, 30 min and 1 h windows are not, which this bench does not wait out) it measures
for --duration seconds (default: 120, at least three of the longest group interval), reading
Prometheus's own /metrics and /api/v1/rules every second:

  eval/interval  per rule group, the worst prometheus_rule_group_last_duration_seconds over
                 the measured evaluations over prometheus_rule_group_interval_seconds (its
                 own: groups may differ), and the sum over groups ("all groups": the share
                 of the time they evaluate, which on few CPUs compete), medians too; missed
                 iterations (prometheus_rule_group_iterations_missed_total). Target: the sum
                 <= 25 % at 1024 x 8.
  series         prometheus_tsdb_head_series, and every series of the emulated targets
                 (count({instance=~"node.+"}): the exporters' own and up/scrape_*) per rank.
  prometheus     its largest process_resident_memory_bytes, its CPU (process_cpu_seconds_total).
  straggler      whether the straggler rule (rules.STRAGGLER_LAG) named exactly the planted
                 rank, first after how long from the first scrape, in seconds and in
                 evaluations of its group (rate() needs two scrapes of every rank), and in
                 how many of the measured evaluations; also at which evaluation once its
                 window is full: of those that query a window past the first scrape or later
                 (vmalert queries at its start rounded down to the group's interval).
  emulator       its own CPU (utime+stime over wall time, this bench's polling included; with
                 --workers, every worker's summed with this process's), of
                 which feeding (body, parse, ingest) and rendering; how late feeds ran; the
                 targets' worst scrape time and lowest up.
  rules          the slowest rules (the worst evaluationTime, /api/v1/rules), --top-rules.
  panels         with --panels, after the measurement (Prometheus and the emulator still
                 running): every query of both dashboards with the job selected and no node
                 or rank (dashboards.panel_queries), range queries over the measured window
                 every evaluation interval, tables at its end, counted as the e2e test counts
                 them (render.count_series): the most series one returns, every one over
                 dashboards.MAX_SERIES (30) or failing (then the bench exits 1), and those
                 that return nothing. A --lag-ms over 10 % of --step-s makes the straggler
                 alert fire and the exporter name a cause, so those panels have rows too.
  ab             with --ab A B, after the measurement: the PromQL in files A and B (two forms
                 of one rule's expression) asked alternately --ab-rounds times each, order
                 swapped every round: each one's median time, the median per-round ratio B / A,
                 and in how many rounds both answered alike at an instant a minute back.

--engine vm measures the generated VictoriaMetrics topology (victoriametrics.compose) in
Prometheus's place: --shards vmagent shards (default 2) read the shipped scrape config
(victoriametrics.files' vmagent.yml) with every emulated node and keep their share by the
targets' label hash (-promscrape.cluster.*), remote-writing into one VictoriaMetrics; vmalert
evaluates the shipped rules' vmalert variant (engines.write_rules) against it at the shipped
interval, writing records back; each with the compose project's flags, no Alertmanager (vmalert
1.79 will not start alerting rules without a notifier and has no blackhole: a port nobody
listens on). All four are pinned where Prometheus would be. The same figures, from their own
/metrics and vmalert's /api/v1/rules:

  eval/interval  vmalert's iterations: vmalert_iteration_duration_seconds (its cumulative sum
                 and count, so one iteration per poll) over vmalert_iteration_interval_seconds;
                 vmalert_iteration_missed_total. Rule times: vmalert 1.79 reports each rule's
                 time from its iteration's start, so a rule's own is the difference from the
                 rule before it.
  series         vm_cache_entries{type="storage/hour_metric_ids"} (the series written this
                 hour: all of them, as none end), and the targets' series as for Prometheus.
  processes      the largest RSS and the CPU of VictoriaMetrics, vmalert and every vmagent.
  loss           every loss or error counter of theirs that grew (dropped, ignored, skipped,
                 invalid, failed, timed out, errors: vm_rows_ignored_total, vmalert_remotewrite_
                 dropped_rows_total, vm_promscrape_scrapes_failed_total, ...), while measured and
                 since the first scrape, and the vmagents' largest persistent queue
                 (vm_persistentqueue_bytes_pending: scraped, not yet taken by VictoriaMetrics).
  straggler      from the samples vmalert stored (VictoriaMetrics' /api/v1/export, no lookback:
                 vmalert writes no staleness marker), each given to the evaluation that wrote
                 it; for both engines also at which evaluation once the straggler window is full.

--engine both runs prometheus, then vm, on the same emulator (it keeps feeding), and prints
the two side by side with vm / prometheus.

This file holds the emulator, the measurement (run_size, measure), the summary and the
printing; the engines (PrometheusEngine, VictoriaMetricsEngine), what a poll of one gathers
(Watch) and the scrape configs and flags they start with are in scale_engines.py.

Runs longer than ~30 s or above 64 nodes must not overlap other benchmarks (1024 x 8 takes
about 10 min per engine, 1.7 GB for Prometheus and 1.7 GB for the emulator):
Run: flock /tmp/syncscope-cpu.lock .venv/bin/python bench/bench_scale.py --sizes 64,256,1024
       [--ranks-per-node 8] [--duration 120] [--settle SECONDS] [--no-pin] [--json out.json]
       [--panels] [--engine prometheus|vm|both] [--shards 2] [--ab A.promql B.promql]
       [--workers K]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import math
import multiprocessing
import os
import pathlib
import random
import re
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing import connection
from typing import Any

import yaml
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from scale_engines import (
    NODE_PREFIX,
    QUEUE_GAUGE,
    Engine,
    PrometheusEngine,
    VictoriaMetricsEngine,
    Watch,
    hostname,
    pinned,
    samples,
)
from syncscope.agent.collectives import GroupLabels
from syncscope.exporter.app import parse_batch
from syncscope.exporter.collectors import StoreCollector
from syncscope.exporter.pooling import SAMPLE_SLOTS, SAMPLE_STRIDES
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import Store

from syncscope.lab import render
from syncscope.monitoring import dashboards, victoriametrics
from syncscope.prometheus_api import PrometheusAPI, PrometheusError
from syncscope.recorded import STRAGGLER_LAG
from syncscope.thresholds import duration_seconds, load_config

JOB = "scale"
# The process holding each engine's series.
STORAGE = {"prometheus": "prometheus", "vm": "victoria-metrics"}
# --engine: the engines measured, one after the other on the same emulator.
ENGINE_RUNS = {"prometheus": ("prometheus",), "vm": ("vm",), "both": ("prometheus", "vm")}
# (op, bytes, base seconds): the gradient sync every step (where ranks wait for the last one),
# an all_reduce every other step, an all_gather or a broadcast every tenth (bench_exporter's mix).
DDP = ("ddp_grad_sync", 25_000_000, 0.004)
ALL_REDUCE = ("all_reduce", 4096, 0.0004)
EVERY_TENTH = (("all_gather", 1 << 20, 0.001), ("broadcast", 8, 0.0002))
ARRIVAL_JITTER_S = 0.002  # spread of the ranks' arrival at the sync, the straggler's included
END_JITTER_S = 0.001  # spread of the ranks' step ends around the job's period
COMPUTE_SHARES = (0.05, 0.30, 0.50, 0.10)  # data, forward, backward, optimizer of the compute
LINK_BYTES_PER_S = 50e9  # 400 Gb/s per node
LINK_BUSY_SHARE = 0.2  # of it, what the job moves on average
# A DGX H100's GPUs: PCI bus ids by local rank.
BUS_IDS = ("18", "2a", "3a", "5d", "9a", "ab", "ba", "db")


@dataclass(frozen=True)
class Job:
    """One synchronous job: step k of every rank ends near t0 + (k + 1) * step_s."""

    nodes: int
    per_node: int
    step_s: float
    lag_s: float
    t0: float

    @property
    def world_size(self) -> int:
        return self.nodes * self.per_node

    @property
    def straggler(self) -> int:
        return self.nodes // 2 * self.per_node + min(3, self.per_node - 1)


class SharedSteps:
    """What every rank sees alike in step k: the sync's transfer and the last arrival (the
    straggler's, late by the lag). Grown on demand; thread-safe for one feeder."""

    def __init__(self, job: Job, seed: int) -> None:
        self.job = job
        self.rng = random.Random(seed)
        self.steps: list[tuple[float, float]] = []

    def __getitem__(self, step: int) -> tuple[float, float]:
        while len(self.steps) <= step:
            transfer = DDP[2] * (1 + 0.1 * self.rng.random())
            self.steps.append((transfer, self.job.lag_s + self.rng.random() * ARRIVAL_JITTER_S))
        return self.steps[step]


@dataclass
class RankFeed:
    """One rank's agent: the steps it has completed since its last body, as the agent sends."""

    job: Job
    rank: int
    rng: random.Random
    next_step: int = 0
    last_end: float = 0.0
    uptime_s: float = 0.0  # the agent's monotonic clock at t0

    @property
    def node(self) -> int:
        return self.rank // self.job.per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.job.per_node

    def body(self, now: float, shared: SharedSteps, topology: dict[str, Any]) -> bytes | None:
        """Every step ended by `now` and not sent yet, in wire schema 2; None if there is none."""
        job, rng = self.job, self.rng
        steps: list[list[int]] = []
        colls: list[list[Any]] = []
        offset_ns = round((job.t0 - self.uptime_s) * 1e9)  # unix time - the agent's monotonic
        step = self.next_step
        while True:
            end = job.t0 + (step + 1) * job.step_s + rng.random() * END_JITTER_S
            if end > now:
                break
            transfer, last_arrival = shared[step]
            arrival = (
                last_arrival if self.rank == job.straggler else rng.random() * ARRIVAL_JITTER_S
            )
            sync = transfer + last_arrival - arrival
            comm = sync
            colls.append([DDP[0], "default_pg", DDP[1], round(sync * 1e9), step])
            extra = ALL_REDUCE if step % 2 else None
            if step % 10 == 0:
                extra = EVERY_TENTH[step // 10 % 2]
            if extra is not None:
                d = extra[2] * (1 + 0.2 * rng.random())
                comm += d
                colls.append([extra[0], "default_pg", extra[1], round(d * 1e9), step])
            duration = end - (self.last_end or job.t0 + step * job.step_s)
            compute = max(0.0, duration - comm)
            phases = [round(compute * s * 1e9) for s in COMPUTE_SHARES]
            steps.append(
                [
                    step,
                    round(end * 1e9) - offset_ns,
                    round(duration * 1e9),
                    *phases,
                    round(comm * 1e9),
                    0,  # pacing
                ]
            )
            self.last_end = end
            step += 1
        if not steps:
            return None
        self.next_step = step
        body = {
            "schema_version": 2,
            "agent": {
                "job": JOB,
                "rank": self.rank,
                "local_rank": self.local_rank,
                "world_size": job.world_size,
                "incarnation": f"inc-{self.rank}-{int(job.t0)}",
                "hostname": hostname(self.node),
                "pid": 4000 + self.local_rank,
                "started_unix_s": job.t0,
            },
            "clock_offset_ns": offset_ns,
            "dropped_total": 0,
            "steps": steps,
            "collectives": colls,
            "pacing": {
                "enabled": True,
                "active": False,
                "current_delay_s": 0.0,
                "threshold_s": 0.002,
                "engagements": 0,
                "total_delay_s": 0.0,
            },
            "topology": topology,
        }
        return json.dumps(body).encode()


def gpu_topology(node: int, local_rank: int, per_node: int) -> dict[str, Any]:
    """A healthy H100 in a DGX-like node, as agent.topology reports it (the link added per body)."""
    numa = local_rank * 2 // per_node
    cpus = "0-55" if numa == 0 else "56-111"
    return {
        "gpu_uuid": f"{gpu_uuid_prefix(node)}{local_rank:04x}-4c2e-9d1a-7f3b5e8c{local_rank:04x}",
        "gpu_name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"0000:{BUS_IDS[local_rank % len(BUS_IDS)]}:00.0",
        "pcie_link_width": 16,
        "pcie_link_max_width": 16,
        "pcie_link_generation": 5,
        "pcie_link_max_generation": 5,
        "nvlink_active_links": 18,
        "gpu_numa_node": numa,
        "gpu_numa_source": "nvml",
        "gpu_cpu_affinity": cpus,
        "process_numa_nodes": str(numa),
        "numa_mismatch": 0,
        "nic": f"mlx5_{local_rank}",
        "nic_numa_node": numa,
        "nic_distance": "same_pcie_switch",
        "cpu_affinity": cpus,
        "topology_source": "nvml+sysfs",
        "sm_clock_hertz": 1_980_000_000,
        "throttle_reasons": 0,
        "temperature_celsius": 45 + local_rank,
        "power_watts": 650.0,
        "link_interface": "bond0",
        "link_speed_bytes_per_second": LINK_BYTES_PER_S,
        "link_capacity_bytes_per_second": LINK_BYTES_PER_S,
    }


def group_facts(job: Job) -> dict[str, str]:
    """A rank's process groups as its agent reports them (GroupLabels.facts): the world
    ("default_pg"), where every emulated collective runs; its ranks listed in a small job, its
    lowest rank past a topology value's length (about 64 ranks)."""
    labels = GroupLabels()
    labels.members = {"default_pg": tuple(range(job.world_size))}
    return labels.facts()


def gpu_uuid_prefix(node: int) -> str:
    """What every GPU UUID of node `node` starts with (gpu_topology)."""
    return f"GPU-{node:08x}-"


@dataclass
class Node:
    """One emulated node: its exporter's Store and collectors, and its ranks' agents."""

    index: int
    job: Job
    ranks: list[RankFeed]
    topologies: list[dict[str, Any]]
    store: Store = field(default_factory=lambda: Store(Settings()))
    lock: threading.Lock = field(default_factory=threading.Lock)
    rendered: bytes = b""
    dirty: bool = True
    template: Template | None = None  # of `rendered`, once a replica asked (--replicate)

    def __post_init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StoreCollector(self.store))

    def feed(self, now: float, shared: SharedSteps) -> int:
        """Every rank sends what it completed by `now`; the records ingested."""
        # The node's link counters, read by every rank alike (agent/link.py).
        moved = int(LINK_BYTES_PER_S * LINK_BUSY_SHARE * max(0.0, now - self.job.t0))
        records = 0
        for feed, topology in zip(self.ranks, self.topologies, strict=True):
            body = feed.body(
                now, shared, {**topology, "link_tx_bytes": moved, "link_rx_bytes": moved}
            )
            if body is None:
                continue
            parsed = parse_batch(body)
            with self.lock:
                if not self.store.ingest(parsed)["accepted"]:
                    raise RuntimeError(f"{hostname(self.index)}: ingest refused")
                self.dirty = True
            records += len(parsed.steps) + len(parsed.collectives)
        return records

    def exposition(self) -> tuple[bytes, float]:
        """The node's /metrics, rendered again only if fed since; and the CPU seconds spent."""
        t0 = time.thread_time()
        with self.lock:
            return self._render(), time.thread_time() - t0

    def replica(self, node: int) -> tuple[bytes, float]:
        """Node `node`'s /metrics as a copy of this one's (--replicate): this node's exposition
        with `node`'s identity put in (Template); and the CPU seconds spent."""
        t0 = time.thread_time()
        with self.lock:
            body = self._render()
            if self.template is None:
                self.template = Template(body, self.index, self.job.per_node)
            template = self.template
        return template.render(node), time.thread_time() - t0

    def _render(self) -> bytes:
        if self.dirty:
            self.rendered = generate_latest(self.registry)
            self.template = None
            self.dirty = False
        return self.rendered


class Template:
    """A node's exposition split where a node's identity goes, so that another node's is a join:
    its hostname (the `node` label, the ranks' hostname), its ranks' numbers (the `rank` label,
    and `waits_for` where it names a rank of the node) and its GPUs' UUIDs. Everything else (the
    values, the series) is the prototype's."""

    HOST, UUID = 0, 1  # the other pieces: bytes, or (HOST | UUID | RANK, local rank)
    RANK = 2

    def __init__(self, body: bytes, prototype: int, per_node: int) -> None:
        self.per_node = per_node
        host, uuid = hostname(prototype).encode(), gpu_uuid_prefix(prototype).encode()
        token = re.compile(
            rb'(?<=[{,])(rank|waits_for)="(\d+)"|' + re.escape(host) + rb"|" + re.escape(uuid)
        )
        pieces: list[bytes | tuple[int, int]] = []
        pos = 0
        for m in token.finditer(body):
            if m[1] is not None:
                local = int(m[2]) - prototype * per_node
                if not 0 <= local < per_node:
                    continue  # a rank of another node stays what it is
                pieces += [body[pos : m.start()] + m[1] + b'="', (self.RANK, local), b'"']
            else:
                pieces += [body[pos : m.start()], (self.HOST if m[0] == host else self.UUID, 0)]
            pos = m.end()
        pieces.append(body[pos:])
        self.pieces = pieces

    def render(self, node: int) -> bytes:
        per = self.per_node
        values = {
            self.HOST: [hostname(node).encode()],
            self.UUID: [gpu_uuid_prefix(node).encode()],
            self.RANK: [str(node * per + local).encode() for local in range(per)],
        }
        return b"".join(p if isinstance(p, bytes) else values[p[0]][p[1]] for p in self.pieces)


# Issue 32's bound on series per rank: at or under what one Prometheus carried per rank at
# 1024 x 8 when that work began (this emulator's node: pacing on, the GPU families of then,
# rings full), so that the rules' input grows with ranks no faster than it did.
SERIES_PER_RANK_TARGET = 42.6
# What Prometheus adds to every target: up, scrape_duration_seconds, scrape_samples_scraped,
# scrape_samples_post_metric_relabeling, scrape_series_added.
SCRAPE_SERIES_PER_TARGET = 5


# What an H100's agent reports beyond this emulator's GPU (the families added after issue 32's
# bound was set: energy, XID, ECC, row remapping), healthy; for the figure of a real GPU job.
GPU_HEALTH_SINCE = {
    "energy_joules": 1.0e6,
    "xid_errors": 0,
    "last_xid": 0,
    "ecc_uncorrected_errors": 0,
    "row_remap_pending": 0,
    "row_remap_failure": 0,
}


def node_series(
    per_node: int = 8, seed: int = 20, extra: dict[str, Any] | None = None
) -> dict[str, int]:
    """Series per family of one emulated node's /metrics once every sampled ring is full (the
    job has run the largest stride times the slots, and one ring more), counted in process;
    `extra` added to every rank's topology."""
    steps = (max(SAMPLE_STRIDES) + 1) * SAMPLE_SLOTS
    emulator = Emulator(Job(1, per_node, 1.0, 0.03, time.time() - steps), 5.0, seed)
    for topology in emulator.nodes[0].topologies:
        topology.update(extra or {})
    try:
        emulator.feed_all()
        body, _ = emulator.nodes[0].exposition()
    finally:
        emulator.server.server_close()
    return dict(Counter(name for name, _, _ in samples(body.decode())))


def series_per_rank(families: dict[str, int], per_node: int = 8) -> float:
    """A node's series and the scrape's own over its ranks: what Prometheus holds per rank."""
    return (sum(families.values()) + SCRAPE_SERIES_PER_TARGET) / per_node


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # a scrape never waits for a SYN retry behind a burst

    def handle_error(self, request: Any, client_address: Any) -> None:
        # An engine stopped while scraping (--engine both stops one, the emulator runs on).
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


# --replicate: every node but these serves node 0's exposition with its own identity.
REPLICA_PROTOTYPE = 0


def replicated_prototypes(job: Job) -> set[int]:
    """The nodes fed for real under --replicate: node 0 and the straggler's."""
    return {REPLICA_PROTOTYPE, job.straggler // job.per_node}


class Emulator:
    """Nodes' agents fed on one thread, those nodes served by one HTTP server (every node of the
    job, or one worker's share of them: EmulatorPool). With `replicate`, only node 0 and the
    straggler's node are fed; every other node serves node 0's exposition with its own
    hostname, rank numbers and GPU UUIDs (Template), so that the emulator's cost no longer
    grows with the nodes' ingest and rendering, only with the scrapes."""

    def __init__(
        self,
        job: Job,
        feed_s: float,
        seed: int,
        nodes: Sequence[int] | None = None,
        replicate: bool = False,
    ) -> None:
        self.job, self.feed_s = job, feed_s
        self.shared = SharedSteps(job, seed)  # the same in every worker: one seed, in step order
        per = job.per_node
        self.served = set(range(job.nodes) if nodes is None else nodes)
        # --replicate: only the prototypes are fed (in every worker), the rest copy node 0.
        fed = sorted(replicated_prototypes(job)) if replicate else sorted(self.served)
        self.nodes = {
            n: Node(
                n,
                job,
                [
                    RankFeed(job, r, random.Random(seed * 1_000_003 + r), uptime_s=3600.0 + n)
                    for r in range(n * per, (n + 1) * per)
                ],
                [{**gpu_topology(n, local, per), **group_facts(job)} for local in range(per)],
            )
            for n in fed
        }
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.feed_cpu_s = self.render_cpu_s = 0.0
        self.records = self.scrapes = 0
        self.first_scrape: float | None = None
        self.error: BaseException | None = None  # the feeder's, raised by check()
        self.feed_late_s: list[float] = []  # per feed cycle: how late its last node was fed
        self.started = False
        self.server = Server(("127.0.0.1", 0), self._handler())
        self.port = self.server.server_address[1]

    @property
    def ports(self) -> list[int]:
        """Each node's target port, by node index."""
        return [self.port] * self.job.nodes

    def feed_all(self) -> None:
        now = time.time()
        for node in self.nodes.values():
            self.records += node.feed(now, self.shared)

    def start(self, cpus: set[int] | None = None) -> None:
        """Feed and serve from now on (the threads take the caller's CPUs; `cpus` is the pool's)."""
        self.started = True
        for target in (self._feed_loop, self.server.serve_forever):
            threading.Thread(target=target, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        if self.started:
            self.server.shutdown()
        self.server.server_close()

    def check(self) -> None:
        if self.error is not None:
            raise RuntimeError("the emulator's feeder failed") from self.error

    def reset_first_scrape(self) -> None:
        with self.lock:
            self.first_scrape = None

    def stats(self) -> dict[str, Any]:
        """Cumulative figures: records fed, scrapes served, feeding's and rendering's CPU, each
        feed cycle's lateness (a list per process), the first scrape since the last reset,
        this process's CPU (its polling included) and RSS."""
        with self.lock:
            return {
                "records": self.records,
                "scrapes": self.scrapes,
                "feed_cpu_s": self.feed_cpu_s,
                "render_cpu_s": self.render_cpu_s,
                "feed_late_s": [list(self.feed_late_s)],
                "first_scrape": self.first_scrape,
                "cpu_s": cpu_times(),
                "rss_mb": rss_mb(os.getpid()),
                "error": None if self.error is None else repr(self.error),
            }

    def _feed_loop(self) -> None:
        try:
            self._feed_nodes()
        except BaseException as exc:  # noqa: BLE001 - the main thread raises it (check)
            self.error = exc

    def _feed_nodes(self) -> None:
        """Node i is fed at i / nodes of each feed period, so the work spreads evenly."""
        n = len(self.nodes)
        start = time.monotonic()
        while not self.stop.is_set():
            late = 0.0
            for i, node in enumerate(self.nodes.values()):
                due = start + i * self.feed_s / n
                if self.stop.wait(max(0.0, due - time.monotonic())):
                    return
                late = max(late, time.monotonic() - due)
                t0 = time.thread_time()
                records = node.feed(time.time(), self.shared)
                with self.lock:
                    self.records += records
                    self.feed_cpu_s += time.thread_time() - t0
            with self.lock:
                self.feed_late_s.append(late)
            start = max(start + self.feed_s, time.monotonic() - self.feed_s)

    def exposition(self, node: int) -> tuple[bytes, float]:
        """Node `node`'s /metrics (one this emulator serves) and the CPU seconds it took."""
        own = self.nodes.get(node)
        if own is not None:
            return own.exposition()
        return self.nodes[REPLICA_PROTOTYPE].replica(node)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path in ("/stats", "/reset"):  # a pool's parent asks its workers
                    if self.path == "/reset":
                        emulator.reset_first_scrape()
                    self._reply(json.dumps(emulator.stats()).encode(), "application/json")
                    return
                prefix, _, index = self.path.rpartition("/")
                n = int(index) if index.isdigit() else -1
                if prefix != "/metrics" or n not in emulator.served:
                    self.send_error(404)
                    return
                body, cpu_s = emulator.exposition(n)
                with emulator.lock:
                    emulator.render_cpu_s += cpu_s
                    emulator.scrapes += 1
                    if emulator.first_scrape is None:
                        emulator.first_scrape = time.time()
                self._reply(body, CONTENT_TYPE_LATEST)

            def _reply(self, body: bytes, content_type: str) -> None:
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

        return Handler


def _worker(
    job: Job,
    feed_s: float,
    seed: int,
    nodes: Sequence[int],
    conn: connection.Connection,
    inherited: list[connection.Connection],
    replicate: bool = False,
) -> None:
    """One EmulatorPool worker: feed its nodes once, hand its port over, take its CPUs and
    start; run until the parent says stop or its end of the pipe closes (the parent exited)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for other in inherited:  # the earlier workers' pipes: their parent ends must close with it
        other.close()
    emulator = Emulator(job, feed_s, seed, nodes, replicate)
    try:
        emulator.feed_all()
        gc.collect()
        gc.freeze()
        conn.send(emulator.port)
        message = conn.recv()  # ("start", its CPUs or None), or "stop" before any start
        if message == "stop":
            return
        if message[1] is not None:
            os.sched_setaffinity(0, message[1])
        emulator.start()
        conn.recv()  # "stop", or EOFError when the parent has gone
    except EOFError:
        pass
    finally:
        emulator.close()


SUMMED_STATS = ("records", "scrapes", "feed_cpu_s", "render_cpu_s")


class EmulatorPool:
    """The job's nodes spread over --workers processes (node n in worker n mod workers), each an
    Emulator with its own feeder and HTTP server, so the emulator can use more than one core
    (one Python process holds one at 1,024 x 8: docs/scale.md). Every worker draws the same
    shared steps and each rank its own numbers, so the job is the one a single process feeds.
    The figures are the workers' summed (their CPU, RSS), with this process's."""

    def __init__(
        self, job: Job, feed_s: float, seed: int, workers: int, replicate: bool = False
    ) -> None:
        self.job = job
        self.started = False
        context = multiprocessing.get_context("fork")  # before any thread of this process
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[connection.Connection] = []
        for w in range(workers):
            parent, child = context.Pipe()
            proc = context.Process(
                target=_worker,
                args=(
                    job,
                    feed_s,
                    seed,
                    range(w, job.nodes, workers),
                    child,
                    self.conns,
                    replicate,
                ),
                name=f"emulator-{w}",
                daemon=True,
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.worker_ports: list[int] = []

    @property
    def ports(self) -> list[int]:
        w = len(self.worker_ports)
        return [self.worker_ports[n % w] for n in range(self.job.nodes)]

    def feed_all(self) -> None:
        """Wait for every worker's first feed (they feed at once, side by side)."""
        for i, conn in enumerate(self.conns):
            try:
                self.worker_ports.append(conn.recv())
            except EOFError:
                raise RuntimeError(f"emulator worker {i} exited before its first feed") from None

    def start(self, cpus: set[int] | None = None) -> None:
        self.started = True
        for conn in self.conns:
            conn.send(("start", cpus))

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker that exited closed its end
                conn.send("stop")
            conn.close()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    def check(self) -> None:
        for i, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise RuntimeError(f"emulator worker {i} exited ({proc.exitcode})")

    def _ask(self, path: str) -> list[dict[str, Any]]:
        out = []
        for port in self.worker_ports:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=30) as r:
                out.append(json.load(r))
        errors = [s["error"] for s in out if s["error"]]
        if errors:
            raise RuntimeError(f"an emulator worker's feeder failed: {errors[0]}")
        return out

    def reset_first_scrape(self) -> None:
        self._ask("/reset")

    def stats(self) -> dict[str, Any]:
        self.check()
        each = self._ask("/stats")
        firsts = [s["first_scrape"] for s in each if s["first_scrape"] is not None]
        return {
            **{k: sum(s[k] for s in each) for k in SUMMED_STATS},
            "feed_late_s": [late for s in each for late in s["feed_late_s"]],
            "first_scrape": min(firsts, default=None),
            "cpu_s": cpu_times() + sum(s["cpu_s"] for s in each),
            "rss_mb": rss_mb(os.getpid()) + sum(s["rss_mb"] for s in each),
        }


# Of the loss counters (scale_engines.LOSS_COUNTER), those that count samples (the rest count
# errors): their increases while measured are summed as the samples dropped.
LOSS_SAMPLES = re.compile(r"dropped|ignored|skipped|invalid|scrapes_failed|scrapes_timed_out")


def cpu_times() -> float:
    t = os.times()
    return t.user + t.system


def default_settle(interval: float) -> float:
    """The straggler window (the longest the per-rank rules rate over) plus two of the longest
    group interval."""
    return straggler_window() + 2 * interval


def straggler_window() -> float:
    return duration_seconds(load_config().windows.straggler)


def rule_intervals(path: str, default: float) -> tuple[dict[str, float], str]:
    """Each group's evaluation interval in the rules file (its own, else `default`), and the
    file's sha256 (12 digits): the rules change with the tree the bench runs from."""
    with open(path, "rb") as f:
        text = f.read()
    groups = yaml.safe_load(text)["groups"]
    intervals = {
        g["name"]: duration_seconds(g["interval"]) if "interval" in g else default for g in groups
    }
    return intervals, hashlib.sha256(text).hexdigest()[:12]


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


@dataclass
class Measured:
    """What one size's run on one engine gathered, before it is summarised."""

    engine: str
    job: Job
    watch: Watch
    interval: float
    first_scrape: float
    settle: float
    measure_from: float
    end: float
    missed_before: dict[str, float]
    targets: dict[str, float]  # their series, worst scrape time and lowest up while measured
    straggler_ranks: dict[float, set[str]]  # evaluation time -> the ranks the rule named
    query_times: dict[float, float]  # evaluation time -> the time its queries asked for
    emulator: dict[str, Any]
    rules_sha256: str
    panels: dict[str, Any] | None = None  # --panels: panel_series()
    shards: dict[str, int] | None = None  # vm: the targets each vmagent shard scrapes
    ab: dict[str, Any] | None = None  # --ab: ab_queries()


def run_size(nodes: int, args: argparse.Namespace, done: Callable[[Measured], None]) -> None:
    """One size from scratch: the emulator, then each engine of --engine in turn on it (start,
    settle, measure, stop), each measurement handed to `done` at once; everything stopped
    after."""
    cpus = set(os.sched_getaffinity(0))
    engine_cpus = {min(cpus)} if args.pin and len(cpus) > 1 else None
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-bench-scale-")
        stack.callback(shutil.rmtree, workdir, True)
        # The job started one feed period ago, so the first scrape finds every rank reporting.
        job = Job(
            nodes, args.ranks_per_node, args.step_s, args.lag_ms / 1e3, time.time() - args.feed_s
        )
        t = time.perf_counter()
        emulator: Emulator | EmulatorPool
        if args.workers > 1:
            emulator = EmulatorPool(job, args.feed_s, args.seed, args.workers, args.replicate)
        else:
            emulator = Emulator(job, args.feed_s, args.seed, replicate=args.replicate)
        stack.callback(emulator.close)
        emulator.feed_all()
        print(
            f"  {nodes} nodes fed once in {time.perf_counter() - t:.1f} s "
            f"({args.workers} emulator process{'es' if args.workers > 1 else ''})",
            flush=True,
        )
        gc.collect()
        gc.freeze()  # the stores' long-lived state: full collections skip it from now on
        for name in ENGINE_RUNS[args.engine]:
            with contextlib.ExitStack() as running:
                engine: Engine
                if name == "prometheus":
                    engine = PrometheusEngine(
                        emulator.ports, os.path.join(workdir, name), engine_cpus
                    )
                else:
                    engine = VictoriaMetricsEngine(
                        emulator.ports, os.path.join(workdir, name), engine_cpus, args.shards
                    )
                running.callback(engine.stop)
                if not emulator.started:
                    emulator_cpus = None if engine_cpus is None else cpus - engine_cpus
                    # this thread's, which the emulator's threads inherit; a pool's workers too
                    stack.enter_context(pinned(emulator_cpus))
                    emulator.start(emulator_cpus)
                measured = measure(engine, emulator, args)
            done(measured)  # the engine stopped


def measure(
    engine: Engine, emulator: Emulator | EmulatorPool, args: argparse.Namespace
) -> Measured:
    """Wait for the engine's first scrape, settle, measure; the engine still running."""
    job = emulator.job
    intervals, rules_sha = rule_intervals(engine.rules_file, engine.interval)
    longest = max(intervals.values(), default=engine.interval)
    print(
        f"  {engine.name}: rules {os.path.basename(engine.rules_file)} sha256 {rules_sha}: "
        "groups " + ", ".join(f"{short(g)} every {i:g} s" for g, i in intervals.items()),
        flush=True,
    )
    engine.wait_ready(120)
    watch = Watch(engine)
    settle = args.settle if args.settle is not None else default_settle(longest)
    duration = args.duration if args.duration is not None else max(120.0, 3 * longest)
    emulator.reset_first_scrape()  # this engine's
    while (first_scrape := emulator.stats()["first_scrape"]) is None:
        emulator.check()
        time.sleep(0.2)
    measure_from = first_scrape + settle
    end = measure_from + duration
    print(
        f"  first scrape at {time.strftime('%H:%M:%S', time.gmtime(first_scrape))} UTC; "
        f"settle {settle:.0f} s, measure {duration:.0f} s",
        flush=True,
    )
    shards = None
    while time.time() < measure_from:
        emulator.check()
        watch.poll()
        if shards is None and isinstance(engine, VictoriaMetricsEngine):
            by_shard = engine.targets_by_shard()
            if sum(by_shard.values()) == job.nodes:
                shards = by_shard
                print(f"  targets by shard: {shards}", flush=True)
        time.sleep(1.0)
    watch.poll()
    missed_before = dict(watch.missed)
    wall0, before = time.time(), emulator.stats()
    while time.time() < end:
        emulator.check()
        watch.poll()
        time.sleep(1.0)
    watch.poll()
    wall, after = time.time() - wall0, emulator.stats()
    late = zip(before["feed_late_s"], after["feed_late_s"], strict=True)
    emu = {
        "cores": (after["cpu_s"] - before["cpu_s"]) / wall,
        "feed_cores": (after["feed_cpu_s"] - before["feed_cpu_s"]) / wall,
        "render_cores": (after["render_cpu_s"] - before["render_cpu_s"]) / wall,
        "feed_late_max_s": max((s for a, b in late for s in b[len(a) :]), default=0.0),
        "records": after["records"] - before["records"],
        "wall_s": wall,
        "scrapes": after["scrapes"] - before["scrapes"],
        "rss_mb": after["rss_mb"],
        "workers": args.workers,
        "replicate": args.replicate,
    }
    targets = target_figures(engine.url, duration, job.nodes, split=engine.name == "vm")
    panels = None
    if args.panels:  # while the emulator still feeds and the engine still evaluates
        t = time.perf_counter()
        panels = panel_series(engine.url, measure_from, end, engine.interval)
        print(f"  panel queries run in {time.perf_counter() - t:.0f} s", flush=True)
    ab = None
    if args.ab:  # likewise, on the data the engine holds now
        exprs = [pathlib.Path(path).read_text() for path in args.ab]
        ab = ab_queries(engine.url, exprs, args.ab_rounds)
        print_ab(engine.name, args.ab, ab)
    named = engine.straggler_named(watch, first_scrape, end, intervals)
    straggler_interval = intervals.get(watch.rule_group_of.get(STRAGGLER_LAG, ""), engine.interval)
    return Measured(
        engine.name,
        job,
        watch,
        engine.interval,
        first_scrape,
        settle,
        measure_from,
        end,
        missed_before,
        targets,
        named,
        {t: engine.query_time(t, straggler_interval) for t in named},
        emu,
        rules_sha,
        panels,
        shards,
        ab,
    )


def alike(a: float, b: float) -> bool:
    """Two forms' answers for one series: equal but for the rounding of their different float
    operations (a sum taken in another order; -0 for 0), NaN alike NaN."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12) or (math.isnan(a) and math.isnan(b))


def ab_queries(url: str, exprs: list[str], rounds: int) -> dict[str, Any]:
    """Two forms of one query (--ab), asked alternately `rounds` times each, the order swapped
    every round: each one's wall times and the per-round ratio B / A; and whether the two
    answer alike (the same series, values `alike`), asked once more each round (untimed) at an
    instant a minute back, whose data every engine holds in full (a query at "now" can race a
    write between the two)."""
    api = PrometheusAPI(url, timeout=120)
    times: list[list[float]] = [[], []]
    same = series = 0
    for i in range(rounds):
        for k in (0, 1) if i % 2 == 0 else (1, 0):
            t = time.perf_counter()
            api.instant(exprs[k], at=time.time())
            times[k].append(time.perf_counter() - t)
        settled = time.time() - 60
        answers = [
            {
                tuple(sorted(r["metric"].items())): float(r["value"][1])
                for r in api.instant(e, settled)
            }
            for e in exprs
        ]
        same += answers[0].keys() == answers[1].keys() and all(
            alike(v, answers[1][k]) for k, v in answers[0].items()
        )
        series = len(answers[0])
    return {
        "median_s": [statistics.median(t) for t in times],
        "ratio_median": statistics.median(b / a for a, b in zip(*times, strict=True)),
        "rounds": rounds,
        "same_answers": same,
        "series": series,
    }


def print_ab(engine: str, paths: list[str], ab: dict[str, Any]) -> None:
    a, b = (os.path.basename(p) for p in paths)
    print(
        f"  {engine} --ab: {a} {ab['median_s'][0] * 1e3:.0f} ms, {b} "
        f"{ab['median_s'][1] * 1e3:.0f} ms (medians of {ab['rounds']}); {b} / {a} per round: "
        f"median {ab['ratio_median']:.2f}; same answer in {ab['same_answers']} of "
        f"{ab['rounds']} rounds ({ab['series']} series)",
        flush=True,
    )


def target_figures(url: str, duration: float, nodes: int, split: bool = False) -> dict[str, float]:
    """Every series of the emulated targets (the exporters' own and up/scrape_*), their worst
    scrape time and their lowest up over the last `duration` seconds. `split`: count the
    series 100 nodes at a time (VictoriaMetrics refuses a query that selects more than
    -search.maxUniqueTimeseries, 300,000 by default). A query refused is NaN, and printed."""
    sel = f'instance=~"{NODE_PREFIX}.+"'
    counts = (
        [f'count({{instance=~"{NODE_PREFIX}{h:02d}.+"}})' for h in range((nodes - 1) // 100 + 1)]
        if split
        else [f"count({{{sel}}})"]
    )
    queries = {
        "series": counts,
        "scrape_max_s": [f"max(max_over_time(scrape_duration_seconds{{{sel}}}[{duration:.0f}s]))"],
        "up_min": [f"min(min_over_time(up{{{sel}}}[{duration:.0f}s]))"],
    }
    out = {}
    api = PrometheusAPI(url, timeout=120)
    for name, promqls in queries.items():
        values = []
        for promql in promqls:
            try:
                found = api.instant(promql)
            except (OSError, PrometheusError) as exc:
                print(f"  {promql}: {exc}", flush=True)
                found = [{"value": [0, "nan"]}]
            values += [float(f["value"][1]) for f in found[:1]]
        out[name] = sum(values) if values else float("nan")
    return out


def panel_series(url: str, start: float, end: float, interval: float) -> dict[str, Any]:
    """Every panel query of both dashboards with the job selected and no node or rank (All),
    as Grafana runs them over the measured window: instant queries (tables) at its end, range
    queries every evaluation interval (Grafana's smallest step at the shipped scrape
    interval), $__range the window, $__rate_interval max(step + scrape, 4 scrapes) as Grafana
    has it. Counted by syncscope.lab.render.count_series, as the e2e test does."""
    rate = max(interval + interval, 4 * interval)  # step + scrape, 4 scrapes (both: interval)
    queries = dashboards.panel_queries(
        job=JOB, range_=f"{end - start:.0f}s", rate_interval=f"{rate:.0f}s"
    )
    client = PrometheusAPI(url, timeout=120)
    counted = render.count_series(client, queries, start=start, end=end, step=interval)
    return {
        "range_s": end - start,
        "step_s": interval,
        "rate_interval_s": rate,
        "limit": dashboards.MAX_SERIES,
        "queries": [
            {
                k: c[k]
                for k in ("dashboard", "panel", "ref_id", "instant", "needs", "series", "error")
            }
            for c in counted
        ],
    }


def panel_failures(panels: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The panel queries over MAX_SERIES or not answered."""
    if panels is None:
        return []
    return [q for q in panels["queries"] if q["error"] or (q["series"] or 0) > panels["limit"]]


def print_panels(row: dict[str, Any]) -> None:
    """--panels: how many queries, the most series one returned, every one over the limit or
    failed, and those that returned nothing (with the optional series they need)."""
    panels = row.get("panels")
    if panels is None:
        return
    queries = panels["queries"]

    def name(q: dict[str, Any]) -> str:
        kind = "instant" if q["instant"] else "range"
        short_uid = q["dashboard"].removeprefix("syncscope-")
        return f"{short_uid} / {q['panel']} / {q['ref_id']} ({kind})"

    answered = [q for q in queries if q["error"] is None]
    most = max(answered, key=lambda q: q["series"], default=None)
    empty = [q for q in answered if q["series"] == 0]
    print(
        f"\n{row['nodes']} x {row['ranks_per_node']}: {len(queries)} panel queries (no rank or "
        f"node selected; range {panels['range_s']:.0f} s, step {panels['step_s']:g} s, "
        f"$__rate_interval {panels['rate_interval_s']:g} s); most series "
        + (f"{most['series']}: {name(most)}" if most else "-")
        + f"; over {panels['limit']}: "
        f"{sum(1 for q in answered if q['series'] > panels['limit'])}; failed: "
        f"{len(queries) - len(answered)}; no series: {len(empty)}"
    )
    for q in panel_failures(panels):
        print(f"  {'FAILED' if q['error'] else 'OVER'} {name(q)}: {q['error'] or q['series']}")
    for q in empty:
        print(f"  no series: {name(q)} (needs: {', '.join(q['needs']) or '-'})")


def cores(cpu_s: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds per second between the first and the last sample in [start, end]."""
    inside = [(t, v) for t, v in cpu_s if start <= t <= end]
    if len(inside) < 2:
        return float("nan")
    (t0, v0), (t1, v1) = inside[0], inside[-1]
    return (v1 - v0) / (t1 - t0)


def summarise(m: Measured) -> dict[str, Any]:
    """One size's row: the worst evaluation per group over the measured ones, the series, the
    memory, when the straggler was named, the emulator's CPU."""
    w, job = m.watch, m.job

    def measured(by_eval: dict[float, float]) -> list[float]:
        return [d for ts, d in by_eval.items() if m.measure_from <= ts <= m.end]

    groups = {}
    for name, by_eval in sorted(w.groups.items()):
        durations = measured(by_eval)
        interval = w.intervals.get(name, m.interval)
        groups[name] = {
            "worst_s": max(durations, default=float("nan")),
            "median_s": statistics.median(durations) if durations else float("nan"),
            "interval_s": interval,
            "ratio": max(durations, default=float("nan")) / interval,
            "evaluations": len(durations),
            "missed": w.missed.get(name, 0.0) - m.missed_before.get(name, 0.0),
        }
    rules = sorted(
        ((max(measured(e), default=0.0), name) for name, e in w.rules.items()), reverse=True
    )
    planted = str(job.straggler)
    times = sorted(m.straggler_ranks)
    hit = [t for t in times if m.straggler_ranks[t] == {planted}]
    steady = [t for t in times if m.measure_from <= t <= m.end]
    first = hit[0] if hit else None
    # Once the rate window is full: the evaluations whose queries ask for the first scrape +
    # the window or later (vmalert's ask for their start rounded down to the interval).
    window_full = m.first_scrape + straggler_window()
    full = [t for t in times if m.query_times.get(t, t) >= window_full]
    first_full = next((t for t in full if t in hit), None)
    # from the first naming once the window is full on: whether it stays named
    since = full[full.index(first_full) :] if first_full is not None else []
    processes = {
        name: {
            "rss_bytes": max((v for _, v in p.rss), default=float("nan")),
            "cores": cores(p.cpu_s, m.measure_from, m.end),
        }
        for name, p in sorted(w.processes.items())
    }
    storage = processes.get(STORAGE[m.engine], {"rss_bytes": float("nan"), "cores": float("nan")})
    loss = {
        "measured": increases(w.counters, m.measure_from, m.end),
        "since_first_scrape": increases(w.counters, m.first_scrape, m.end),
        "queued_max_bytes": {
            name: max((v for t, v in q if m.measure_from <= t <= m.end), default=0.0)
            for name, q in w.queued.items()
        },
    }
    return {
        "engine": m.engine,
        "nodes": job.nodes,
        "ranks_per_node": job.per_node,
        "ranks": job.world_size,
        "step_s": job.step_s,
        "lag_s": job.lag_s,
        "interval_s": m.interval,
        "settle_s": m.settle,
        "rules_sha256": m.rules_sha256,
        "duration_s": m.end - m.measure_from,
        "groups": groups,
        "sum_ratio": sum(g["ratio"] for g in groups.values()),
        "head_series": max((v for _, v in w.head_series), default=float("nan")),
        "targets": m.targets,
        "series_per_rank": m.targets["series"] / job.world_size,
        **(
            {
                "prometheus_rss_bytes": storage["rss_bytes"],
                "prometheus_cores": storage["cores"],
            }
            if m.engine == "prometheus"
            else {}
        ),
        "storage_rss_bytes": storage["rss_bytes"],
        "storage_cores": storage["cores"],
        "stack_rss_bytes": sum(p["rss_bytes"] for p in processes.values()),
        "stack_cores": sum(p["cores"] for p in processes.values()),
        "processes": processes,
        "loss": loss,
        "samples_dropped": sum(
            v for k, v in loss["measured"].items() if LOSS_SAMPLES.search(k.split()[1])
        ),
        "shards": m.shards,
        "straggler": {
            "rank": job.straggler,
            "named": first is not None,
            "after_s": first - m.first_scrape if first is not None else None,
            "after_evaluations": times.index(first) + 1 if first is not None else None,
            "measured_share": sum(t in hit for t in steady) / len(steady) if steady else None,
            "window_full_after_s": window_full - m.first_scrape,
            # 1: named at the first evaluation once the window is full
            "after_window_evaluations": full.index(first_full) + 1 if first_full else None,
            "window_full_share": sum(t in hit for t in full) / len(full) if full else None,
            "named_since_share": sum(t in hit for t in since) / len(since) if since else None,
            "by_evaluation": [(t, sorted(m.straggler_ranks[t])) for t in times],
        },
        "emulator": m.emulator,
        "rules_worst_s": {name: d for d, name in rules},
        "evaluations": {g: sorted(e.items()) for g, e in w.groups.items()},
        "failed_polls": w.failed_polls,
        "rule_errors": w.rule_errors,
        "panels": m.panels,
        "ab": m.ab,
    }


def increases(
    counters: dict[str, list[tuple[float, float]]], start: float, end: float
) -> dict[str, float]:
    """How much each counter grew from its last value before `start` (its first, if none) to
    its last by `end`; only those that grew."""
    out = {}
    for key, values in counters.items():
        before = [v for t, v in values if t < start] or [v for t, v in values if t <= end][:1]
        inside = [v for t, v in values if t <= end]
        if before and inside and inside[-1] > before[-1]:
            out[key] = inside[-1] - before[-1]
    return out


def short(group: str) -> str:
    return group.removeprefix("syncscope.")


ENGINE_LABEL = {"prometheus": "prom", "vm": "VM"}


def print_table(rows: list[dict[str, Any]]) -> None:
    """One row per size, per engine; a column per rule group (its worst evaluation over its
    interval). Series, RSS and CPU are the storage's (Prometheus, VictoriaMetrics)."""
    for engine in dict.fromkeys(r.get("engine", "prometheus") for r in rows):
        if engine != "prometheus":
            print(f"engine {engine}:")
        print_engine_table([r for r in rows if r.get("engine", "prometheus") == engine])


def print_engine_table(rows: list[dict[str, Any]]) -> None:
    groups = sorted({g for r in rows for g in r["groups"]})
    width = max([9, *(len(short(g)) for g in groups)])
    label = ENGINE_LABEL[rows[0].get("engine", "prometheus")]
    series = "head series" if label == "prom" else "VM series"
    print(
        f"{'nodes x ranks':>13} {'all groups':>10} "
        + " ".join(f"{short(g):>{width}}" for g in groups)
        + f" {'missed':>6} {series:>11} {'series/rank':>11} {label + ' RSS':>8}"
        f" {label + ' CPU':>8} {'straggler':>9} {'after s (evals)':>15}"
        f" {'emulator cores (feed+render)':>28} {'feed late':>9}"
    )
    for r in rows:
        s, e = r["straggler"], r["emulator"]
        cells = [f"{r['groups'][g]['ratio']:.1%}" if g in r["groups"] else "-" for g in groups]
        named = f"yes {s['measured_share']:.0%}" if s["named"] else "no"
        after = f"{s['after_s']:.0f} ({s['after_evaluations']})" if s["named"] else "-"
        cores = f"{e['cores']:.2f} ({e['feed_cores']:.2f}+{e['render_cores']:.2f})"
        print(
            f"{r['nodes']:>8} x {r['ranks_per_node']:<2} {r['sum_ratio']:>10.1%} "
            + " ".join(f"{c:>{width}}" for c in cells)
            + f" {sum(g['missed'] for g in r['groups'].values()):>6.0f}"
            f" {r['head_series']:>11,.0f} {r['series_per_rank']:>11.1f}"
            f" {r['storage_rss_bytes'] / 2**30:>6.2f} G {r['storage_cores']:>8.2f}"
            f" {named:>9} {after:>15} {cores:>28}"
            f" {e['feed_late_max_s']:>7.1f} s"
        )


def print_side_by_side(prom: dict[str, Any], vm: dict[str, Any]) -> None:
    """--engine both: one size's figures on both engines, and vm over prometheus."""
    gib = 2**30

    def evals(row: dict[str, Any], key: str) -> float:
        value = row["straggler"][key]
        return float("nan") if value is None else float(value)

    lines: list[tuple[str, float, float, str]] = [
        ("rule evaluation, all groups / interval", prom["sum_ratio"], vm["sum_ratio"], "%"),
        *(
            (
                f"  {short(g)} (every {prom['groups'][g]['interval_s']:g} s)",
                prom["groups"][g]["ratio"],
                vm["groups"].get(g, {}).get("ratio", float("nan")),
                "%",
            )
            for g in prom["groups"]
        ),
        (
            "missed iterations",
            sum(g["missed"] for g in prom["groups"].values()),
            sum(g["missed"] for g in vm["groups"].values()),
            ",.0",
        ),
        (
            "series in storage (head / hour_metric_ids)",
            prom["head_series"],
            vm["head_series"],
            ",.0",
        ),
        ("series of the targets", prom["targets"]["series"], vm["targets"]["series"], ",.0"),
        ("storage RSS, GiB", prom["storage_rss_bytes"] / gib, vm["storage_rss_bytes"] / gib, ".2"),
        (
            "every process's RSS, GiB",
            prom["stack_rss_bytes"] / gib,
            vm["stack_rss_bytes"] / gib,
            ".2",
        ),
        ("storage CPU, cores", prom["storage_cores"], vm["storage_cores"], ".2"),
        ("every process's CPU, cores", prom["stack_cores"], vm["stack_cores"], ".2"),
        (
            "straggler named, evaluations after first scrape",
            evals(prom, "after_evaluations"),
            evals(vm, "after_evaluations"),
            ".0",
        ),
        (
            "  ... once its window is full",
            evals(prom, "after_window_evaluations"),
            evals(vm, "after_window_evaluations"),
            ".0",
        ),
        ("samples dropped (measured)", prom["samples_dropped"], vm["samples_dropped"], ",.0"),
    ]
    print(
        f"\n{prom['nodes']} x {prom['ranks_per_node']}, both engines on one emulator"
        f" (prometheus first, then vm):"
    )
    print(f"{'':48} {'prometheus':>12} {'vm':>12} {'vm/prom':>8}")
    for name, a, b, fmt in lines:
        ratio = b / a if a and a == a and b == b else float("nan")
        print(f"{name:48} {cell(a, fmt):>12} {cell(b, fmt):>12} {ratio:>8.2f}")


def cell(value: float, fmt: str) -> str:
    return f"{value:.1%}" if fmt == "%" else f"{value:{fmt}f}"


def print_details(row: dict[str, Any], top: int) -> None:
    e, s, t = row["emulator"], row["straggler"], row["targets"]
    engine = row.get("engine", "prometheus")
    storage = "Prometheus" if engine == "prometheus" else "VictoriaMetrics"
    print(
        f"\n{row['nodes']} x {row['ranks_per_node']}"
        + (f" ({engine})" if engine != "prometheus" else "")
        + f": straggler rank {s['rank']}; settle "
        f"{row['settle_s']:.0f} s, {row['duration_s']:.0f} s measured; worst evaluation per "
        f"group, median (evaluations measured): "
        + ", ".join(
            f"{short(name)} {g['worst_s']:.3f} s, {g['median_s']:.3f} s ({g['evaluations']})"
            for name, g in row["groups"].items()
        )
        + f"; {storage} {row['storage_cores']:.2f} cores; polls of it that timed out: "
        f"{row['failed_polls']}; emulator "
        f"{e['records'] / e['wall_s']:,.0f} records/s ingested, {e['scrapes']:,} scrapes served, "
        f"RSS {e['rss_mb']:,.0f} MB; targets' worst scrape {t['scrape_max_s']:.3f} s, lowest "
        f"up {t['up_min']:.0f}"
    )
    if engine != "prometheus":
        loss = row["loss"]
        print(
            f"targets by shard: {row['shards']}; straggler named at evaluation "
            f"{s['after_window_evaluations'] or '-'} once its window was full "
            f"({s['window_full_after_s']:.0f} s after the first scrape), in "
            + (f"{s['window_full_share']:.0%}" if s["window_full_share"] is not None else "-")
            + " of the evaluations from then on, "
            + (f"{s['named_since_share']:.0%}" if s["named_since_share"] is not None else "-")
            + " from its first naming on"
        )
        print("processes (largest RSS, CPU while measured):")
        for name, p in row["processes"].items():
            print(f"  {name:18} {p['rss_bytes'] / 2**20:9,.0f} MiB {p['cores']:6.2f} cores")
        print(
            f"samples dropped while measured: {row['samples_dropped']:,.0f}; vmagent queue "
            f"(largest {QUEUE_GAUGE} while measured): "
            + (", ".join(f"{k} {v:,.0f} B" for k, v in loss["queued_max_bytes"].items()) or "-")
        )
        for label, grown in (
            ("while measured", loss["measured"]),
            ("since the first scrape", loss["since_first_scrape"]),
        ):
            print(f"loss and error counters that grew {label}: " + ("none" if not grown else ""))
            for key, v in sorted(grown.items()):
                print(f"  {v:12,.0f}  {key}")
    for name, error in row.get("rule_errors", {}).items():
        print(f"  rule error (last seen): {name}: {error}")
    print("slowest rules (worst evaluationTime over the measured evaluations, /api/v1/rules):")
    for name, d in list(row["rules_worst_s"].items())[:top]:
        print(f"  {d * 1e3:9.1f} ms  {name}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="64,256,1024", help="emulated nodes, comma-separated")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="seconds measured after settle (default: 120, at least 3 of the longest interval)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=None,
        help="seconds from the first scrape to the measurement (default: the straggler window + "
        "2 of the longest group interval)",
    )
    p.add_argument("--step-s", type=float, default=1.0, help="the job's step period (wall time)")
    p.add_argument("--feed-s", type=float, default=5.0, help="each rank sends its steps this often")
    p.add_argument(
        "--lag-ms", type=float, default=30.0, help="the straggler's lateness at the sync"
    )
    p.add_argument("--seed", type=int, default=20)
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="emulator processes, the nodes spread over them (one holds a core at 1,024 x 8)",
    )
    p.add_argument(
        "--replicate",
        action="store_true",
        help="feed only node 0 and the straggler's node; every other node serves node 0's "
        "exposition with its own hostname, ranks and GPU UUIDs (sizes this machine cannot feed)",
    )
    p.add_argument(
        "--engine",
        choices=tuple(ENGINE_RUNS),
        default="prometheus",
        help="prometheus: one Prometheus; vm: vmagent shards, VictoriaMetrics, vmalert; both: "
        "prometheus then vm on the same emulator, side by side",
    )
    p.add_argument("--shards", type=int, default=victoriametrics.SHARDS, help="vm: vmagents")
    p.add_argument(
        "--no-pin", dest="pin", action="store_false", help="no CPU for the engine's servers"
    )
    p.add_argument("--top-rules", type=int, default=10)
    p.add_argument("--json", default=None, help="also write every measurement here")
    p.add_argument(
        "--panels",
        action="store_true",
        help=f"after each size's measurement, run every dashboard panel query (no rank "
        f"selected) and fail if one returns more than {dashboards.MAX_SERIES} series or fails",
    )
    p.add_argument(
        "--ab",
        nargs=2,
        metavar=("A", "B"),
        default=None,
        help="after each measurement, ask the engine two files' PromQL alternately (two forms "
        "of one rule's expression) and print their times side by side and whether they agree",
    )
    p.add_argument("--ab-rounds", type=int, default=40, help="--ab: rounds, each asks both")
    a = p.parse_args()
    sizes = [int(n) for n in a.sizes.split(",")]
    # SIGTERM cleans up as Ctrl-C does: the runs' exit stacks stop Prometheus and the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]))
    print(
        f"machine: nproc {os.cpu_count()}, affinity {sorted(os.sched_getaffinity(0))}; "
        f"{'Prometheus' if a.engine == 'prometheus' else 'the engines servers'} pinned to its "
        f"first CPU: {a.pin}"
    )
    print(
        f"job: step every {a.step_s:g} s, each rank's batch every {a.feed_s:g} s, straggler "
        f"(rank nodes/2*{a.ranks_per_node}+3) {a.lag_ms:g} ms late at the gradient sync"
    )
    full = series_per_rank(node_series(a.ranks_per_node, a.seed), a.ranks_per_node)
    health = node_series(a.ranks_per_node, a.seed, GPU_HEALTH_SINCE)
    print(
        f"series per rank, one node with every ring full, counted in process: {full:.2f} "
        f"(target <= {SERIES_PER_RANK_TARGET}); with the GPU health families added since "
        f"({', '.join(GPU_HEALTH_SINCE)}): {series_per_rank(health, a.ranks_per_node):.2f}"
    )
    rows = []
    for nodes in sizes:
        print(f"{nodes} nodes x {a.ranks_per_node} ranks:", flush=True)

        def done(m: Measured) -> None:
            row = summarise(m)
            rows.append(row)
            if a.json:  # after every measurement, so that a later one failing loses nothing
                with open(a.json, "w") as f:
                    json.dump({"argv": sys.argv, "rows": rows}, f, indent=1)
            print_table([row])
            print_panels(row)

        run_size(nodes, a, done)
    print("\n=== summary ===")
    print_table(rows)
    for row in rows:
        print_details(row, a.top_rules)
    if a.engine == "both":
        for i in range(0, len(rows), 2):
            print_side_by_side(rows[i], rows[i + 1])
    for row in rows:
        print_panels(row)
    return 1 if any(panel_failures(row["panels"]) for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
