"""Exported estimates vs the pooled per-step truth on emulated nodes (network namespaces, one
exporter per node, one Prometheus with syncscope's rules scraping them all).

Scenarios on 2 nodes × 2 ranks: a straggler on node A (rank 1), a straggler on node B (rank 3),
no straggler, and the straggler on node B with pacing on. Rounds interleave the scenarios so that drift in the machine's load hits
each alike; every run prints its comparison table (syncscope.lab.truth.format_comparison), and the
end a summary per scenario (medians over runs). Every exporter reads the job-wide view back
from Prometheus (--prometheus-url); the rules are compared with the truth over the steps their
windows covered. Needs root and iproute2.

--onset instead: rank 3 turns straggler once the rules' straggler window holds only clean
steps (20 s into training with the demo's 10 s windows, 5 min 20 s with the shipped 5 min
ones, as in a job that has run for a while); the time from that onset until the recording rule
names it for good, until SyncscopeStraggler is pending and until it fires, with the demo's
windows and for: (10 s, 2 s) and with the shipped ones (firing there is pending + the shipped
for: of 10 min, which the run does not wait out).
--fabric instead: the fabric scenarios of syncscope.lab.scenarios (a node's link throttled to a
quarter of the other's; a competing bulk flow between the nodes for 25 s of a 110 s job).
Run: .venv/bin/python bench/bench_multinode.py [--runs 3] [--duration 30] [--json out.json]
     .venv/bin/python bench/bench_multinode.py --onset [--runs 3]
     .venv/bin/python bench/bench_multinode.py --fabric [--runs 3]
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

from syncscope.lab import scenarios as fabric
from syncscope.lab.nodes import EmulatedNodes, NodesUnavailable
from syncscope.lab.servers import Prometheus, free_port
from syncscope.lab.truth import compare, format_comparison, rule_window_steps
from syncscope.monitoring.prometheus_config import (
    exporter_overrides,
    local_config,
    local_window_s,
)
from syncscope.monitoring.rules import STRAGGLER_LAG, STRAGGLER_RATIO
from syncscope.thresholds import duration_seconds, load_config, required

SKIP_STEPS = 10  # warm-up steps left out of the truth


def scenarios(slow_ms: float, per_node: int) -> dict[str, tuple[int | None, list[str]]]:
    """{name: (the slowed rank, workload flags)}: the last rank of node A, of node B, none."""
    slow = ["--slow-ms", str(slow_ms), "--slow-rank"]
    a, b = per_node - 1, 2 * per_node - 1
    return {
        f"straggler on node A (rank {a})": (a, [*slow, str(a)]),
        f"straggler on node B (rank {b})": (b, [*slow, str(b)]),
        "no straggler": (None, []),
        f"straggler on node B (rank {b}), pacing on": (b, [*slow, str(b), "--pacing"]),
    }


def one_run(
    args: list[str], job: str, duration: float, nodes: int, per_node: int
) -> dict[str, Any]:
    """One job on fresh emulated nodes with a fresh Prometheus, which every exporter reads the
    job-wide view back from (--prometheus-url); its comparison, over the rules' window."""
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-bench-nodes-")
        stack.callback(shutil.rmtree, workdir, True)
        have_prom = shutil.which("prometheus") is not None
        prom_port = free_port()
        readback = (
            ["--prometheus-url", f"http://127.0.0.1:{prom_port}", *exporter_overrides()]
            if have_prom
            else []
        )
        cluster = stack.enter_context(
            EmulatedNodes(
                nodes,
                per_node,
                workdir=workdir,
                exporter_args=[*readback, "--prometheus-interval", "2"] if readback else [],
            )
        )
        prom = None
        if have_prom:
            prom = Prometheus(
                local_config(cluster.exporter_ports, workdir), workdir, port=prom_port
            )
            stack.callback(prom.stop)
            prom.wait_ready()
        started = time.time()
        cluster.run(["--duration", str(duration), *args], job)
        # The final flush scraped, the rules evaluated (1 s each), the exporters read them back.
        time.sleep(4)
        window = local_window_s() if prom else None
        steps = rule_window_steps(prom, job, f"{window:g}s") if prom and window else None
        truth = cluster.truth(SKIP_STEPS, window, steps)
        c = compare(prom, cluster.states(), truth, job)
        if prom is not None:
            c["evaluations"] = evaluations(prom, job, started + WARM_UP_S, time.time())
        return c


WARM_UP_S = 15.0  # start-up (gloo, first steps) and the rules' first full window


def _values(found: dict[str, float], label: str) -> set[str]:
    """The values of `label` in one evaluation of Prometheus.query_range (keys "label=value")."""
    return {key.removeprefix(f"{label}=") for key in found}


