"""Pacing evaluation on real 4-rank gloo jobs: baseline vs pacing, interleaved, per scenario.

Scenarios: (a) a steady straggler, (b) intermittent jitter on random ranks,
(c) no imbalance. Each run is a fresh exporter + `syncscope.lab.workload`; off and on alternate so
that drift in the machine's load hits both alike. Reported per mode (medians over rounds):
throughput (steps/s), step-time CV, mean wait per step over all ranks, total pacing delay.
Run: .venv/bin/python bench/bench_pacing.py [--rounds 2] [--duration 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile

from syncscope.lab.launch import launch, wait_all
from syncscope.lab.servers import free_port, start_exporter

SCENARIOS = {
    "steady straggler (rank 1 +30 ms)": ["--slow-rank", "1", "--slow-ms", "30"],
    "intermittent jitter (10 % of steps, +30 ms, any rank)": [
        "--jitter-prob",
        "0.1",
        "--jitter-ms",
        "30",
    ],
    "no imbalance": [],
}


def one_run(args: list[str], pacing: bool, duration: float, world: int) -> dict[str, float]:
    tmp = tempfile.mkdtemp(prefix="syncscope-pacing-")
    port = free_port()
    exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        env = dict(
            os.environ,
            SYNCSCOPE_EXPORTER=f"http://127.0.0.1:{port}",
            SYNCSCOPE_RECORD=os.path.join(tmp, "rec-{rank}.jsonl"),
        )
        flags = ["--duration", str(duration), *args, *(["--pacing"] if pacing else [])]
        codes = wait_all(
            launch(world, flags, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            duration * 4 + 60,
        )
        assert codes == [0] * world, codes
    finally:
        exporter.terminate()
        exporter.wait(10)
    rows = {}
    for rank in range(world):
        with open(os.path.join(tmp, f"rec-{rank}.jsonl")) as f:
            lines = [json.loads(line) for line in f]
        rows[rank] = lines[len(lines) // 5 :]  # drop warm-up
    steps = [s["step_s"] for s in rows[0]]
    return {
        "throughput": len(steps) / sum(steps),
        "cv": statistics.pstdev(steps) / statistics.mean(steps),
        "wait_ms": 1e3 * statistics.mean(s["wait_s"] for r in rows.values() for s in r),
        "pacing_s": sum(s["phases"]["pacing"] for r in rows.values() for s in r),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--world", type=int, default=4)
    a = p.parse_args()
    print(
        f"{a.world} ranks, gloo on CPU, {a.duration:.0f} s per run, {a.rounds} rounds, off/on interleaved"
    )
    print(f"{'scenario':<52} {'mode':<4} {'steps/s':>8} {'CV':>6} {'wait ms':>8} {'pacing s':>9}")
    for name, args in SCENARIOS.items():
        results: dict[bool, list[dict[str, float]]] = {False: [], True: []}
        for i in range(a.rounds):
            for pacing in (False, True) if i % 2 == 0 else (True, False):
                results[pacing].append(one_run(args, pacing, a.duration, a.world))
        med = {
            m: {k: statistics.median(r[k] for r in results[m]) for k in results[m][0]}
            for m in results
        }
        for mode in (False, True):
            m = med[mode]
            print(
                f"{name:<52} {'on' if mode else 'off':<4} {m['throughput']:8.2f} {m['cv']:6.3f} {m['wait_ms']:8.2f} {m['pacing_s']:9.2f}"
            )
        print(
            f"{'':<52} {'on/off':<6} throughput x{med[True]['throughput'] / med[False]['throughput']:.3f}, "
            f"CV x{med[True]['cv'] / med[False]['cv']:.2f}, wait x{med[True]['wait_ms'] / max(med[False]['wait_ms'], 1e-9):.2f}"
        )


if __name__ == "__main__":
    main()
