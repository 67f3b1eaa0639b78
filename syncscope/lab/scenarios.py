"""Fabric scenarios on emulated nodes, shared by the tests (one run each) and the bench (many):
a throttled node's link, and a competing flow between nodes for part of a run.

Each runs one gloo job on 2 emulated nodes × 2 ranks (syncscope.lab.nodes) whose exporters read
the job-wide view back from a real Prometheus with syncscope's rules (or VictoriaMetrics with
vmalert, or both at once), and returns what the rules, the exporters and the dashboards said,
evaluation by evaluation where it matters. Needs root, iproute2 (with tc) and Prometheus (or
VictoriaMetrics); entering raises syncscope.lab.nodes.NodesUnavailable where the kernel refuses.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from syncscope.lab.nodes import EmulatedNodes
from syncscope.lab.servers import Prometheus, VMStack, free_port
from syncscope.monitoring import rules as R
from syncscope.monitoring.dashboards import FABRIC_UID, evaluable_queries
from syncscope.monitoring.prometheus_config import exporter_overrides, local_config
from syncscope.thresholds import load_config, required

WARM_UP_S = 15.0  # gloo connects, the first steps, the rules' first full windows
_ALERTS = load_config().alerts
SLOW_LINK_LINE = required(_ALERTS["SyncscopeSlowLink"].levels[0].threshold, "threshold")
CONTENTION_LINE = required(_ALERTS["SyncscopeFabricContention"].levels[0].threshold, "threshold")
# Both links shaped alike, so that the DDP transfer is the link's (~46 ms a step) and not the
# two shared CPUs' scheduling: unshaped it is ~7 ms, and its 10 s means swung from 5.5 to 12 ms
# within one steady job (measured against the ranks' own records), across the contention line.
EVEN_LINKS_MBIT = {0: 200.0, 1: 200.0}


# What evaluates the rules: one Prometheus, or vmagent shards, VictoriaMetrics and vmalert.
ENGINES = ("prometheus", "vm")


Store = Prometheus | VMStack


@contextlib.contextmanager
def job_wide_nodes(
    workdir: str, alertmanager: str | None = None, engine: str = "prometheus", **kw: Any
) -> Iterator[tuple[EmulatedNodes, Store]]:
    """2 emulated nodes × 2 ranks whose exporters read the job-wide view back (--prometheus-url)
    from the `engine` that scrapes them with syncscope's rules: a real Prometheus, or two
    vmagent shards into VictoriaMetrics with vmalert (servers.VMStack); its alerts go to
    `alertmanager`, host:port, when given."""
    with job_wide_nodes_on(workdir, {engine: alertmanager}, **kw) as (cluster, stores):
        yield cluster, stores[engine]


@contextlib.contextmanager
def job_wide_nodes_on(
    workdir: str, engines: Mapping[str, str | None], **kw: Any
) -> Iterator[tuple[EmulatedNodes, dict[str, Store]]]:
    """`job_wide_nodes` scraped by every engine in `engines` at once (each with its
    Alertmanager, host:port, or None), each in a folder of its own under `workdir` where there
    are several: node i's exporter reads the job-wide view back from the i-th of them, in turn,
    so that one job exercises every engine's rules and read-back."""
    names = list(engines)
    if not names or any(name not in ENGINES for name in names):
        raise ValueError(f"engines {names}: some of {ENGINES}")
    ports = {name: free_port() for name in names}
    dirs = {name: os.path.join(workdir, name) if len(names) > 1 else workdir for name in names}
    for folder in dirs.values():
        os.makedirs(folder, exist_ok=True)
    readback = [
        [
            "--prometheus-url",
            f"http://127.0.0.1:{ports[names[node % len(names)]]}",
            "--prometheus-interval",
            "2",
            *exporter_overrides(),
        ]
        for node in range(2)
    ]
    with contextlib.ExitStack() as stack:
        cluster = stack.enter_context(
            EmulatedNodes(2, 2, workdir=workdir, node_exporter_args=readback, **kw)
        )
        stores = {
            name: start_engine(
                stack,
                name,
                dirs[name],
                cluster.exporter_ports,
                port=ports[name],
                alertmanager=engines[name],
            )
            for name in names
        }
        yield cluster, stores