def evaluations(prom: Prometheus, job: str, t0: float, t1: float) -> dict[str, Any]:
    """Every rule evaluation (1 s) from t0 to t1: how often each rank was the one named by the
    straggler rule, and which ranks were over SyncscopeStraggler's line while it was pending or
    firing (the alert is one per job; the rank is in its summary)."""
    sel = f'{{job="{job}"}}'
    line = required(load_config().alerts["SyncscopeStraggler"].levels[0].threshold, "threshold")
    named = prom.query_range(f"max by (rank) ({STRAGGLER_LAG}{sel})", t0, t1)
    over = prom.query_range(f"max by (rank) ({STRAGGLER_RATIO}{sel} > {line})", t0, t1)
    raised = prom.query_range(
        f'count(ALERTS{{alertname="SyncscopeStraggler",job="{job}"}})', t0, t1
    )
    n = len(named)
    counts: dict[str, int] = {}
    for found in named.values():
        for rank in _values(found, "rank"):
            counts[rank] = counts.get(rank, 0) + 1
    alerted = {r for t, found in raised.items() if found for r in _values(over.get(t, {}), "rank")}
    return {"n": n, "named_share": {r: k / n for r, k in counts.items()}, "alerted": alerted}


def onset_run(shipped: bool, after_s: float, job: str) -> dict[str, float | None]:
    """Rank 3 slowed 30 ms once the straggler window holds only clean steps; seconds from the
    onset to the rule naming it for good (every later evaluation), to SyncscopeStraggler
    pending, and to firing."""
    cfg = load_config()
    onset_after = 20.0 + (duration_seconds(cfg.windows.straggler) if shipped else 0.0)
    alert = "SyncscopeStraggler"
    overrides: dict[str, Any] = {}
    if shipped:
        windows = cfg.windows.model_dump(by_alias=True, exclude_unset=True)  # the file's keys
        overrides = {f"windows.{w}": v for w, v in windows.items()}
        overrides[f"alerts.{alert}.for"] = cfg.alerts[alert].for_
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-bench-onset-")
        stack.callback(shutil.rmtree, workdir, True)
        cluster = stack.enter_context(EmulatedNodes(2, 2, workdir=workdir))
        prom = Prometheus(local_config(cluster.exporter_ports, workdir, overrides), workdir)
        stack.callback(prom.stop)
        prom.wait_ready()
        duration = onset_after + after_s
        args = ["--duration", str(duration), "--slow-rank", "3", "--slow-after", str(onset_after)]
        cluster.run(args, job, record=False, timeout=duration + 120)
        time.sleep(2)
        with open(f"{workdir}/{job}.log") as log:
            onset = next(float(line.split()[-1]) for line in log if "slow from unix" in line)
        end = time.time()
        sel = f'{{job="{job}"}}'
        t0 = onset - 5.0  # every evaluation (1 s) from just before the onset on
        names = prom.query_range(f"max by (rank) ({STRAGGLER_LAG}{sel})", t0, end)
        states = prom.query_range(
            f'max by (alertstate) (ALERTS{{alertname="{alert}",job="{job}"}})', t0, end
        )
        named = [(t, _values(found, "rank") == {"3"}) for t, found in sorted(names.items())]
        # The alert is one per job: it counts for rank 3 while the rule names rank 3.
        raised = [(t, _values(states.get(t, {}), "alertstate")) for t, _ in named]
        pending = [(t, bool(s) and ok) for (t, s), (_, ok) in zip(raised, named, strict=True)]
        firing = [(t, "firing" in s and ok) for (t, s), (_, ok) in zip(raised, named, strict=True)]
    for_s = duration_seconds(cfg.alerts[alert].for_) if shipped else 2.0

    def first_for_good(series: list[tuple[float, bool]]) -> float | None:
        since = None
        for t, ok in series:
            since = (since if since is not None else t) if ok else None
        return None if since is None else max(0.0, since - onset)

    def first(series: list[tuple[float, bool]]) -> float | None:
        return next((max(0.0, t - onset) for t, ok in series if ok and t >= onset), None)

    fired = first(firing)
    pend = first(pending)
    return {
        "named_s": first_for_good(named),
        "pending_s": pend,
        "firing_s": fired,
        "firing_by_for_s": fired if fired is not None else (pend + for_s if pend else None),
        "for_s": for_s,
    }


def onset_main(runs: int) -> int:
    rows: dict[str, list[dict[str, float | None]]] = {"demo": [], "shipped": []}
    for run in range(runs):
        # With the shipped windows the lag is averaged over 5 min of steps, most of them clean
        # and faster: it takes minutes after the onset to cross 10 % of the (1 min) step.
        for kind, after in (("demo", 25.0), ("shipped", 360.0)):
            r = onset_run(kind == "shipped", after, f"onset-{kind}-{run}")
            rows[kind].append(r)
            print(f"{kind} windows, run {run + 1}/{runs}: {r}", flush=True)
    print("\n=== onset of a straggler (rank 3, 30 ms) → seconds, medians over runs ===")
    for kind, rs in rows.items():
        med = {k: _median([r[k] for r in rs]) for k in rs[0]}
        print(
            f"{kind:>8}: named for good {med['named_s']}, pending {med['pending_s']}, "
            f"firing {med['firing_s']} (firing = pending + for: {med['firing_by_for_s']}, "
            f"for: {med['for_s']} s)"
        )
    return 0


