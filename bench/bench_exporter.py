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
Run: .venv/bin/python bench/bench_exporter.py [--records 1000000] [--scrapes 500]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import threading
import time

from syncscope import servers

PHASES = ("data", "forward", "backward", "optimizer", "comm_exposed", "pacing", "other")
RANKS = 8
STEPS_PER_BATCH = 50  # a 10 ms step flushed every 0.5 s: twice the agent's default rate
OPS = (
    ("ddp_grad_sync", 25e6, 0.004),
    ("all_reduce", 4096.0, 0.0004),
    ("all_gather", 1 << 20, 0.001),
    ("broadcast", 8.0, 0.0002),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def batch(rank: int, step0: int, rng: random.Random, wire: int = 2) -> bytes:
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
            "job": "bench",
            "rank": rank,
            "local_rank": rank,
            "world_size": RANKS,
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--scrapes", type=int, default=500)
    p.add_argument("--ingest-seconds", type=float, default=10.0)
    a = p.parse_args()
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

    port = free_port()
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

    port = free_port()
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
