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
import urllib.parse
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


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_repo_module(relpath: str, name: str) -> Any:
    """A module from the source checkout (deploy/, dashboards/ are not installed packages)."""
    import importlib.util

    path = os.path.join(REPO_ROOT, relpath)
    if not os.path.exists(path):
        return None
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


class Prometheus:
    """A real Prometheus process on 127.0.0.1 with a temporary TSDB."""

    def __init__(self, config_text: str, workdir: str, port: int | None = None) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise FileNotFoundError("prometheus is not installed (scripts/setup installs it)")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(workdir, "prometheus.yml")
        with open(config, "w") as f:
            f.write(config_text)
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(self.url + "/-/ready", timeout=1) as r,
            ):  # noqa: S310
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError("prometheus not ready")

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        reply = get_json(url)
        if reply.get("status") != "success":
            raise RuntimeError(f"query failed: {promql}: {reply}")
        return reply["data"]["result"]

    def alerts(self) -> list[dict[str, Any]]:
        return get_json(self.url + "/api/v1/alerts")["data"]["alerts"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)
            if self.proc.poll() is None:
                self.proc.kill()


def prometheus_config(
    exporter_port: int, workdir: str, overrides: dict[str, Any] | None = None, fast: bool = False
) -> str:
    """syncscope's rules (regenerated into workdir, with overrides) and a 1 s scrape of the exporter."""
    rules = load_repo_module("deploy/prometheus/generate.py", "syncscope_rules")
    render = load_repo_module("deploy/prometheus/render.py", "syncscope_render")
    rule_globs: list[str] = []
    if rules is not None:
        settings = dict(overrides or {})
        if fast:
            settings = {
                **rules.fast_for_overrides(rules.load_config(), "2s"),
                "windows.rate": "10s",
                "windows.straggler": "10s",
                **settings,
            }
        rules.write_rules(os.path.join(workdir, "rules"), settings)
        rule_globs = [os.path.join(workdir, "rules", "*.yml")]
    if render is not None:
        return render.render_config(f"127.0.0.1:{exporter_port}", "1s", rule_globs)
    return scrape_config(exporter_port)


def scrape_config(exporter_port: int) -> str:
    """The smallest config: scrape the exporter every second, keep its job label, no rules."""
    lines = [
        "global:",
        "  scrape_interval: 1s",
        "  evaluation_interval: 1s",
        "scrape_configs:",
        "  - job_name: syncscope",
        "    honor_labels: true",
        "    static_configs:",
        f"      - targets: ['127.0.0.1:{exporter_port}']",
    ]
    return "\n".join(lines) + "\n"


def start_prometheus(exporter_port: int, workdir: str) -> Prometheus | None:
    """Prometheus scraping the exporter every second with syncscope's rules, if installed."""
    if shutil.which("prometheus") is None:
        return None
    prom = Prometheus(prometheus_config(exporter_port, workdir, fast=True), workdir)
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
    port = args.port or free_port()
    workdir = tempfile.mkdtemp(prefix="syncscope-demo-")
    job = "demo"
    exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    prom = start_prometheus(port, workdir) if args.prometheus == "auto" else None
    base = f"http://127.0.0.1:{port}"
    # Ranks' stderr goes to a file: a pipe nobody drains would block a chatty rank.
    rank_log = open(os.path.join(workdir, "ranks.log"), "w+b")  # noqa: SIM115 - closed in finally
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
    ranks = launch(args.ranks, train_args, env=env, stdout=subprocess.DEVNULL, stderr=rank_log)
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
                print(f"rank {i} failed (exit {ranks[i].returncode})", file=sys.stderr)
            rank_log.flush()
            with open(rank_log.name, errors="replace") as f:
                print(f.read()[-4000:], file=sys.stderr)
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
            prom.stop()
        with contextlib.suppress(subprocess.TimeoutExpired):
            exporter.wait(5)
        rank_log.close()
        shutil.rmtree(workdir, ignore_errors=True)