def fabric_main(runs: int) -> int:
    """The fabric scenarios (syncscope.lab.scenarios), `runs` times each, interleaved."""
    slow, contended = [], []
    for run in range(runs):
        with tempfile.TemporaryDirectory(prefix="syncscope-bench-fabric-") as workdir:
            slow.append(fabric.slow_link(workdir, f"throttled-{run}"))
        print(f"throttled node, run {run + 1}/{runs}: {slow[-1]}", flush=True)
        with tempfile.TemporaryDirectory(prefix="syncscope-bench-fabric-") as workdir:
            contended.append(fabric.contention_window(workdir, f"contended-{run}"))
        print(f"competing flow, run {run + 1}/{runs}: {contended[-1]}", flush=True)
    print("\n=== fabric scenarios ===")
    for r in slow:
        u = r["utilisation"]
        verdicts = [bool((e["slow_link"] or {}).get("verdict")) for e in r["exporters"]]
        print(
            f"throttled node: node1 named the slow link in {r['named_share']:.1%} of "
            f"{r['evaluations']} evaluations; utilisation while transferring node1 "
            f"{u.get('node1', 0):.2f} vs node0 {u.get('node0', 0):.2f} "
            f"(ratio {u.get('node1', 0) / max(u.get('node0', 0), 1e-9):.1f}); exporters' "
            f"slow_link {verdicts}; straggler alerts {r['straggler_alerts']}; exporters' "
            f"samples naming a straggler {_named(r)}; "
            f"fabric panels without data {len(r['empty_fabric_panels'])}"
        )
    for r in contended:
        print(
            f"competing flow: flagged {r['flagged_before']} of {r['evaluations_before']} "
            f"evaluations before, {r['flagged_while_on_share']:.0%} while on (after 10 s), "
            f"detected after {r['detected_s']} s, cleared {r['cleared_s']} s after, peak index "
            f"{r['peak_index']:.2f}; exporters' samples naming a straggler {_named(r)}"
        )
    return 0


def _named(result: dict[str, Any]) -> str:
    """Per node, the exporter's samples that named a straggler, of all it gave."""
    shares = result["straggler_samples"]
    return ", ".join(f"node{n} {named}/{seen}" for n, (named, seen) in sorted(shares.items()))


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
    paced = {r: [c["ranks"][r].get("paced_s") for c in runs] for r in ranks}
    if any(v is not None for vs in paced.values() for v in vs):
        lines.append(
            "pacing delay per rank over the run (s): "
            + "; ".join(
                f"rank {r} " + "/".join(f"{v:.1f}" if v is not None else "-" for v in vs)
                for r, vs in paced.items()
            )
        )
    rule_amp = _median([c["amplification"]["rule"] for c in runs])
    truth_amp = _median([c["amplification"]["truth"] for c in runs])
    lines.append(
        f"amplification: rule {rule_amp if rule_amp is None else round(rule_amp, 3)}, "
        f"truth {truth_amp if truth_amp is None else round(truth_amp, 3)}"
    )
    n = len(runs)
    none: dict[str, Any] = {"named_share": {}, "alerted": set()}
    shares = [c.get("evaluations", none)["named_share"].get(str(slowed), 0.0) for c in runs]
    alerted = [sorted(c.get("evaluations", none)["alerted"]) for c in runs]
    if slowed is not None:
        lines.append(
            f"rank {slowed} named in {', '.join(f'{x:.1%}' for x in shares)} of the rule's "
            f"evaluations after warm-up; SyncscopeStraggler raised for ranks {alerted}"
        )
    else:
        lines.append(f"SyncscopeStraggler raised for ranks {alerted}")
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
    for verdict in ("fabric_contention", "slow_link"):
        said = sum(any(x.get(verdict) for x in c["nodes"]) for c in runs)
        lines.append(f"an exporter said {verdict} in {said}/{n} runs")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per scenario (default %(default)s)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of training per run")
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--json", default=None, help="also write every comparison here")
    p.add_argument("--onset", action="store_true", help="time a straggler's onset to its name")
    p.add_argument("--only", default="", help="only the scenarios whose name contains this")
    p.add_argument("--fabric", action="store_true", help="a throttled node, a competing flow")
    a = p.parse_args()
    if a.onset:
        return onset_main(a.runs)
    if a.fabric:
        return fabric_main(a.runs)
    if a.nodes < 2:
        p.error("the scenarios need node A and node B: --nodes 2 or more")
    cases = {
        name: case
        for name, case in scenarios(a.slow_ms, a.ranks_per_node).items()
        if a.only in name
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in cases}
    for run in range(a.runs):
        for i, (name, (_, args)) in enumerate(cases.items()):
            c = one_run(args, f"bench-{i}-{run}", a.duration, a.nodes, a.ranks_per_node)
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
    try:
        sys.exit(main())
    except NodesUnavailable as exc:
        print(f"cannot emulate nodes here: {exc}", file=sys.stderr)
        sys.exit(2)
