"""Agent overhead on the training thread, measured side by side in one run (interleaved A/B).

Prints, for a tiny model (so the hooks are visible) and for a ~10 ms CPU step:
  training-thread CPU per step (time.thread_time_ns) with and without the agent, the
  difference in µs, and the median step-time ratio. Targets: ≤ 50 µs per step (issue 2),
  ≤ 25 µs and ≤ 0.5 % on a 10 ms step (issue 7).
Run: .venv/bin/python bench/bench_agent_overhead.py [--rounds 10] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from syncscope.agent import attach


def make(hidden: int, layers: int):
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*mods, torch.nn.Linear(hidden, 1))
    )
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def run(model, opt, x, y, steps: int, with_agent: bool) -> tuple[float, list[float]]:
    agent = (
        attach(model=model, optimizer=opt, exporter=None, patch_collectives=True)
        if with_agent
        else None
    )
    times = []
    cpu0 = time.thread_time_ns()
    for _ in range(steps):
        t = time.perf_counter_ns()
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append((time.perf_counter_ns() - t) / 1e3)
    cpu = (time.thread_time_ns() - cpu0) / 1e3 / steps
    if agent is not None:
        agent.close()
    return cpu, times


def scenario(name: str, hidden: int, layers: int, batch: int, rounds: int, steps: int) -> None:
    model, opt = make(hidden, layers)
    x, y = torch.randn(batch, hidden), torch.randn(batch, 1)
    run(model, opt, x, y, 50, False)  # warm-up
    cpu = {False: [], True: []}
    step = {False: [], True: []}
    for i in range(rounds):
        for with_agent in (False, True) if i % 2 == 0 else (True, False):
            c, t = run(model, opt, x, y, steps, with_agent)
            cpu[with_agent].append(c)
            step[with_agent].append(statistics.median(t))
    c0, c1 = statistics.median(cpu[False]), statistics.median(cpu[True])
    s0, s1 = statistics.median(step[False]), statistics.median(step[True])
    print(f"{name}: step {s0 / 1e3:.2f} ms")
    print(
        f"  training-thread CPU per step: without {c0:.1f} µs, with {c1:.1f} µs -> +{c1 - c0:.1f} µs"
    )
    print(f"  median step time ratio with/without: {s1 / s0:.4f} ({(s1 / s0 - 1) * 100:+.2f} %)")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps", type=int, default=300)
    a = p.parse_args()
    torch.set_num_threads(1)
    store = tempfile.mktemp(prefix="syncscope-bench-")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    scenario(
        "tiny model (hooks dominate)", hidden=16, layers=1, batch=4, rounds=a.rounds, steps=a.steps
    )
    scenario(
        "~10 ms CPU step",
        hidden=512,
        layers=4,
        batch=256,
        rounds=a.rounds,
        steps=max(50, a.steps // 5),
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
