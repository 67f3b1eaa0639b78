"""The exporters' read-back load on the engine: what a read cycle of the job-wide view
(exporter/jobwide.py, PrometheusReader, `--prometheus-url`) returns and costs the engine, before
and after the read-back asked only for the node's own jobs and ranks (commit aa1b01e).

bench_scale.py's machinery (its Emulator of N nodes x R ranks, one job with a straggler planted
on rank nodes//2*R+3, and its engines, scale_engines.py) runs the engine with the shipped
configuration and rules (--engine prometheus: one Prometheus pinned to the first CPU;
--engine vm: vmagent shards, VictoriaMetrics, vmalert); this bench waits until the rules record
recorded.LEAD for every rank and recorded.STRAGGLER_LAG for the job (polled every 2 s: the lead
needs every rank to have started a straggler window ago, WINDOW_FULL, so the first comes a
little over that window after the first scrape, 5 min shipped), then measures:

  one cycle   for one emulated node (--node, default the first), the series and bytes a read
              cycle returns: "before", the seven instant queries the reader sent until aa1b01e,
              no matcher at all (BEFORE: every rank's lead, every node's link ratio, every
              job's series), through PrometheusAPI (its received_bytes); "after", a real
              PrometheusReader's read_once() with wanted = {job: Interest(...)} as that node's
              exporter would hold it (reader.last_cycle). The Interest: the node label values
              and process groups of its ranks as Store.interest() finds them in the node's
              store (the node emulated once more in this process, fed as the emulator feeds
              it): the world group, where every emulated collective runs (bench_scale's
              group_facts), read whole up to jobwide.SMALL_GROUP ranks and past that asked
              for by its label and lowest rank (recorded.GROUP_NEXT_HOP); it holds the
              straggler, so the small one needs no read. The
              after-reader must name the planted straggler (JobWide.straggler[0]): asserted.
  load        --readers K threads (default 64), each a PrometheusReader of a different emulated
              node, each --cycles C read cycles (default 5) back to back, started together;
              and the same for "before" with --before-readers threads (default 8: a before
              cycle returns every rank of the job). The emulator runs in --workers forked
              processes (EmulatorPool, default 1), so that this process's threads are the
              readers only: a feeder sharing their interpreter held them off for seconds a
              cycle, and the engine's idle load over the longer window swamped theirs. The engine's CPU (utime + stime of its
              storage process, /proc/<pid>/stat: Prometheus, or VictoriaMetrics which answers
              the queries) over the reads, less its idle rate measured just before over
              --idle-s (default two evaluation intervals): the read window is extended to a
              whole number of evaluation intervals and to at least --idle-s, so that both
              windows hold whole rule evaluations (the engine's idle load is periodic). Per
              cycle: that CPU over the K x C cycles; the wall time of a cycle (median, p95);
              Prometheus's own time in its /api/v1/query handler per cycle (its request
              duration histogram: wall time, waits for the CPU included).
  projection  --exporters E (default 12,500) reading every --interval-s (default 15 s): E /
              interval cycles a second; engine cores = that x CPU per cycle, series/s and
              bytes/s returned the same, before and after. The before cycle's figures grow
              with the job's ranks (every rank's lead), the after cycle's with the node's
              ranks and groups only: the projection holds them at the measured job's size.

--straggler-window overrides the rules' windows.straggler (default: the shipped value) and
--engine-interval the engine's scrape and evaluation interval (default: the shipped 15 s), so
that the lead comes sooner (the unit test: 20s and 5s); the read-back's queries do not change
with either.

Runs above 64 nodes must not overlap other benchmarks:
Run: flock /tmp/syncscope-cpu.lock .venv/bin/python bench/bench_readback.py [--nodes 256]
       [--ranks-per-node 8] [--readers 64] [--cycles 5] [--before-readers 8] [--engine vm]
       [--straggler-window 1m] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import math
import os
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import scale_engines
from bench_scale import JOB, Emulator, EmulatorPool, Job
from scale_engines import Engine, PrometheusEngine, VictoriaMetricsEngine, hostname, pinned
from syncscope.exporter.jobwide import Interest, PrometheusReader

from syncscope import recorded
from syncscope.prometheus_api import PrometheusAPI, PrometheusError

# What a read cycle asked until aa1b01e: seven instant queries, no job or node matcher.
BEFORE = (
    recorded.LEAD,
    recorded.TRANSFER_PER_STEP,
    recorded.SYNC_AMPLIFICATION,
    recorded.TRANSFER_INFLATION,
    recorded.LINK_CAPACITY_RATIO,
    recorded.SYNC_PER_STEP_STAGE_MIN,
    recorded.STEP_MEAN,
)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Cycle:
    """One read cycle: queries sent, series and bytes returned, its wall time, whether it
    succeeded."""

    queries: int
    series: int
    bytes: int
    wall_s: float
    ok: bool = True


def before_cycle(api: PrometheusAPI) -> Cycle:
    """The read-back as it was: every BEFORE name, unmatched."""
    received, t = api.received_bytes, time.perf_counter()
    try:
        series = sum(len(api.instant(name)) for name in BEFORE)
    except (OSError, ValueError, PrometheusError):
        return Cycle(len(BEFORE), 0, api.received_bytes - received, time.perf_counter() - t, False)
    return Cycle(len(BEFORE), series, api.received_bytes - received, time.perf_counter() - t)


def after_cycle(reader: PrometheusReader) -> Cycle:
    """The read-back as it is: one real read_once()."""
    t = time.perf_counter()
    ok = reader.read_once()
    queries, series, received = reader.last_cycle
    return Cycle(queries, series, received, time.perf_counter() - t, ok)


def per_query(
    reader: PrometheusReader, pid: int, repeats: int, idle_s: float
) -> dict[str, dict[str, float]]:
    """Each query of a fresh read cycle (PrometheusReader.last_queries) sent `repeats` times
    back to back: its length, and the engine's CPU and wall time per query, the CPU less the
    engine's idle rate measured over `idle_s` just before."""
    reader.read_once()
    queries = reader.last_queries
    idle_rate = idle_cores(pid, idle_s)
    out = {}
    for name, promql in queries.items():
        cpu1, t1 = cpu_seconds(pid), time.monotonic()
        for _ in range(repeats):
            reader.api.instant(promql)
        wall = time.monotonic() - t1
        cpu = cpu_seconds(pid) - cpu1 - idle_rate * wall
        out[name] = {"chars": len(promql), "cpu_s": cpu / repeats, "wall_s": wall / repeats}
    return out


