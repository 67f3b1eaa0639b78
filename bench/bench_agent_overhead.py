"""Agent overhead on the training thread, measured side by side in one run (interleaved A/B/C).

Arms: no agent, the agent as committed at a git revision (`--against`, default HEAD; its
package is taken from `git show` and loaded beside this tree's), and this tree's agent. Each
round runs every arm, in rotating order. Prints, for a tiny model (so the hooks are visible)
and for a ~10 ms CPU step, with the agents reporting to a real exporter on 127.0.0.1 (as in
production), one column per agent and one for their difference:
  training-thread CPU per step (time.thread_time_ns), with minus without the agent (medians
  of per-round differences);
  whole-process CPU per step, which adds the reporter thread's work;
  step time, as the ratio of mean wall time per step (so the steps the reporter interrupts
  count; each 10 ms arm spans about two flush intervals, at a random phase): the median of
  per-round ratios with a 90 % bootstrap interval, and the ratio of the means over all rounds.
  Targets: <= 25 µs of training-thread CPU per step and <= 0.5 % on a 10 ms step (issue 7).
Then each reporter's CPU per flush, and the longest GIL pause a background reporter inflicts
on a CPU-bound Python thread, in steady state and when it drains full queues after a backlog.
By default the trainer (with its reporter thread) is pinned to CPU 0 and the exporter to CPU 1,
as a sidecar has its own core on a real node; --no-pin lets the OS place them. Pinned, the
reporter shares the trainer's core, so its CPU lands on the step time in full: the worst case.
Run: .venv/bin/python bench/bench_agent_overhead.py [--rounds 20] [--step-rounds 60]
         [--against HEAD | --against none] [--no-pin]
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import syncscope.agent
import torch
import torch.distributed as dist
from syncscope.agent.config import AgentConfig

from syncscope.servers import free_port, start_exporter

ROOT = Path(__file__).resolve().parents[1]
TREE = "this tree"


def load_agent_at(rev: str) -> ModuleType:
    """The agent package as committed at `rev`, importable beside this tree's.

    Its files come from `git show`, its imports of `syncscope.agent` point at itself; the rest
    of syncscope (wire, arrival) is this tree's, which the wire schema's stability allows.
    """
    sha = git("rev-parse", "--short", rev).strip()
    files = [p for p in git("ls-tree", "--name-only", rev, "agent/").split() if p.endswith(".py")]
    if not files:
        raise SystemExit(f"no agent/ package at {rev}")
    name = f"syncscope_agent_{sha}"
    where = Path(tempfile.mkdtemp(prefix="syncscope-bench-agent-"))
    (where / name).mkdir()
    for path in files:
        source = re.sub(r"\bsyncscope\.agent\b", name, git("show", f"{rev}:{path}"))
        (where / name / Path(path).name).write_text(source)
    sys.path.insert(0, str(where))
    return importlib.import_module(name)


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def make(hidden: int, layers: int):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))
    )
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def run(
    model, opt, x, y, steps: int, attach: Callable[..., Any] | None, exporter: str, warm_s=0.0
) -> tuple[float, float, float]:
    """One arm: (training-thread CPU µs, whole-process CPU µs, wall µs), each per step.

    Wall is the mean over all the arm's steps, so the steps the reporter interrupts count too.
    Untimed steps for `warm_s` first: drawn at random per round, they put the reporter's
    flushes at a random phase of the timed window, so it holds steps/interval of them on
    average (right after attach() the first flush always comes one interval in).
    """
    agent = (
        attach(model=model, optimizer=opt, exporter=exporter, job="bench")
        if attach is not None
        else None
    )

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    until = time.perf_counter() + warm_s
    while time.perf_counter() < until:
        step()
    cpu0, proc0, wall0 = time.thread_time_ns(), time.process_time_ns(), time.perf_counter_ns()
    for _ in range(steps):
        step()
    wall = time.perf_counter_ns() - wall0
    cpu, proc = time.thread_time_ns() - cpu0, time.process_time_ns() - proc0
    if agent is not None:
        agent.close()  # after the clocks stopped: its final flush is not the steps' cost
    return cpu / 1e3 / steps, proc / 1e3 / steps, wall / 1e3 / steps


def median_ci(values: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """A 90 % bootstrap interval of the median."""
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.05 * n)], meds[int(0.95 * n)]


def ratio_of_means_ci(
    a: list[float], b: list[float], rng: random.Random, n: int = 2000
) -> tuple[float, float]:
    """A 90 % bootstrap interval of sum(a) / sum(b), resampling rounds (pairs stay paired)."""
    idx = range(len(a))
    out = []
    for _ in range(n):
        pick = rng.choices(idx, k=len(a))
        out.append(sum(a[i] for i in pick) / sum(b[i] for i in pick))
    out.sort()
    return out[int(0.05 * n)], out[int(0.95 * n)]


def pct(ratio: float) -> str:
    return f"{(ratio - 1) * 100:+.2f} %"


class Table:
    """A title, then rows of a label and one cell per column, the columns aligned."""

    def __init__(self, columns: list[str], label_width: int = 50, width: int = 31) -> None:
        self.columns, self.label_width, self.width = columns, label_width, width

    def header(self, title: str) -> None:
        if title:
            print(title)
        self.row("", self.columns)

    def row(self, label: str, cells: list[str]) -> None:
        line = (
            "  " + label.ljust(self.label_width - 2) + "".join(c.ljust(self.width) for c in cells)
        )
        print(line.rstrip())


def scenario(
    name: str,
    hidden: int,
    layers: int,
    batch: int,
    rounds: int,
    steps: int,
    exporter: str,
    agents: dict[str, Callable[..., Any]],
) -> None:
    model, opt = make(hidden, layers)
    x, y = torch.randn(batch, hidden), torch.randn(batch, 1)
    run(model, opt, x, y, 50, None, exporter)  # warm-up
    for attach in agents.values():
        run(model, opt, x, y, 50, attach, exporter)
    arms: list[str | None] = [None, *agents]
    results: dict[str | None, list[tuple[float, float, float]]] = {a: [] for a in arms}
    rng = random.Random(0)
    interval = AgentConfig().flush_interval_s
    for i in range(rounds):
        warm_s = rng.uniform(0.0, interval)
        order = arms[i % len(arms) :] + arms[: i % len(arms)]
        if i // len(arms) % 2:
            order.reverse()
        for arm in order:
            results[arm].append(run(model, opt, x, y, steps, agents.get(arm), exporter, warm_s))
    base = results[None]
    q = statistics.quantiles
    table = Table([*agents, f"{TREE} − {next(iter(agents))}"] if len(agents) == 2 else [*agents])
    table.header(
        f"{name}: step {statistics.median(r[2] for r in base) / 1e3:.2f} ms, "
        f"{rounds} rounds x {steps} steps"
    )

    def cpu_cells(k: int) -> list[str]:
        cells = []
        for arm in agents:
            d = [r[k] - b[k] for r, b in zip(results[arm], base, strict=True)]
            cells.append(
                f"{statistics.median(d):+.1f} ({q(d, n=4)[0]:+.1f} .. {q(d, n=4)[2]:+.1f})"
            )
        if len(agents) == 2:
            old, new = agents
            d = [n[k] - o[k] for n, o in zip(results[new], results[old], strict=True)]
            cells.append(
                f"{statistics.median(d):+.1f} ({q(d, n=4)[0]:+.1f} .. {q(d, n=4)[2]:+.1f})"
            )
        return cells

    def ratio_cells(of_means: bool) -> list[str]:
        pairs = [(arm, None) for arm in agents]
        if len(agents) == 2:
            old, new = agents
            pairs.append((new, old))
        cells = []
        for arm, ref in pairs:
            a = [r[2] for r in results[arm]]
            b = [r[2] for r in results[ref]]
            if of_means:
                value, (lo, hi) = sum(a) / sum(b), ratio_of_means_ci(a, b, rng)
            else:
                ratios = [p / r for p, r in zip(a, b, strict=True)]
                value, (lo, hi) = statistics.median(ratios), median_ci(ratios, rng)
            cells.append(f"{pct(value)} ({pct(lo)} .. {pct(hi)})")
        return cells

    table.row("training-thread CPU per step, µs", cpu_cells(0))
    table.row("whole-process CPU per step, µs", cpu_cells(1))
    table.row("step time, median of per-round ratios", ratio_cells(of_means=False))
    table.row("step time, ratio of means over rounds", ratio_cells(of_means=True))
    without = statistics.median(r[0] for r in base)
    print(
        f"  (without an agent: {without:.0f} µs training-thread CPU per step; CPU cells: median "
        "(quartiles) of per-round differences; step-time cells: value (90 % CI))"
    )


def longest_pause(seconds: float, background: threading.Thread | None) -> tuple[float, float]:
    """Longest gap (ms) between iterations of a CPU-bound pure-Python loop, and its p99.99."""
    gaps = []
    if background is not None:
        background.start()
    last = time.perf_counter()
    end = last + seconds
    while True:
        now = time.perf_counter()
        if now > end:
            break
        if now - last > 0.0002:
            gaps.append(now - last)
        last = now
    if background is not None:
        background.join()
    gaps.sort()
    worst = gaps[-1] * 1e3 if gaps else 0.0
    tail = gaps[int(0.9999 * (len(gaps) - 1))] * 1e3 if gaps else 0.0
    return worst, tail


def reporter_for(package: ModuleType, url: str, steps: deque, colls: deque, estimate: bool):
    """A reporter of `package`'s agent as attach() builds it, with or without the local arrival
    estimate (what pacing or the record file turns on)."""
    transport = importlib.import_module(package.__name__ + ".transport")
    kwargs: dict[str, Any] = {
        "identity": {
            "job": "pause",
            "rank": 0,
            "local_rank": 0,
            "world_size": 1,
            "incarnation": "p",
            "hostname": "h",
            "pid": os.getpid(),
            "started_unix_s": time.time(),
        },
        "url": url,
        "token": None,
        "steps": steps,
        "collectives": colls,
        "flush_interval_s": 1.0,
        "send_timeout_s": 1.0,
        "dropped_elsewhere": lambda: 0,
        "pacing_state": lambda: None,
        "topology": lambda: None,
    }
    if "on_drained" in inspect.signature(transport.Reporter).parameters:
        if estimate:  # the estimate is a piece of its own, hung on the reporter's flush
            local = importlib.import_module(package.__name__ + ".local_arrival")
            arrival = local.LocalArrival()
            kwargs.update(on_drained=arrival.drained, on_reply=arrival.merge_reply)
    else:  # before the split, the reporter ran the estimate (and the record file) itself
        kwargs.update(record_path=None, estimate=estimate)
    return transport.Reporter(**kwargs)


def fill(steps: deque, colls: deque, n_steps: int, colls_per_step: int, start: int = 0) -> None:
    for s in range(start, start + n_steps):
        steps.append((s, s * 10_000_000, 10_000_000, 1, 2, 3, 1, 2, 0))
        for k in range(colls_per_step):
            op = "ddp_grad_sync" if k == 0 else "all_reduce"
            colls.append((op, "default_pg", 4096 * (k + 1), 2_000_000 + k, s))


def flush_cost(url: str, packages: dict[str, ModuleType], rounds: int = 60) -> None:
    """Reporter CPU per flush of one default interval of a 10 ms step (100 steps, 100 DDP
    syncs): the GIL time a flush takes from training. Wall includes the exporter's answer.
    Each agent's reporter in both kinds, all interleaved: the default one, and one that also
    feeds the local arrival estimator (pacing on, or a record file)."""
    kinds = [(name, estimate) for estimate in (False, True) for name in packages]
    cpu: dict[tuple[str, bool], list[float]] = {k: [] for k in kinds}
    wall: dict[tuple[str, bool], list[float]] = {k: [] for k in kinds}
    reps = {}
    for name, estimate in kinds:
        steps: deque = deque(maxlen=8192)
        colls: deque = deque(maxlen=32768)
        rep = reporter_for(packages[name], url, steps, colls, estimate)
        reps[(name, estimate)] = (rep, steps, colls)
    for i in range(rounds):
        for kind in kinds if i % 2 else kinds[::-1]:
            rep, steps, colls = reps[kind]
            fill(steps, colls, 100, 1, start=i * 100)
            c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
            rep.flush()
            cpu[kind].append((time.thread_time_ns() - c0) / 1e6)
            wall[kind].append((time.perf_counter_ns() - w0) / 1e6)
    for kind in kinds:
        rep = reps[kind][0]
        assert rep.sent_records == rounds * 200, (kind, rep.sent_records, rep.send_dropped)
    table = Table(list(packages), width=24)
    table.header(
        f"reporter flush, 100 steps + 100 collectives (CPU / wall ms, medians of {rounds - 5})"
    )
    for estimate, label in ((False, "default"), (True, "with the local arrival estimate")):
        table.row(
            label,
            [
                f"{statistics.median(cpu[(n, estimate)][5:]):.3f} / "
                f"{statistics.median(wall[(n, estimate)][5:]):.3f}"
                for n in packages
            ],
        )


def pauses(url: str, packages: dict[str, ModuleType]) -> None:
    base = longest_pause(3.0, None)
    print("GIL pauses seen by a CPU-bound Python loop (longest, p99.99 of gaps > 0.2 ms):")
    print(f"  no background work: {base[0]:.2f} ms, {base[1]:.2f} ms (scheduler noise)")
    steady_cells, backlog_cells, counts = [], [], []
    for package in packages.values():
        # Steady state: a 10 ms step with 2 collectives, flushed every 0.5 s (50 steps, 100
        # colls): twice the default rate, so a conservative reading.
        steps: deque = deque(maxlen=8192)
        colls: deque = deque(maxlen=32768)
        rep = reporter_for(package, url, steps, colls, estimate=False)

        def steady(rep=rep, steps=steps, colls=colls) -> None:
            for i in range(6):
                fill(steps, colls, 50, 2, start=i * 50)
                time.sleep(0.5)
                rep.flush()

        w = longest_pause(3.0, threading.Thread(target=steady))
        steady_cells.append(f"{w[0]:.2f} ms, {w[1]:.2f} ms")
        # Backlog: full queues (8192 steps, 32768 collectives) drained in one flush.
        steps.clear()
        colls.clear()
        fill(steps, colls, 8192, 4)
        took: list[float] = []

        def backlog(rep=rep, took=took) -> None:
            time.sleep(0.2)
            t = time.perf_counter()
            rep.flush()
            took.append((time.perf_counter() - t) * 1e3)

        w = longest_pause(4.0, threading.Thread(target=backlog))
        backlog_cells.append(f"{w[0]:.2f} ms, {w[1]:.2f} ms ({took[0]:.0f} ms)")
        counts.append(f"{rep.sent_records} / {rep.send_dropped}")
    table = Table(list(packages))
    table.header("")
    table.row("steady state (50 steps + 100 colls / flush)", steady_cells)
    table.row("draining full queues (8192 + 32768; flush wall)", backlog_cells)
    table.row("records sent / dropped", counts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--rounds", type=int, default=20, help="rounds of the tiny-model scenario (0 skips it)"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument(
        "--step-rounds",
        type=int,
        default=60,
        help="rounds of the 10 ms scenario (noisier; 0 skips it)",
    )
    p.add_argument("--step-steps", type=int, default=160, help="steps per arm, 10 ms scenario")
    p.add_argument(
        "--against",
        default="HEAD",
        help="git revision whose agent/ package runs beside this tree's ('none': this tree only)",
    )
    p.add_argument("--no-pin", action="store_true", help="let the OS place trainer and exporter")
    a = p.parse_args()
    packages: dict[str, ModuleType] = {}
    if a.against.lower() != "none":
        baseline = load_agent_at(a.against)
        packages[f"{a.against} ({baseline.__name__.rsplit('_', 1)[-1]})"] = baseline
    packages[TREE] = syncscope.agent
    agents = {name: package.attach for name, package in packages.items()}
    # As on a real node, the sidecar has a core of its own: the trainer (and its reporter
    # thread, whose cost is what we measure) on CPU 0, the exporter process on CPU 1.
    pin = not a.no_pin and len(os.sched_getaffinity(0)) >= 2
    if pin:
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="syncscope-bench-")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    port = free_port()
    exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if pin:
        os.sched_setaffinity(exporter.pid, {1})
    url = f"http://127.0.0.1:{port}"
    try:
        where = "trainer on CPU 0, exporter on CPU 1" if pin else "unpinned"
        print(
            f"agents report to a real exporter at {url} ({where}); python "
            f"{sys.version.split()[0]}, torch {torch.__version__}"
        )
        if a.rounds > 0:
            scenario("tiny model (hooks dominate)", 16, 1, 4, a.rounds, a.steps, url, agents)
        if a.step_rounds > 0:
            # ~2 s arms: about two flushes of the reporter in each
            scenario("~10 ms CPU step", 512, 4, 192, a.step_rounds, a.step_steps, url, agents)
        flush_cost(url, packages)
        pauses(url, packages)
    finally:
        exporter.terminate()
        exporter.wait(10)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