def start_engine(
    stack: contextlib.ExitStack,
    engine: str,
    workdir: str,
    exporter_ports: Sequence[int],
    *,
    port: int | None = None,
    overrides: Mapping[str, Any] | None = None,
    alertmanager: str | None = None,
) -> Store:
    """`engine` scraping the exporters on 127.0.0.1 at `exporter_ports` with syncscope's rules
    (local_config's short windows, then `overrides`), ready, stopped when `stack` closes; its
    alerts go to `alertmanager`, host:port, when given."""
    if engine == "vm":
        vm = VMStack(workdir, port=port)
        stack.callback(vm.stop)
        vm.evaluate(exporter_ports, overrides, alertmanager=alertmanager)
        return vm
    config = local_config(exporter_ports, workdir, overrides, alertmanager=alertmanager)
    prom = Prometheus(config, workdir, port=port)
    stack.callback(prom.stop)
    prom.wait_ready()
    return prom


def modes(state: dict[str, Any], job: str) -> dict[str, Any]:
    return dict(state["jobs"][job]["diagnosis"]["modes"])


def sample_stragglers(
    cluster: EmulatedNodes,
    job: str,
    ranks: list[Any],
    start: float,
    until: float,
    into: dict[int, list[Any]],
) -> None:
    """Every exporter's straggler verdict once a second from `start` until `until` or the
    job's end, appended to `into` by node: (unix time, the straggler (None: nobody), the
    straggler mode's score and reason)."""
    while time.time() < until and all(r.poll() is None for r in ranks):
        time.sleep(1)
        if time.time() < start:
            continue
        for node, state in enumerate(cluster.states()):
            if job in state["jobs"]:
                diagnosis = state["jobs"][job]["diagnosis"]
                if "warming_up" in diagnosis:  # no verdict yet: not a sample of one
                    continue
                mode = diagnosis["modes"].get("straggler", {})
                into.setdefault(node, []).append(
                    (time.time(), diagnosis["straggler"], mode.get("score"), mode.get("reason"))
                )


def straggler_shares(samples: dict[int, list[Any]]) -> dict[int, tuple[int, int]]:
    """{node: (samples naming a straggler, samples)}."""
    return {
        node: (sum(named is not None for _, named, _, _ in seen), len(seen))
        for node, seen in samples.items()
    }


def nearest_verdicts(samples: dict[int, list[Any]], origin: float, n: int = 4) -> list[str]:
    """The `n` samples closest to naming a straggler (the straggler mode's highest scores; a
    verdict at and over the score line), each with its node, its time from `origin` and the
    reason: the margin of a run that named nobody, and when and why for one that did."""
    ranked = sorted(
        (
            (score or 0.0, t, node, reason)
            for node, seen in samples.items()
            for t, _, score, reason in seen
        ),
        reverse=True,
    )
    return [
        f"node {node} at {t - origin:+.1f} s, score {score:.3f}: {reason}"
        for score, t, node, reason in ranked[:n]
    ]


def slow_link(
    workdir: str, job: str, duration: float = 30.0, engine: str = "prometheus"
) -> dict[str, Any]:
    """Node 1's link shaped to a quarter of node 0's (400 and 100 Mbit/s, tbf at both ends)."""
    return slow_link_on(workdir, job, duration, (engine,))[engine]


def slow_link_on(
    workdir: str, job: str, duration: float = 30.0, engines: Sequence[str] = ENGINES
) -> dict[str, dict[str, Any]]:
    """`slow_link` judged by each of `engines` at once (job_wide_nodes_on), per engine."""
    link_mbit = {0: 400, 1: 100}
    with job_wide_nodes_on(workdir, dict.fromkeys(engines), link_mbit=link_mbit) as (
        cluster,
        stores,
    ):
        started = time.time()
        sampled: dict[int, list[Any]] = {}
        with cluster.running(["--duration", str(duration)], job) as ranks:
            sample_stragglers(cluster, job, ranks, started + WARM_UP_S + 5, started + 300, sampled)
        ended = time.time()
        time.sleep(3)  # the engine has written every evaluation made while the job ran
        states = cluster.states()
        end = time.time()
        exporters = [
            {
                "slow_link": modes(s, job).get("slow_link"),
                "fabric_contention": modes(s, job).get("fabric_contention"),
                "straggler": s["jobs"][job]["diagnosis"]["straggler"],
                "verdict": s["jobs"][job]["diagnosis"].get("verdict"),
            }
            for s in states
        ]
        shared = {
            "straggler_samples": straggler_shares(sampled),
            "straggler_nearest": nearest_verdicts(sampled, started),
            "exporters": exporters,
        }
        return {
            name: {**_slow_link_rules(store, job, started, ended, end), **shared}
            for name, store in stores.items()
        }