def interest_of(job: Job, node: int, feed_s: float, seed: int) -> Interest:
    """What node `node`'s exporter holds for the job: the node's Store.interest() (the node
    emulated once more in this process, fed as the emulator's, its server closed at once)."""
    emulator = Emulator(job, feed_s, seed, nodes=[node])
    try:
        emulator.feed_all()
        held = emulator.nodes[node].store.interest().get(JOB)
    finally:
        emulator.server.server_close()
    if held is None:
        raise RuntimeError(f"{hostname(node)}'s store holds no job {JOB}")
    return held


def query_seconds(url: str) -> float | None:
    """Prometheus's own time answering /api/v1/query, in all (its request duration
    histogram's sum); None for an engine without it."""
    text = scale_engines.get_text(url + "/metrics")
    for name, labels, value in scale_engines.samples(text):
        if (
            name == "prometheus_http_request_duration_seconds_sum"
            and labels.get("handler") == "/api/v1/query"
        ):
            return value
    return None


def cpu_seconds(pid: int) -> float:
    """A process's utime + stime (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def idle_cores(pid: int, idle_s: float) -> float:
    """The engine's CPU rate (cores) over the next `idle_s` seconds, while nobody reads."""
    cpu0 = cpu_seconds(pid)
    time.sleep(idle_s)
    return (cpu_seconds(pid) - cpu0) / idle_s


def storage_pid(engine: Engine) -> int:
    """The process that answers the queries: Prometheus, or VictoriaMetrics."""
    if isinstance(engine, PrometheusEngine):
        return int(engine.prom.proc.pid)
    assert isinstance(engine, VictoriaMetricsEngine)
    return int(engine.vm.proc.pid)


