"""`syncscope demo`: a real 4-rank gloo DDP job with one slowed rank, the exporter, and a live view.

Everything it starts is real and bound to 127.0.0.1: the exporter under uvicorn, one process
per rank (FileStore rendezvous, gloo on loopback), and Prometheus when it is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from syncscope.launch import launch
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - our own 127.0.0.1 server
        return json.loads(r.read())


def start_exporter(port: int, extra: list[str] | None = None, **popen: Any) -> subprocess.Popen:
    """Start the real exporter on 127.0.0.1:port and wait until it answers /healthz."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "syncscope.exporter",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *(extra or []),
        ],
        **popen,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exporter exited with {proc.returncode}")
        with contextlib.suppress(OSError):
            get_json(f"http://127.0.0.1:{port}/healthz", timeout=0.5)
            return proc
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError("exporter did not come up within 20 s")


def start_prometheus(exporter_port: int, workdir: str) -> tuple[subprocess.Popen, int] | None:
    """Prometheus scraping the exporter every second with syncscope's rules, if installed."""
    binary = shutil.which("prometheus")
    if binary is None:
        return None
    try:
        from syncscope_deploy import render_prometheus  # type: ignore[import-not-found]
    except ImportError:
        render_prometheus = None
    port = free_port()
    config = os.path.join(workdir, "prometheus.yml")
    rules = _rule_files()
    if render_prometheus is not None:
        text = render_prometheus(f"127.0.0.1:{exporter_port}", "1s", rules)
    else:
        text = _basic_prometheus_config(exporter_port, rules)
    with open(config, "w") as f:
        f.write(text)
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, port


def _rule_files() -> list[str]:
    root = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "deploy", "prometheus", "rules"
    )
    if not os.path.isdir(root):
        return []
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith((".yml", ".yaml")))


def _basic_prometheus_config(exporter_port: int, rules: list[str]) -> str:
    lines = ["global:", "  scrape_interval: 1s", "  evaluation_interval: 1s"]
    if rules:
        lines.append("rule_files:")
        lines += [f"  - {r}" for r in rules]
    lines += [
        "scrape_configs:",
        "  - job_name: syncscope",
        "    honor_labels: true",
        "    static_configs:",
        f"      - targets: ['127.0.0.1:{exporter_port}']",
    ]
    return "\n".join(lines) + "\n"


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
    port = args.port or free_port()
    workdir = tempfile.mkdtemp(prefix="syncscope-demo-")
    job = "demo"
    exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = start_prometheus(port, workdir) if args.prometheus == "auto" else None
    base = f"http://127.0.0.1:{port}"
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
    print(f"  metrics  {base}/metrics\n  state    {base}/v1/state")
    if prom is not None:
        print(
            f"  prometheus http://127.0.0.1:{prom[1]}  (rules loaded: {len(_rule_files())} files)"
        )
    ranks = launch(
        args.ranks, train_args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    tty = sys.stdout.isatty()
    last_print = 0.0
    state: dict[str, Any] = {"jobs": {}}
    try:
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
                err = (
                    ranks[i].stderr.read().decode(errors="replace")[-2000:]
                    if ranks[i].stderr
                    else ""
                )
                print(f"rank {i} failed (exit {ranks[i].returncode}):\n{err}", file=sys.stderr)
            return 1
        named = (state["jobs"].get(job, {}).get("diagnosis", {}).get("straggler") or {}).get("rank")
        expected = args.slow_rank if args.slow_rank >= 0 else None
        print(f"\nslowed rank: {expected}; syncscope named: {named}")
        return 0
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
        exporter.terminate()
        if prom is not None:
            prom[0].terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            exporter.wait(5)
        shutil.rmtree(workdir, ignore_errors=True)
