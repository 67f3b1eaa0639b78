"""Exporter performance, measured in one run against a real exporter process on 127.0.0.1.

Prints:
  ingest     records/s over HTTP (keep-alive, 8 ranks, agent-sized batches in wire schema 2,
             as the agent sends them; in-process, schema 1 alongside), and records per
             CPU-second of the exporter process (its utime+stime from /proc), i.e. on one core.
             The exporter is pinned to one CPU and the client to another when there are two.
             Target: >= 20,000 records/s on one core.
  scrape     /metrics latency p50/p99 with 8 ranks and the full metric set (phases, four
             collective ops, pacing, topology, diagnosis), idle and while the 8 ranks keep
             reporting at the agent's rate. Target: p99 <= 20 ms.
  rss        exporter RSS while 1,000,000 records go in: after warm-up (first 100k), at the
             end, and the growth in between. Target: flat within 10 %, <= 150 MB.
  scaling    with --ranks-scaling 8,64,512 (instead of the above): ingest CPU per record of the
             real Store, in-process, for one job of 8, 64 and 512 ranks on one exporter, side by
             side in one run. Each rank sends agent-sized batches (50 steps, a ddp_grad_sync per
             step), all ranks once per round in a shuffled order, steps advancing. Batches are
             parsed as the app parses them (app.parse_batch) before timing; the thread CPU time
             of Store.ingest alone is measured, sizes interleaved over several rounds, medians
             printed. Target: flat within 2x (largest / smallest).
Run: .venv/bin/python bench/bench_exporter.py [--records 1000000] [--scrapes 500]
     .venv/bin/python bench/bench_exporter.py --ranks-scaling 8,64,512 [--scaling-rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import http.client
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import threading
import time
from typing import Any

from syncscope.lab import servers

PHASES = ("data", "forward", "backward", "optimizer", "comm_exposed", "pacing", "other")
RANKS = 8
STEPS_PER_BATCH = 50  # a 10 ms step flushed every 0.5 s: twice the agent's default rate
OPS = (
    ("ddp_grad_sync", 25e6, 0.004),
    ("all_reduce", 4096.0, 0.0004),
    ("all_gather", 1 << 20, 0.001),
    ("broadcast", 8.0, 0.0002),
)


def batch(
    rank: int,
    step0: int,
    rng: random.Random,
    wire: int = 2,
    world_size: int = RANKS,
    job: str = "bench",
) -> bytes:
    """One agent-sized batch in wire schema `wire` (2: rows of ns, what the agent sends)."""
    steps, colls = [], []
    for s in range(step0, step0 + STEPS_PER_BATCH):
        d = 0.010 + rng.random() * 0.002
        steps.append((s, d))
        op, nbytes, base = OPS[s % 2] if s % 10 else OPS[2 + (s // 10) % 2]
        ddp = OPS[0]
        colls.append((ddp[0], ddp[1], ddp[2] + rng.random() * 0.003 * (rank != 3), s))
        if op != "ddp_grad_sync":
            colls.append((op, nbytes, base + rng.random() * 1e-4, s))
    if wire == 2:
        step_records: list = []
        for s, d in steps:
            share = round(d * 1e9 / len(PHASES))
            step_records.append([s, s * 10**7, round(d * 1e9), *[share] * (len(PHASES) - 1)])
        coll_records: list = [
            [op, "default_pg", int(nbytes), round(dur * 1e9), s] for op, nbytes, dur, s in colls
        ]
    else:
        step_records = [
            {
                "step": s,
                "duration_s": d,
                "end_unix_s": 1.7e9 + s * 0.01,
                "phases": {p: d / len(PHASES) for p in PHASES},
            }
            for s, d in steps
        ]
        coll_records = [
            {"op": op, "group": "default_pg", "bytes": nbytes, "duration_s": dur, "step": s}
            for op, nbytes, dur, s in colls
        ]
    body = {
        "schema_version": wire,
        "agent": {
            "job": job,
            "rank": rank,
            "local_rank": rank,
            "world_size": world_size,
            "incarnation": f"inc-{rank}",
            "hostname": "node-0",
            "pid": 1000 + rank,
            "started_unix_s": 1.7e9,
        },
        "dropped_total": 0,
        "steps": step_records,
        "collectives": coll_records,
        "pacing": {
            "enabled": True,
            "active": rank != 3,
            "current_delay_s": 0.001,
            "threshold_s": 0.002,
            "engagements": 3,
            "total_delay_s": 0.5,
        },
        "topology": {
            "gpu_uuid": f"GPU-{rank}",
            "pcie_link_width": 16,
            "pcie_link_max_width": 16,
            "pcie_link_generation": 5,
            "pcie_link_max_generation": 5,
            "numa_node": rank // 4,
        },
    }
    if wire == 2:
        body["clock_offset_ns"] = 1_700_000_000 * 10**9
    return json.dumps(body).encode()


def records_in(body: bytes) -> int:
    b = json.loads(body)
    return len(b["steps"]) + len(b["collectives"])


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Client:
    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def post(self, body: bytes) -> None:
        self.conn.request("POST", "/v1/ingest", body, {"Content-Type": "application/json"})
        r = self.conn.getresponse()
        payload = r.read()
        if r.status != 200:
            raise RuntimeError(f"ingest refused: {r.status} {payload[:200]!r}")

    def get(self, path: str) -> bytes:
        self.conn.request("GET", path)
        r = self.conn.getresponse()
        return r.read()


def start_exporter(port: int, cpu: int | None) -> subprocess.Popen:
    """The real exporter (never expiring ranks during the bench), pinned to one core."""
    proc = servers.start_exporter(
        port,
        ["--expire-after", "86400", "--stale-after", "86400"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    if cpu is not None:
        os.sched_setaffinity(proc.pid, {cpu})
    return proc


def bench_ingest(port: int, pid: int, bodies: list[list[bytes]], seconds: float) -> dict:
    client = Client(port)
    n_rec = [[records_in(b) for b in per_rank] for per_rank in bodies]
    sent = 0
    cpu0, t0 = cpu_seconds(pid), time.perf_counter()
    i = 0
    while time.perf_counter() - t0 < seconds:
        rank = i % RANKS
        k = (i // RANKS) % len(bodies[rank])
        client.post(bodies[rank][k])
        sent += n_rec[rank][k]
        i += 1
    wall = time.perf_counter() - t0
    cpu = cpu_seconds(pid) - cpu0
    return {"records": sent, "requests": i, "wall_s": wall, "cpu_s": cpu}


def bench_scrape(port: int, n: int, ingest_port: int | None, bodies: list[list[bytes]]) -> dict:
    stop = threading.Event()

    def background_ingest() -> None:
        # The 8 ranks keep reporting: one batch per rank every 0.5 s (the default is 1 s).
        c = Client(ingest_port)  # type: ignore[arg-type]
        k = 0
        while not stop.is_set():
            t = time.perf_counter()
            for rank in range(RANKS):
                c.post(bodies[rank][k % len(bodies[rank])])
            k += 1
            stop.wait(max(0.0, 0.5 - (time.perf_counter() - t)))

    thread = None
    if ingest_port is not None:
        thread = threading.Thread(target=background_ingest, daemon=True)
        thread.start()
    client = Client(port)
    size = len(client.get("/metrics"))
    times = []
    for _ in range(n):
        t = time.perf_counter()
        client.get("/metrics")
        times.append(time.perf_counter() - t)
        time.sleep(0.005)
    stop.set()
    if thread is not None:
        thread.join(5)
    times.sort()
    return {
        "p50_ms": statistics.median(times) * 1e3,
        "p99_ms": times[int(0.99 * (len(times) - 1))] * 1e3,
        "max_ms": times[-1] * 1e3,
        "bytes": size,
    }


def bench_rss(port: int, pid: int, bodies: list[list[bytes]], total: int) -> dict:
    client = Client(port)
    n_rec = [[records_in(b) for b in per_rank] for per_rank in bodies]
    samples: list[tuple[int, float]] = [(0, rss_mb(pid))]
    sent, i, next_sample = 0, 0, 100_000
    t0 = time.perf_counter()
    while sent < total:
        rank = i % RANKS
        k = (i // RANKS) % len(bodies[rank])
        client.post(bodies[rank][k])
        sent += n_rec[rank][k]
        i += 1
        if sent >= next_sample:
            samples.append((sent, rss_mb(pid)))
            next_sample += 100_000
    return {"samples": samples, "wall_s": time.perf_counter() - t0}


def bench_in_process(bodies: list[list[bytes]], seconds: float) -> float:
    """Parse + validate + store, no HTTP: the ceiling of what one core can ingest."""
    from syncscope.exporter.app import parse_batch
    from syncscope.exporter.settings import Settings
    from syncscope.exporter.store import Store

    store = Store(Settings())
    flat = [b for per_rank in zip(*bodies, strict=False) for b in per_rank]
    n_rec = [records_in(b) for b in flat]
    sent, i = 0, 0
    t0 = time.thread_time()
    while time.thread_time() - t0 < seconds:
        store.ingest(parse_batch(flat[i % len(flat)]))
        sent += n_rec[i % len(flat)]
        i += 1
    return sent / (time.thread_time() - t0)


class ScalingJob:
    """One Store with one job of `ranks` ranks, fed round after round with wire batches."""

    def __init__(self, ranks: int, rng: random.Random) -> None:
        from syncscope.exporter.settings import Settings
        from syncscope.exporter.store import Store

        self.ranks = ranks
        self.store = Store(Settings(max_ranks=max(4096, ranks)))
        self.rng = rng
        self.round = 0

    def next_round(self) -> list[bytes]:
        """Every rank's next batch (steps advancing by STEPS_PER_BATCH), in a shuffled order."""
        step0 = self.round * STEPS_PER_BATCH
        order = list(range(self.ranks))
        self.rng.shuffle(order)
        self.round += 1
        job = f"scaling-{self.ranks}"
        return [batch(r, step0, self.rng, world_size=self.ranks, job=job) for r in order]

    def run(self, rounds: int) -> tuple[int, float, float]:
        """Feed `rounds` rounds as the app does (parse_batch, then Store.ingest); return the
        records and the thread CPU seconds spent in each."""
        from syncscope.exporter.app import parse_batch

        records, parse_s, store_s = 0, 0.0, 0.0
        clock, ingest = time.thread_time, self.store.ingest
        for _ in range(rounds):
            for body in self.next_round():
                t0 = clock()
                parsed = parse_batch(body)
                t1 = clock()
                if not ingest(parsed)["accepted"]:
                    raise RuntimeError("ingest refused")
                t2 = clock()
                parse_s += t1 - t0
                store_s += t2 - t1
                records += len(parsed.steps) + len(parsed.collectives)
        return records, parse_s, store_s