def wait_for_rules(url: str, job: Job, timeout: float, check: Callable[[], None]) -> float:
    """Poll until the rules record a lead for every rank of the job and its straggler; the
    seconds waited."""
    api = PrometheusAPI(url, timeout=30)
    t0 = time.monotonic()
    leads = stragglers = 0
    while time.monotonic() - t0 < timeout:
        check()
        with contextlib.suppress(OSError, ValueError, PrometheusError):
            found = api.instant(f'count({recorded.LEAD}{{job="{JOB}"}})')
            leads = int(float(found[0]["value"][1])) if found else 0
            stragglers = len(api.instant(f'{recorded.STRAGGLER_LAG}{{job="{JOB}"}}'))
            if leads == job.world_size and stragglers:
                return time.monotonic() - t0
        time.sleep(2.0)
    raise TimeoutError(
        f"after {timeout:.0f} s the rules record {leads} of {job.world_size} leads and "
        f"{stragglers} straggler series"
    )


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def load(
    cycle: Callable[[int], Cycle],
    readers: int,
    cycles: int,
    pid: int,
    idle_s: float,
    interval: float,
    url: str,
) -> dict[str, Any]:
    """`readers` threads, thread i calling cycle(i) `cycles` times, started together; the
    engine's CPU over them less its idle rate just before (see the module's docstring)."""
    idle_rate = idle_cores(pid, idle_s)
    done: list[list[Cycle]] = [[] for _ in range(readers)]
    start = threading.Barrier(readers + 1)

    def run(i: int) -> None:
        start.wait()
        for _ in range(cycles):
            done[i].append(cycle(i))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(readers)]
    for thread in threads:
        thread.start()
    asked0 = query_seconds(url)
    start.wait()
    cpu1, t1 = cpu_seconds(pid), time.monotonic()
    for thread in threads:
        thread.join()
    reads_s = time.monotonic() - t1
    window = max(idle_s, math.ceil(reads_s / interval - 1e-9) * interval)
    time.sleep(max(0.0, t1 + window - time.monotonic()))
    window = time.monotonic() - t1
    cpu = cpu_seconds(pid) - cpu1
    asked1 = query_seconds(url)
    every = [c for per in done for c in per]
    ok = [c for c in every if c.ok]
    extra = cpu - idle_rate * window
    return {
        "readers": readers,
        "cycles_each": cycles,
        "cycles": len(every),
        "failed": len(every) - len(ok),
        "reads_s": reads_s,
        "window_s": window,
        "idle_s": idle_s,
        "idle_cores": idle_rate,
        "cpu_s": cpu,
        "extra_cpu_s": extra,
        "cpu_per_cycle_s": extra / len(ok) if ok else float("nan"),
        "cycles_per_s": len(ok) / reads_s if reads_s > 0 else float("nan"),
        "series_per_cycle": statistics.mean(c.series for c in ok) if ok else float("nan"),
        "bytes_per_cycle": statistics.mean(c.bytes for c in ok) if ok else float("nan"),
        "queries_per_cycle": statistics.mean(c.queries for c in ok) if ok else float("nan"),
        "wall_median_s": statistics.median(c.wall_s for c in ok) if ok else float("nan"),
        "wall_p95_s": percentile([c.wall_s for c in ok], 0.95),
        # the engine's own time answering, per cycle (Prometheus: wall time in its handler)
        "engine_query_s_per_cycle": (
            (asked1 - asked0) / len(every)
            if asked0 is not None and asked1 is not None and every
            else None
        ),
    }


def projection(
    series: float, received: float, cpu_per_cycle: float, exporters: int, interval: float
) -> dict[str, float]:
    rate = exporters / interval
    return {
        "cycles_per_s": rate,
        "engine_cores": rate * cpu_per_cycle,
        "series_per_s": rate * series,
        "bytes_per_s": rate * received,
    }


def reader_for(url: str, interest: Interest, timeout: float) -> PrometheusReader:
    wanted = {JOB: interest}
    return PrometheusReader(url, timeout_s=timeout, wanted=lambda: wanted)


