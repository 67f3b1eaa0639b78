"""Exported estimates vs the pooled per-step truth on emulated nodes (network namespaces, one
exporter per node, one Prometheus with syncscope's rules scraping them all).

Scenarios on 2 nodes × 2 ranks: a straggler on node A (rank 1), a straggler on node B (rank 3),
and no straggler. Rounds interleave the scenarios so that drift in the machine's load hits
each alike; every run prints its comparison table (syncscope.truth.format_comparison), and the
end a summary per scenario (medians over runs). Needs root and iproute2.
Run: .venv/bin/python bench/bench_multinode.py [--runs 3] [--duration 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from syncscope.monitoring.prometheus_config import local_config
from syncscope.nodes import EmulatedNodes, NodesUnavailable
from syncscope.servers import Prometheus
from syncscope.truth import compare, format_comparison

SKIP_STEPS = 10  # warm-up steps left out of the truth


def scenarios(slow_ms: float, per_node: int) -> dict[str, tuple[int | None, list[str]]]:
    """{name: (the slowed rank, workload flags)}: the last rank of node A, of node B, none."""
    slow = ["--slow-ms", str(slow_ms), "--slow-rank"]
    a, b = per_node - 1, 2 * per_node - 1
    return {
        f"straggler on node A (rank {a})": (a, [*slow, str(a)]),
        f"straggler on node B (rank {b})": (b, [*slow, str(b)]),
        "no straggler": (None, []),
    }


def one_run(
    args: list[str], job: str, duration: float, nodes: int, per_node: int
) -> dict[str, Any]:
    """One job on fresh emulated nodes with a fresh Prometheus; its comparison."""
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-bench-nodes-")
        stack.callback(shutil.rmtree, workdir, True)
        cluster = stack.enter_context(EmulatedNodes(nodes, per_node, workdir=workdir))
        prom = None
        if shutil.which("prometheus"):
            prom = Prometheus(local_config(cluster.exporter_ports, workdir), workdir)
            stack.callback(prom.stop)
            prom.wait_ready()
        cluster.run(["--duration", str(duration), *args], job)
        time.sleep(3)  # the final flush scraped and the rules evaluated (1 s each)
        return compare(prom, cluster.states(), cluster.truth(SKIP_STEPS), job)


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(v: float | None) -> str:
    return f"{v * 1e3:7.1f}" if v is not None else f"{'-':>7}"


def summary(name: str, slowed: int | None, runs: list[dict[str, Any]]) -> list[str]:
    ranks = sorted(runs[0]["ranks"])
    lines = [f"{name}: medians over {len(runs)} runs (ms)", "rank    lead  rule avg  truth W"]
    for r in ranks:
        col = {
            k: _median([c["ranks"][r].get(k) for c in runs])
            for k in ("exported_lead_s", "rule_lead_avg_s", "truth_wait_s")
        }
        lines.append(
            f"{r:>4} {_ms(col['exported_lead_s'])}   {_ms(col['rule_lead_avg_s'])}  "
            f"{_ms(col['truth_wait_s'])}"
        )
    rule_amp = _median([c["amplification"]["rule"] for c in runs])
    truth_amp = _median([c["amplification"]["truth"] for c in runs])
    lines.append(
        f"amplification: rule {rule_amp if rule_amp is None else round(rule_amp, 3)}, "
        f"truth {truth_amp if truth_amp is None else round(truth_amp, 3)}"
    )
    n = len(runs)
    if slowed is not None:
        by_rule = sum(c["straggler"]["rule"] == slowed for c in runs)
        by_truth = sum(c["straggler"]["truth"] == slowed for c in runs)
        by_node = sum(any(x["straggler"] == slowed for x in c["nodes"]) for c in runs)
        lines.append(
            f"rank {slowed} named by the rule in {by_rule}/{n} runs, by the truth in "
            f"{by_truth}/{n}, by an exporter in {by_node}/{n}"
        )
    else:  # the rule's argmin and the truth's smallest d always name some rank: noise here
        named = sum(any(x["straggler"] is not None for x in c["nodes"]) for c in runs)
        lines.append(f"an exporter named a straggler anyway in {named}/{n} runs")
    contention = sum(any(x["fabric_contention"] for x in c["nodes"]) for c in runs)
    lines.append(f"an exporter said fabric_contention in {contention}/{n} runs")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per scenario (default %(default)s)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of training per run")
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every comparison here")
    a = p.parse_args()
    if a.nodes < 2:
        p.error("the scenarios need node A and node B: --nodes 2 or more")
    cases = scenarios(a.slow_ms, a.ranks_per_node)
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for run in range(a.runs):
        for i, (name, (_, args)) in enumerate(cases.items()):
            try:
                c = one_run(args, f"bench-{i}-{run}", a.duration, a.nodes, a.ranks_per_node)
            except NodesUnavailable as exc:
                print(f"cannot emulate nodes here: {exc}", file=sys.stderr)
                return 2
            results[name].append(c)
            print(f"\n=== {name}, run {run + 1}/{a.runs} ===\n{format_comparison(c)}", flush=True)
    print("\n=== summary ===")
    for name, runs in results.items():
        print("\n".join(summary(name, cases[name][0], runs)) + "\n")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
