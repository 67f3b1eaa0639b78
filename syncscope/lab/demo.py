"""`syncscope demo`: a real 4-rank gloo DDP job with one slowed rank, the exporter, and a live view.

Everything it starts is real and bound to 127.0.0.1: the exporter under uvicorn, one process
per rank (FileStore rendezvous, gloo on loopback), and Prometheus when it is installed. With
``--nodes N`` the ranks are split over N emulated nodes (syncscope.lab.nodes: network namespaces
joined by veth links, one exporter per node, as root), and Prometheus scrapes every exporter.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from syncscope.lab.launch import launch, stop
from syncscope.lab.nodes import EmulatedNodes, NodesUnavailable
from syncscope.lab.servers import Prometheus, free_port, get_json, start_exporter
from syncscope.monitoring.prometheus_config import local_config
from syncscope.monitoring.rules import STRAGGLER_LAG
from syncscope.wire import PHASES

SHORT = {
    "data": "data",
    "forward": "fwd",
    "backward": "bwd",
    "optimizer": "opt",
    "comm_exposed": "comm",
    "pacing": "pace",
    "other": "oth",
}


def add_subcommand(sub: Any) -> None:
    p = sub.add_parser(
        "demo", help="run a real multi-rank job with a slowed rank and watch syncscope name it"
    )
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument(
        "--nodes",
        type=int,
        default=1,
        help="split the ranks over this many emulated nodes, one exporter each (network "
        "namespaces; needs root and iproute2; default %(default)s: no emulation)",
    )
    p.add_argument(
        "--duration", type=float, default=40.0, help="seconds of training (default %(default)s)"
    )
    p.add_argument("--slow-rank", type=int, default=2, help="rank slowed on purpose (-1: none)")
    p.add_argument("--slow-ms", type=float, default=30.0, help="how much it is slowed per step")
    p.add_argument(
        "--jitter-prob", type=float, default=0.0, help="chance any rank stalls in a step"
    )
    p.add_argument("--pacing", action="store_true", help="turn the pacing controller on")
    p.add_argument(
        "--port", type=int, default=0, help="exporter port, node i's is +i (0: free ones)"
    )
    p.add_argument(
        "--prometheus",
        choices=["auto", "off"],
        default="auto",
        help="also start Prometheus if installed",
    )
    p.add_argument("--refresh", type=float, default=1.0)
    p.set_defaults(func=run)


def demo_prometheus(exporter_ports: int | list[int], workdir: str) -> Prometheus | None:
    """Prometheus scraping the exporters every second with syncscope's rules, if installed.

    The rules get the demo's short for: and windows (a one-minute job, 1 s intervals).
    """
    if shutil.which("prometheus") is None:
        return None
    prom = Prometheus(local_config(exporter_ports, workdir), workdir)
    try:
        prom.wait_ready()
    except RuntimeError:
        prom.stop()
        return None
    return prom


def _header(node_column: bool) -> list[str]:
    head = (
        ("node " if node_column else "")
        + f"{'rank':>4} {'steps':>6} {'step ms':>8} {'CV':>5} {'lead ms':>8}  "
        + " ".join(f"{SHORT[p]:>5}" for p in PHASES)
        + "  verdict"
    )
    return [head, "-" * len(head)]


def _rank_line(r: dict[str, Any], straggler: int | None, node: int | None = None) -> str:
    med = r["step_time_median_s"]
    lead = r["arrival_lead_s"]
    shares = " ".join(f"{100 * r['phase_shares'].get(p, 0):4.0f}%" for p in PHASES)
    verdict = "STRAGGLER" if r["rank"] == straggler else ("stale" if r["stale"] else "")
    cv = r["step_time_cv"]
    return (
        (f"{node:>4} " if node is not None else "")
        + f"{r['rank']:>4} {r['steps_total']:>6} {(med or 0) * 1e3:8.1f} {(cv if cv is not None else 0):5.2f} "
        f"{(lead if lead is not None else 0) * 1e3:8.1f}  {shares}  {verdict}"
    )


def _diagnosis_lines(diag: dict[str, Any], indent: str = "") -> list[str]:
    if diag.get("straggler"):
        s = diag["straggler"]
        lines = [f"{indent}straggler: rank {s['rank']} (cause: {s['cause']} - {s['cause_reason']})"]
    else:
        lines = [f"{indent}straggler: none (arrival skew below threshold)"]
    for mode, m in sorted(diag.get("modes", {}).items()):
        lines.append(
            f"{indent}  {mode:<19} {m['score']:.2f} {'!' if m['verdict'] else ' '} {m['reason']}"
        )
    return lines


def render_table(state: dict[str, Any], job: str) -> list[str]:
    data = state["jobs"].get(job)
    if not data:
        return ["waiting for the first reports ..."]
    diag = data["diagnosis"]
    straggler = (diag.get("straggler") or {}).get("rank")
    lines = _header(False) + [_rank_line(r, straggler) for r in data["ranks"]]
    return [*lines, "", *_diagnosis_lines(diag)]


def exporters_straggler(states: list[dict[str, Any]], job: str) -> int | None:
    """The straggler the exporters name job-wide: each names one from its own node's view, so
    across nodes the named rank with the smallest exported arrival lead (the argmin the
    Prometheus rule takes)."""
    named = []
    for state in states:
        data = state["jobs"].get(job) or {}
        rank = ((data.get("diagnosis") or {}).get("straggler") or {}).get("rank")
        for r in data.get("ranks", []):
            if r["rank"] == rank:
                lead = r["arrival_lead_s"]
                named.append((lead if lead is not None else float("inf"), rank))
    return min(named)[1] if named else None


def render_nodes_table(
    states: list[dict[str, Any]], job: str, straggler: int | None, named_by: str
) -> list[str]:
    """Every rank of every node's exporter in one table, then each node's own diagnosis."""
    rows = sorted(
        (r["rank"], node, r)
        for node, state in enumerate(states)
        for r in (state["jobs"].get(job) or {}).get("ranks", [])
    )
    if not rows:
        return ["waiting for the first reports ..."]
    lines = _header(True) + [_rank_line(r, straggler, node) for _, node, r in rows]
    lines += ["", f"job-wide straggler: rank {straggler} (named by {named_by})"]
    for node, state in enumerate(states):
        data = state["jobs"].get(job)
        if data:
            lines.append(f"node {node}'s exporter, from its own ranks only:")
            lines += _diagnosis_lines(data["diagnosis"], indent="  ")
    return lines


def run(args: argparse.Namespace) -> int:
    # Everything started is stopped on every way out, a failed start included: a demo that
    # fails must not leave an exporter, a Prometheus or ranks running behind it.
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-demo-")
        stack.callback(shutil.rmtree, workdir, True)
        return _run(args, workdir, stack)


def _run(args: argparse.Namespace, workdir: str, stack: contextlib.ExitStack) -> int:
    job = "demo"
    train_args = [
        "--duration",
        str(args.duration),
        "--slow-rank",
        str(args.slow_rank),
        "--slow-ms",
        str(args.slow_ms),
        "--jitter-prob",
        str(args.jitter_prob),
    ]
    cluster: EmulatedNodes | None = None
    if args.nodes > 1:
        if args.ranks % args.nodes:
            print(
                f"syncscope demo: --ranks {args.ranks} do not split over --nodes {args.nodes}",
                file=sys.stderr,
            )
            return 2
        ports = [args.port + i for i in range(args.nodes)] if args.port else None
        try:
            cluster = stack.enter_context(
                EmulatedNodes(
                    args.nodes, args.ranks // args.nodes, workdir=workdir, exporter_ports=ports
                )
            )
        except NodesUnavailable as exc:
            print(f"syncscope demo: cannot emulate {args.nodes} nodes here: {exc}", file=sys.stderr)
            return 2
        exporter_ports = cluster.exporter_ports
    else:
        port = args.port or free_port()
        exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(stop, exporter)
        exporter_ports = [port]
    prom = demo_prometheus(exporter_ports, workdir) if args.prometheus == "auto" else None
    if prom is not None:
        stack.callback(prom.stop)
    bases = [f"http://127.0.0.1:{port}" for port in exporter_ports]
    # Ranks' stderr goes to a file: a pipe nobody drains would block a chatty rank.
    rank_log = stack.enter_context(open(os.path.join(workdir, "ranks.log"), "w+b"))  # noqa: SIM115
    # On emulated nodes each rank's SYNCSCOPE_EXPORTER is its own node's socket instead.
    env = dict(os.environ, SYNCSCOPE_EXPORTER=bases[0], SYNCSCOPE_JOB=job)
    if args.pacing:
        env["SYNCSCOPE_PACING"] = "1"
    where = f" on {args.nodes} emulated nodes" if cluster else ""
    print(
        f"syncscope demo: {args.ranks} ranks (gloo, CPU){where}, rank {args.slow_rank} slowed by {args.slow_ms:.0f} ms per step"
    )
    if cluster is None:
        base = bases[0]
        print(f"  status   {base}/\n  metrics  {base}/metrics\n  state    {base}/v1/state")
    else:
        for node, base in zip(cluster.nodes, bases, strict=True):
            first = node.index * cluster.ranks_per_node
            print(
                f"  node {node.index}  ranks {first}-{first + cluster.ranks_per_node - 1}, "
                f"gloo on {node.address} (netns {node.netns}), exporter {base}/"
            )
    if prom is not None:
        print(
            f"  prometheus {prom.url}  (syncscope rules and alerts loaded; see {prom.url}/alerts)"
        )
    elif args.prometheus == "auto":
        print("  prometheus not started (not installed, or it did not come up)")
    out: dict[str, Any] = {"stdout": subprocess.DEVNULL, "stderr": rank_log}
    if cluster is not None:
        ranks = cluster.launch(train_args, env=env, record=False, **out)
    else:
        ranks = launch(args.ranks, train_args, env=env, **out)
    for p in ranks:
        stack.callback(stop, p)
    view = _View(job, bases, prom, multi=cluster is not None)
    tty = sys.stdout.isatty()
    last_print = 0.0
    while any(p.poll() is None for p in ranks):
        time.sleep(args.refresh)
        view.refresh()
        now = time.monotonic()
        if tty:
            sys.stdout.write("\x1b[H\x1b[J" + "\n".join(view.render()) + "\n")
            sys.stdout.flush()
        elif now - last_print >= 10:
            print("\n".join(view.render()) + "\n", flush=True)
            last_print = now
    failed = [i for i, p in enumerate(ranks) if p.returncode != 0]
    time.sleep(1.0)  # the agents' final flush
    view.refresh()
    print("\n=== summary ===")
    print("\n".join(view.render()))
    if failed:
        for i in failed:
            print(f"rank {i} failed (exit {ranks[i].returncode})", file=sys.stderr)
        rank_log.flush()
        rank_log.seek(0)
        print(rank_log.read()[-4000:].decode(errors="replace"), file=sys.stderr)
        return 1
    expected = args.slow_rank if args.slow_rank >= 0 else None
    if view.multi:
        print(f"\nnamed by {view.named_by}")
        print(f"slowed rank: {expected}; syncscope named: {view.straggler}")
    else:
        print(f"\nslowed rank: {expected}; syncscope named: {view.straggler}")
    return 0


class _View:
    """The exporters' /v1/state (and Prometheus's straggler rule) as last read, for the table."""

    def __init__(self, job: str, bases: list[str], prom: Prometheus | None, multi: bool) -> None:
        self.job, self.bases, self.prom, self.multi = job, bases, prom, multi
        self.states: list[dict[str, Any]] = [{"jobs": {}} for _ in bases]
        self.rule_straggler: int | None = None

    def refresh(self) -> None:
        for i, base in enumerate(self.bases):
            with contextlib.suppress(OSError, ValueError):
                self.states[i] = get_json(base + "/v1/state")
        if self.prom is not None and self.multi:
            # Kept from the last read that named one, so that a failed or empty final query
            # (Prometheus stopping, a scrape gap) does not erase the answer.
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                found = self.prom.query(f'{STRAGGLER_LAG}{{job="{self.job}"}}')
                if found:
                    self.rule_straggler = min(int(r["metric"]["rank"]) for r in found)

    @property
    def named_by(self) -> str:
        if self.prom is not None:
            return f"Prometheus's recording rule {STRAGGLER_LAG}"
        return "the exporters: each node's diagnosis, across nodes the smallest lead"

    @property
    def straggler(self) -> int | None:
        if not self.multi:
            diag = self.states[0]["jobs"].get(self.job, {}).get("diagnosis", {})
            rank: int | None = (diag.get("straggler") or {}).get("rank")
            return rank
        if self.prom is not None:
            return self.rule_straggler
        return exporters_straggler(self.states, self.job)

    def render(self) -> list[str]:
        if not self.multi:
            return render_table(self.states[0], self.job)
        return render_nodes_table(self.states, self.job, self.straggler, self.named_by)