@contextlib.contextmanager
def rule_overrides(overrides: dict[str, Any]) -> Iterator[None]:
    """The engines' rules written with `overrides` (thresholds paths) while this lasts: both
    engines write theirs when constructed (scale_engines: write_rules, engines.write_rules)."""
    if not overrides:
        yield
        return
    saved = scale_engines.write_rules, scale_engines.engines.write_rules

    def prometheus_rules(out_dir: Any, extra: Any = None) -> Any:
        return saved[0](out_dir, {**overrides, **(extra or {})})

    def engine_rules(out_dir: Any, extra: Any = None, engine: str = "prometheus") -> Any:
        return saved[1](out_dir, {**overrides, **(extra or {})}, engine)

    scale_engines.write_rules = prometheus_rules  # type: ignore[assignment]
    scale_engines.engines.write_rules = engine_rules  # type: ignore[assignment]
    try:
        yield
    finally:
        scale_engines.write_rules, scale_engines.engines.write_rules = saved


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Emulator, engine, wait for the rules, then the measurements; everything stopped after.
    Raises AssertionError where the after-reader does not name the planted straggler."""
    cpus = set(os.sched_getaffinity(0))
    engine_cpus = {min(cpus)} if args.pin and len(cpus) > 1 else None
    emulator_cpus = None if engine_cpus is None else cpus - engine_cpus
    overrides = {"windows.straggler": args.straggler_window} if args.straggler_window else {}
    out: dict[str, Any] = {"argv": sys.argv, "overrides": overrides}
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-bench-readback-")
        stack.callback(shutil.rmtree, workdir, True)
        job = Job(
            args.nodes,
            args.ranks_per_node,
            args.step_s,
            args.lag_ms / 1e3,
            time.time() - args.feed_s,
        )
        out["job"] = {
            "nodes": job.nodes,
            "ranks_per_node": job.per_node,
            "ranks": job.world_size,
            "straggler": job.straggler,
        }
        t = time.perf_counter()
        # The emulator in processes of its own: this one's threads are the readers only (the
        # feeder sharing their interpreter held them off for seconds a cycle).
        emulator = EmulatorPool(job, args.feed_s, args.seed, args.workers, args.replicate)
        stack.callback(emulator.close)
        emulator.feed_all()
        say(f"{job.nodes} x {job.per_node} ranks fed once in {time.perf_counter() - t:.1f} s")
        gc.collect()
        gc.freeze()
        engine: Engine
        with rule_overrides(overrides):
            if args.engine == "prometheus":
                engine = PrometheusEngine(
                    emulator.ports, os.path.join(workdir, "prom"), engine_cpus, args.engine_interval
                )
            else:
                engine = VictoriaMetricsEngine(
                    emulator.ports,
                    os.path.join(workdir, "vm"),
                    engine_cpus,
                    args.shards,
                    args.engine_interval,
                )
        stack.callback(engine.stop)
        stack.enter_context(pinned(emulator_cpus))  # the emulator's threads and the readers
        emulator.start(emulator_cpus)
        engine.wait_ready(120)
        t0 = time.monotonic()
        while emulator.stats()["first_scrape"] is None:
            emulator.check()
            time.sleep(0.2)
        say(
            f"{engine.name}: first scrape {time.monotonic() - t0:.0f} s after ready; waiting for "
            f"the lead of every rank and the straggler (straggler window "
            f"{args.straggler_window or 'shipped'})"
        )
        waited = wait_for_rules(engine.url, job, args.wait_timeout, emulator.check)
        out["rules_after_s"] = waited
        say(f"  leads and straggler recorded {waited:.0f} s after the first scrape")
        pid = storage_pid(engine)

        # One node's cycle, before and after.
        interest = interest_of(job, args.node, args.feed_s, args.seed)
        out["interest"] = {
            "node": args.node,
            "nodes": sorted(interest.nodes),
            "groups": len(interest.groups),
            "group_sizes": sorted(len(g) for g in interest.groups),
            "large": sorted(interest.large),
        }
        before = before_cycle(PrometheusAPI(engine.url, timeout=args.timeout))
        reader = reader_for(engine.url, interest, args.timeout)
        after = after_cycle(reader)
        named = None
        deadline = time.monotonic() + 3 * engine.interval
        while True:  # a reading that names nobody yet is read again, for a few evaluations
            reading = reader.get(JOB)
            named = reading.straggler[0] if reading and reading.straggler else None
            if named is not None or time.monotonic() > deadline:
                break
            time.sleep(2.0)
            after = after_cycle(reader)
        out["one_cycle"] = {
            "before": vars(before),
            "after": vars(after),
            "series_ratio": before.series / after.series if after.series else float("nan"),
            "bytes_ratio": before.bytes / after.bytes if after.bytes else float("nan"),
            "straggler_named": named,
            "straggler_planted": job.straggler,
            # the recorded next hop of each large group (recorded.GROUP_NEXT_HOP)
            "hops": {g: dict(h) for g, h in reading.hops.items()} if reading else {},
            "local_leads": sorted(
                r for r in (reading.leads if reading else {}) if r // job.per_node == args.node
            ),
        }
        if args.per_query:
            say(f"  each query of a cycle x {args.per_query}")
            out["per_query"] = per_query(
                reader, pid, args.per_query, args.idle_s or 2 * engine.interval
            )
        if args.readers or args.before_readers:
            # Readers of different nodes (node n's exporter reads for node n).
            picks = [n % job.nodes for n in range(args.node, args.node + max(args.readers, 1))]
            # every node's ranks are in the same groups (the world, the data-parallel ones)
            readers = [
                reader_for(
                    engine.url,
                    dataclasses.replace(interest, nodes=frozenset({hostname(n)})),
                    args.timeout,
                )
                for n in picks
            ]
            apis = [
                PrometheusAPI(engine.url, timeout=args.timeout) for _ in range(args.before_readers)
            ]
            if args.readers:
                say(f"  load: {args.readers} after-readers x {args.cycles} cycles")
                out["after_load"] = load(
                    lambda i: after_cycle(readers[i]),
                    args.readers,
                    args.cycles,
                    pid,
                    args.idle_s or 2 * engine.interval,
                    engine.interval,
                    engine.url,
                )
            if args.before_readers:
                say(f"  load: {args.before_readers} before-readers x {args.before_cycles} cycles")
                out["before_load"] = load(
                    lambda i: before_cycle(apis[i]),
                    args.before_readers,
                    args.before_cycles,
                    pid,
                    args.idle_s or 2 * engine.interval,
                    engine.interval,
                    engine.url,
                )
        out["engine"] = engine.name
        out["interval_s"] = engine.interval
    out["projection"] = {
        "exporters": args.exporters,
        "interval_s": args.interval_s,
        **{
            side: projection(
                out["one_cycle"][side]["series"],
                out["one_cycle"][side]["bytes"],
                out.get(f"{side}_load", {}).get("cpu_per_cycle_s", float("nan")),
                args.exporters,
                args.interval_s,
            )
            for side in ("before", "after")
        },
    }
    return out


def say(text: str) -> None:
    print(text, flush=True)


def human(n: float, unit: str = "") -> str:
    if n != n:
        return "-"
    for scale, prefix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {prefix}{unit}"
    return f"{n:,.1f} {unit}".rstrip()


def print_figures(out: dict[str, Any]) -> None:
    j, one, p = out["job"], out["one_cycle"], out["projection"]
    b, a = one["before"], one["after"]
    print(
        f"\n=== read-back load, {out['engine']}: {j['nodes']} x {j['ranks_per_node']} = "
        f"{j['ranks']:,} ranks, straggler rank {j['straggler']} ==="
    )
    if out["overrides"]:
        print(f"rules overridden: {out['overrides']}")
    i = out["interest"]
    print(
        f"node {i['node']}'s interest (Store.interest()): nodes {i['nodes']}, "
        f"{i['groups']} groups read whole, of {sorted(set(i['group_sizes']))} ranks; "
        f"{len(i['large'])} by label and lowest rank: {i['large']}"
    )
    print(f"{'one cycle, node ' + str(i['node']):34} {'queries':>8} {'series':>8} {'bytes':>11}")
    for label, c in (("before (7 unmatched)", b), ("after (PrometheusReader)", a)):
        print(f"{label:34} {c['queries']:>8} {c['series']:>8,} {c['bytes']:>11,}")
    print(f"{'before / after':34} {'':>8} {one['series_ratio']:>8.1f} {one['bytes_ratio']:>11.1f}")
    print(
        f"straggler named by the after-reader: {one['straggler_named']} (planted "
        f"{one['straggler_planted']}); its node's ranks with a lead: {one['local_leads']}"
    )
    for side in ("after", "before"):
        ld = out.get(f"{side}_load")
        if ld is None:
            continue
        print(
            f"{side} load: {ld['readers']} readers x {ld['cycles_each']} cycles = {ld['cycles']} "
            f"({ld['failed']} failed) in {ld['reads_s']:.1f} s ({ld['cycles_per_s']:.1f}/s; "
            f"cycle median {ld['wall_median_s'] * 1e3:.0f} ms, p95 {ld['wall_p95_s'] * 1e3:.0f} "
            f"ms); engine CPU {ld['cpu_s']:.2f} s over {ld['window_s']:.0f} s, idle "
            f"{ld['idle_cores']:.3f} cores (over {ld['idle_s']:.0f} s before): "
            f"{ld['extra_cpu_s']:.2f} s for the reads, {ld['cpu_per_cycle_s'] * 1e3:.2f} ms a cycle"
            + (
                f"; its own time answering: {ld['engine_query_s_per_cycle'] * 1e3:.2f} ms a cycle"
                if ld["engine_query_s_per_cycle"] is not None
                else ""
            )
        )
    for name, q in out.get("per_query", {}).items():
        print(
            f"query {name[:48]:48} {q['chars']:>7,} chars: engine CPU "
            f"{q['cpu_s'] * 1e3:6.2f} ms, wall {q['wall_s'] * 1e3:6.2f} ms a query"
        )
    print(
        f"\nprojection: {p['exporters']:,} exporters each reading every {p['interval_s']:g} s "
        f"({p['after']['cycles_per_s']:,.0f} cycles/s), per-cycle figures of this "
        f"{j['nodes']} x {j['ranks_per_node']} job:"
    )
    print(f"{'':10} {'CPU/cycle':>10} {'engine cores':>13} {'series/s':>12} {'bytes/s':>12}")
    for side in ("before", "after"):
        ld = out.get(f"{side}_load", {})
        q = p[side]
        print(
            f"{side:10} {ld.get('cpu_per_cycle_s', float('nan')) * 1e3:>7.2f} ms "
            f"{q['engine_cores']:>13.2f} {human(q['series_per_s']):>12} "
            f"{human(q['bytes_per_s'], 'B'):>12}"
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=256, help="emulated nodes")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--node", type=int, default=0, help="the node whose cycle is measured")
    p.add_argument("--readers", type=int, default=64, help="after-readers at once (0: none)")
    p.add_argument("--cycles", type=int, default=5, help="read cycles per after-reader")
    p.add_argument("--before-readers", type=int, default=8, help="before-readers (0: none)")
    p.add_argument("--before-cycles", type=int, default=5, help="read cycles per before-reader")
    p.add_argument(
        "--idle-s", type=float, default=None, help="idle window (default 2 evaluation intervals)"
    )
    p.add_argument("--timeout", type=float, default=30.0, help="a query's timeout, seconds")
    p.add_argument(
        "--per-query", type=int, default=0, help="time each query of a cycle N times (0: not)"
    )
    p.add_argument("--exporters", type=int, default=12_500, help="projection: exporters")
    p.add_argument("--interval-s", type=float, default=15.0, help="projection: their interval")
    p.add_argument(
        "--straggler-window",
        default=None,
        help="override the rules' windows.straggler (e.g. 1m: the lead comes sooner)",
    )
    p.add_argument(
        "--engine-interval",
        default=None,
        help="the engine scrapes and evaluates this often, e.g. 5s (default: shipped)",
    )
    p.add_argument("--wait-timeout", type=float, default=900.0, help="for the rules, seconds")
    p.add_argument("--step-s", type=float, default=1.0)
    p.add_argument("--feed-s", type=float, default=5.0)
    p.add_argument("--lag-ms", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--workers", type=int, default=1, help="emulator processes (forked)")
    p.add_argument(
        "--replicate",
        action="store_true",
        help="feed only node 0 and the straggler's node; every other node serves node 0's "
        "exposition with its own identity (bench_scale --replicate: sizes one core cannot feed)",
    )
    p.add_argument("--engine", choices=("prometheus", "vm"), default="prometheus")
    p.add_argument("--shards", type=int, default=2, help="vm: vmagent shards")
    p.add_argument("--no-pin", dest="pin", action="store_false")
    p.add_argument("--json", default=None, help="write every figure here")
    return p.parse_args(argv)


def main() -> int:
    a = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print("command:", " ".join([os.path.basename(sys.executable), *sys.argv]), flush=True)
    out = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    print_figures(out)
    one = out["one_cycle"]
    assert one["straggler_named"] == one["straggler_planted"], (
        f"the after-reader names rank {one['straggler_named']}, the straggler is "
        f"{one['straggler_planted']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