def _scaling_worker(ranks: int, chunk: int, seed: int, conn: Any) -> None:
    """One exporter's Store with `ranks` ranks, in a process of its own (its own heap, as on a
    node): set up and warmed, then one chunk of `chunk` rounds per request from the parent."""
    job = ScalingJob(ranks, random.Random(seed))
    gc.collect()
    gc.freeze()  # as the exporter's app does once started (exporter/app.py)
    # Warm-up: every rank known, its recent steps full (they are kept, not evicted, until then).
    job.run(max(chunk, -(-job.store.settings.recent_steps // STEPS_PER_BATCH) + 2))
    gc_s, started = [0.0, 0], [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.thread_time()
        else:
            gc_s[0] += time.thread_time() - started[0]
            gc_s[1] += info["generation"] == 2

    gc.callbacks.append(on_gc)
    conn.send("ready")
    while conn.recv():
        gc_s[:] = [0.0, 0]
        records, parse_s, store_s = job.run(chunk)
        conn.send((records, parse_s, store_s, gc_s[0], gc_s[1]))
    conn.close()


def bench_ranks_scaling(sizes: list[int], rounds: int, records: int) -> None:
    """Ingest CPU per record at each size: a worker process per size, driven one at a time in
    interleaved rounds (alternating order). Per record: total CPU over total records, so that
    full collections, one every few rounds at 512 ranks, count at their amortised cost."""
    ctx = multiprocessing.get_context("fork")
    per_batch = records_in(batch(0, 0, random.Random(1)))
    chunk = {n: max(1, round(records / (n * per_batch))) for n in sizes}
    workers = {}
    for n in sizes:
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_scaling_worker, args=(n, chunk[n], 11, child), daemon=True)
        proc.start()
        workers[n] = (proc, parent)
    # Per size: records, then CPU seconds in parse_batch, Store.ingest and the collector (which
    # runs inside either), full collections; and Store.ingest per record in each round.
    totals = {n: [0, 0.0, 0.0, 0.0, 0] for n in sizes}
    rounds_store: dict[int, list[float]] = {n: [] for n in sizes}
    try:
        for n in sizes:
            if workers[n][1].recv() != "ready":
                raise RuntimeError(f"scaling worker for {n} ranks failed")
        for k in range(rounds):
            for n in sizes if k % 2 == 0 else sizes[::-1]:
                conn = workers[n][1]
                conn.send(True)
                got = conn.recv()
                totals[n] = [a + b for a, b in zip(totals[n], got, strict=True)]
                rounds_store[n].append(got[2] / got[0])
    finally:
        for proc, conn in workers.values():
            with contextlib.suppress(OSError):
                conn.send(False)
            proc.join(10)
    store = {n: t[2] / t[0] for n, t in totals.items()}
    both = {n: (t[1] + t[2]) / t[0] for n, t in totals.items()}
    print(
        f"ingest CPU per record (thread CPU time; a process per size, each one exporter's Store; "
        f"{rounds} interleaved rounds of ~{records:,} records per size; batches of {per_batch} "
        f"records, {STEPS_PER_BATCH} steps, every rank once a round in a shuffled order)"
    )
    print(
        f"{'ranks':>6} {'store us/rec':>13} {'rounds min':>11} {'max':>6} {'parse+store':>12} "
        f"{'of which gc':>12} {'full gcs':>9} {'records':>10}"
    )
    for n in sizes:
        t, v = totals[n], rounds_store[n]
        print(
            f"{n:>6} {store[n] * 1e6:>13.2f} {min(v) * 1e6:>11.2f} {max(v) * 1e6:>6.2f} "
            f"{both[n] * 1e6:>12.2f} {t[3] / t[0] * 1e6:>12.2f} {t[4]:>9} {t[0]:>10,}"
        )
    lo, hi = sizes[0], sizes[-1]
    for name, m in (("Store.ingest", store), ("parse_batch + Store.ingest", both)):
        print(
            f"{name}: ratio {hi}/{lo} {m[hi] / m[lo]:.2f}, max/min over sizes "
            f"{max(m.values()) / min(m.values()):.2f} (target <= 2)"
        )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--scrapes", type=int, default=500)
    p.add_argument("--ingest-seconds", type=float, default=10.0)
    p.add_argument(
        "--ranks-scaling",
        help="comma-separated rank counts (e.g. 8,64,512): run only the ingest-cost scaling bench",
    )
    p.add_argument("--scaling-rounds", type=int, default=5)
    p.add_argument("--scaling-records", type=int, default=40_000, help="per size and round")
    a = p.parse_args()
    if a.ranks_scaling:
        sizes = sorted(int(n) for n in a.ranks_scaling.split(","))
        bench_ranks_scaling(sizes, a.scaling_rounds, a.scaling_records)
        return
    cpus = sorted(os.sched_getaffinity(0))
    server_cpu, client_cpu = (cpus[0], cpus[1]) if len(cpus) >= 2 else (None, None)
    if client_cpu is not None:
        os.sched_setaffinity(0, {client_cpu})
    rng = random.Random(7)
    bodies = [[batch(r, k * STEPS_PER_BATCH, rng) for k in range(8)] for r in range(RANKS)]
    per_batch = statistics.mean(records_in(b) for per in bodies for b in per)
    print(f"batches: {per_batch:.0f} records each ({STEPS_PER_BATCH} steps), {RANKS} ranks")
    print(f"cpus: exporter on {server_cpu}, client on {client_cpu} (of {len(cpus)})")

    # Both wire versions side by side: what the agent sends (2) and objects in seconds (1).
    v1 = [[batch(r, k * STEPS_PER_BATCH, rng, wire=1) for k in range(8)] for r in range(RANKS)]
    ceiling = bench_in_process(bodies, 3.0)
    ceiling_v1 = bench_in_process(v1, 3.0)
    print(
        f"in-process parse+validate+store: {ceiling:,.0f} records per CPU-second (wire 2), "
        f"{ceiling_v1:,.0f} (wire 1): x{ceiling / ceiling_v1:.2f}"
    )

    port = servers.free_port()
    proc = start_exporter(port, server_cpu)
    try:
        r = bench_ingest(port, proc.pid, bodies, a.ingest_seconds)
        print(
            f"ingest over HTTP: {r['records'] / r['wall_s']:,.0f} records/s wall, "
            f"{r['records'] / max(r['cpu_s'], 1e-9):,.0f} records per exporter CPU-second "
            f"({r['requests']} requests, exporter CPU {r['cpu_s']:.1f} s in {r['wall_s']:.1f} s)"
        )
        idle = bench_scrape(port, a.scrapes, None, bodies)
        busy = bench_scrape(port, a.scrapes, port, bodies)
        for name, s in (("idle", idle), ("with 8 ranks reporting", busy)):
            print(
                f"scrape /metrics ({s['bytes']:,} bytes), {name}: p50 {s['p50_ms']:.2f} ms, "
                f"p99 {s['p99_ms']:.2f} ms, max {s['max_ms']:.2f} ms ({a.scrapes} scrapes)"
            )
    finally:
        proc.terminate()
        proc.wait(10)

    port = servers.free_port()
    proc = start_exporter(port, server_cpu)
    try:
        r = bench_rss(port, proc.pid, bodies, a.records)
        samples = r["samples"]
        warm = samples[1][1] if len(samples) > 1 else samples[0][1]
        after = [mb for n, mb in samples[1:]] or [samples[0][1]]  # runs under 100k records
        final = samples[-1][1]
        print(
            f"rss: start {samples[0][1]:.1f} MB, after warm-up (100k records) {warm:.1f} MB, "
            f"after {samples[-1][0]:,} records {final:.1f} MB, max {max(after):.1f} MB, "
            f"growth after warm-up {(max(after) / warm - 1) * 100:+.1f} % "
            f"({r['wall_s']:.0f} s)"
        )
        print("rss samples (records, MB):", [(n, round(mb, 1)) for n, mb in samples])
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