def _slow_link_rules(
    store: Store, job: str, started: float, ended: float, end: float
) -> dict[str, Any]:
    """What one engine's rules and the fabric dashboard said of a `slow_link` run."""
    sel = f'{{job="{job}"}}'
    # Judged while the job ran: once it has ended there is no traffic to judge a link by,
    # and the engine's last evaluations may not be written yet (vmalert's remote write).
    slow = store.query_range(
        f"{R.LINK_CAPACITY_RATIO}{sel} < {SLOW_LINK_LINE}", started + WARM_UP_S, ended
    )
    # A page is a firing alert; the first seconds are gloo connecting over the slowed
    # link, as for the slow-link check above.
    straggler_alerts = store.query_range(
        f'ALERTS{{alertname="SyncscopeStraggler",alertstate="firing",job="{job}"}}',
        started + WARM_UP_S,
        end,
    )
    utilisation = {
        r["metric"]["node"]: float(r["value"][1])
        for r in store.query(f"{R.LINK_UTILIZATION}{sel}", at=end - 4)
    }
    empty = [
        f"{q['panel']}: {q['promql']}"
        for q in evaluable_queries(job=job, rate_interval="10s", have={"link"})
        if q["dashboard"] == FABRIC_UID
        and q["expected_data"]
        and not store.query(q["promql"], at=end - 4)
    ]
    expected = {f"job={job},node=node1"}
    named = sum(1 for found in slow.values() if set(found) == expected)
    return {
        "evaluations": len(slow),
        "named_share": named / len(slow) if slow else 0.0,
        # when (s after the job's start) an evaluation named other than node 1, and whom
        "missed": [
            (round(t - started, 1), sorted(f)) for t, f in slow.items() if set(f) != expected
        ],
        "utilisation": utilisation,
        "straggler_alerts": sorted({k for v in straggler_alerts.values() for k in v}),
        "empty_fabric_panels": empty,
    }


def contention_window(
    workdir: str, job: str, before_s: float = 50.0, flow_s: float = 25.0, after_s: float = 35.0
) -> dict[str, Any]:
    """Every link shaped alike (200 Mbit/s); after `before_s` a bulk TCP flow from node 0 to
    node 1 for `flow_s`. The DDP transfer's contention index, evaluation by evaluation."""
    with job_wide_nodes(workdir, link_mbit=EVEN_LINKS_MBIT) as (cluster, prom):
        args = ["--duration", str(before_s + flow_s + after_s)]
        # Every exporter's straggler verdict once a second, before, during and after the flow
        sampled: dict[int, list[Any]] = {}
        with cluster.running(args, job) as ranks:
            started = time.time()
            warm = started + WARM_UP_S + 5
            sample_stragglers(cluster, job, ranks, warm, started + before_s, sampled)
            flow_start = time.time()
            with cluster.competing_flow(0, 1):
                sample_stragglers(cluster, job, ranks, warm, flow_start + flow_s - 5, sampled)
                during = cluster.states()
                sample_stragglers(cluster, job, ranks, warm, flow_start + flow_s, sampled)
            flow_end = time.time()
            sample_stragglers(cluster, job, ranks, warm, flow_end + after_s + 60, sampled)
        time.sleep(2)
        index = prom.query_range(
            f'{R.CONTENTION}{{job="{job}",op="ddp_grad_sync"}}',
            started + WARM_UP_S + 5,
            time.time(),
        )
    flagged = {t: max(v.values(), default=0.0) > CONTENTION_LINE for t, v in index.items()}
    before = [t for t in flagged if t < flow_start]
    while_on = [t for t in flagged if flow_start + 10 <= t <= flow_end]
    after = sorted(t for t in flagged if t > flow_end)
    return {
        "evaluations_before": len(before),
        "flagged_before": sum(flagged[t] for t in before),
        "flagged_while_on_share": (
            sum(flagged[t] for t in while_on) / len(while_on) if while_on else 0.0
        ),
        "detected_s": next(
            (t - flow_start for t in sorted(flagged) if t >= flow_start and flagged[t]), None
        ),
        "cleared_s": next((t - flow_end for t in after if not flagged[t]), None),
        "flagged_30s_after": sum(flagged[t] for t in after if t - flow_end > 30),
        "peak_index": max((max(v.values(), default=0.0) for v in index.values()), default=0.0),
        "straggler_samples": straggler_shares(sampled),
        "straggler_nearest": nearest_verdicts(sampled, flow_start),
        "exporters_during": [
            {
                "fabric_contention": modes(s, job).get("fabric_contention"),
                "straggler": s["jobs"][job]["diagnosis"]["straggler"],
            }
            for s in during
        ],
    }
