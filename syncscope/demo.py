"""`syncscope demo`: a real 4-rank gloo DDP job with one slowed rank, the exporter, and a live view.

Everything it starts is real and bound to 127.0.0.1: the exporter under uvicorn, one process
per rank (FileStore rendezvous, gloo on loopback), and Prometheus when it is installed.
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

from syncscope.launch import launch
from syncscope.monitoring.prometheus_config import local_config
from syncscope.servers import Prometheus, free_port, get_json, start_exporter
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
        "--duration", type=float, default=40.0, help="seconds of training (default %(default)s)"
    )
    p.add_argument("--slow-rank", type=int, default=2, help="rank slowed on purpose (-1: none)")
    p.add_argument("--slow-ms", type=float, default=30.0, help="how much it is slowed per step")
    p.add_argument(
        "--jitter-prob", type=float, default=0.0, help="chance any rank stalls in a step"
    )
    p.add_argument("--pacing", action="store_true", help="turn the pacing controller on")
    p.add_argument("--port", type=int, default=0, help="exporter port (0: a free one)")
    p.add_argument(
        "--prometheus",
        choices=["auto", "off"],
        default="auto",
        help="also start Prometheus if installed",
    )
    p.add_argument("--refresh", type=float, default=1.0)
    p.set_defaults(func=run)


def demo_prometheus(exporter_port: int, workdir: str) -> Prometheus | None:
    """Prometheus scraping the exporter every second with syncscope's rules, if installed.

    The rules get the demo's short for: and windows (a one-minute job, 1 s intervals).
    """
    if shutil.which("prometheus") is None:
        return None
    prom = Prometheus(local_config(exporter_port, workdir), workdir)
    try:
        prom.wait_ready()
    except RuntimeError:
        prom.stop()
        return None
    return prom


def render_table(state: dict[str, Any], job: str) -> list[str]:
    data = state["jobs"].get(job)
    if not data:
        return ["waiting for the first reports ..."]
    head = (
        f"{'rank':>4} {'steps':>6} {'step ms':>8} {'CV':>5} {'lead ms':>8}  "
        + " ".join(f"{SHORT[p]:>5}" for p in PHASES)
        + "  verdict"
    )
    lines = [head, "-" * len(head)]
    diag = data["diagnosis"]
    straggler = (diag.get("straggler") or {}).get("rank")
    for r in data["ranks"]:
        med = r["step_time_median_s"]
        lead = r["arrival_lead_s"]
        shares = " ".join(f"{100 * r['phase_shares'].get(p, 0):4.0f}%" for p in PHASES)
        verdict = "STRAGGLER" if r["rank"] == straggler else ("stale" if r["stale"] else "")
        cv = r["step_time_cv"]
        lines.append(
            f"{r['rank']:>4} {r['steps_total']:>6} {(med or 0) * 1e3:8.1f} {(cv if cv is not None else 0):5.2f} "
            f"{(lead if lead is not None else 0) * 1e3:8.1f}  {shares}  {verdict}"
        )
    lines.append("")
    if diag.get("straggler"):
        s = diag["straggler"]
        lines.append(f"straggler: rank {s['rank']} (cause: {s['cause']} - {s['cause_reason']})")
    else:
        lines.append("straggler: none (arrival skew below threshold)")
    for mode, m in sorted(diag.get("modes", {}).items()):
        lines.append(f"  {mode:<19} {m['score']:.2f} {'!' if m['verdict'] else ' '} {m['reason']}")
    return lines


def run(args: argparse.Namespace) -> int:
    # Everything started is stopped on every way out, a failed start included: a demo that
    # fails must not leave an exporter, a Prometheus or ranks running behind it.
    with contextlib.ExitStack() as stack:
        workdir = tempfile.mkdtemp(prefix="syncscope-demo-")
        stack.callback(shutil.rmtree, workdir, True)
        return _run(args, workdir, stack)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5)
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _run(args: argparse.Namespace, workdir: str, stack: contextlib.ExitStack) -> int:
    port = args.port or free_port()
    job = "demo"
    exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(_stop, exporter)
    prom = demo_prometheus(port, workdir) if args.prometheus == "auto" else None
    if prom is not None:
        stack.callback(prom.stop)
    base = f"http://127.0.0.1:{port}"
    # Ranks' stderr goes to a file: a pipe nobody drains would block a chatty rank.
    rank_log = stack.enter_context(open(os.path.join(workdir, "ranks.log"), "w+b"))  # noqa: SIM115
    env = dict(os.environ, SYNCSCOPE_EXPORTER=base, SYNCSCOPE_JOB=job)
    if args.pacing:
        env["SYNCSCOPE_PACING"] = "1"
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
    print(
        f"syncscope demo: {args.ranks} ranks (gloo, CPU), rank {args.slow_rank} slowed by {args.slow_ms:.0f} ms per step"
    )
    print(f"  status   {base}/\n  metrics  {base}/metrics\n  state    {base}/v1/state")
    if prom is not None:
        print(
            f"  prometheus {prom.url}  (syncscope rules and alerts loaded; see {prom.url}/alerts)"
        )
    elif args.prometheus == "auto":
        print("  prometheus not started (not installed, or it did not come up)")
    ranks = launch(args.ranks, train_args, env=env, stdout=subprocess.DEVNULL, stderr=rank_log)
    for p in ranks:
        stack.callback(_stop, p)
    tty = sys.stdout.isatty()
    last_print = 0.0
    state: dict[str, Any] = {"jobs": {}}
    while any(p.poll() is None for p in ranks):
        time.sleep(args.refresh)
        with contextlib.suppress(OSError, ValueError):
            state = get_json(base + "/v1/state")
        now = time.monotonic()
        if tty:
            sys.stdout.write("\x1b[H\x1b[J" + "\n".join(render_table(state, job)) + "\n")
            sys.stdout.flush()
        elif now - last_print >= 10:
            print("\n".join(render_table(state, job)) + "\n", flush=True)
            last_print = now
    failed = [i for i, p in enumerate(ranks) if p.returncode != 0]
    time.sleep(1.0)  # the agents' final flush
    with contextlib.suppress(OSError, ValueError):
        state = get_json(base + "/v1/state")
    print("\n=== summary ===")
    print("\n".join(render_table(state, job)))
    if failed:
        for i in failed:
            print(f"rank {i} failed (exit {ranks[i].returncode})", file=sys.stderr)
        rank_log.flush()
        rank_log.seek(0)
        print(rank_log.read()[-4000:].decode(errors="replace"), file=sys.stderr)
        return 1
    named = (state["jobs"].get(job, {}).get("diagnosis", {}).get("straggler") or {}).get("rank")
    expected = args.slow_rank if args.slow_rank >= 0 else None
    print(f"\nslowed rank: {expected}; syncscope named: {named}")
    return 0
