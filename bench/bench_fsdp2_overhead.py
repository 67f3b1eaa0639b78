"""What the agent costs an FSDP2 job, whose steps issue tens of collectives: step time and
training-thread CPU with the agent against without, side by side in interleaved rounds of one
4-rank gloo job (a real exporter beside it), and the interception's cost per collective.

Every rank runs the same rounds in the same order (the collectives keep them in step): in each
round one arm attaches the agent, runs its steps and closes it, the other runs them bare; the
order alternates. A round's ratio is the agent arm's median step over the bare arm's, for the
ranks' slowest (the job's step); the CI bootstraps rounds. Also the same for each arm's fastest
step, which this machine's noise (2 shared cores) moves less than the median.
Run: .venv/bin/python -m bench.bench_fsdp2_overhead [--rounds 30] [--steps 20] [--layers 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from syncscope.lab.stats import median_ci


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument(
        "--world",
        type=int,
        default=4,
        help="ranks (4 share this machine's 2 cores, which makes the figure noisy; 2 do not)",
    )
    p.add_argument("--steps", type=int, default=20, help="steps per arm")
    p.add_argument("--layers", type=int, default=8, help="fully_shard units (one Linear each)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument(
        "--exporter",
        choices=("http", "none"),
        default="http",
        help="http: a real exporter beside the job, sharing its cores (default); none: the "
        "agent alone, its reporter thread draining with nowhere to send",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # result path of a rank
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from syncscope.agent import attach
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.environ['SYNCSCOPE_INIT_FILE']}",
        rank=rank,
        world_size=args.world,
    )
    torch.manual_seed(0)
    layers = [torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.layers)]
    net = torch.nn.Sequential(*layers)
    mesh = init_device_mesh("cpu", (args.world,), mesh_dim_names=("shard",))
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)
    x = torch.randn(args.batch, args.hidden)

    def steps(n: int) -> tuple[list[float], float]:
        wall, cpu0 = [], time.thread_time_ns()
        for _ in range(n):
            t0 = time.perf_counter()
            net(x).sum().backward()
            opt.step()
            opt.zero_grad()
            wall.append(time.perf_counter() - t0)
        return wall, (time.thread_time_ns() - cpu0) / n

    steps(5)
    probe = attach(model=net, optimizer=opt, exporter=None, flush_interval_s=3600)
    steps(3)
    if probe.patch is not None:
        probe.patch.poll()
    per_step = len([c for c in probe.queues.collectives if c[0] != "ddp_grad_sync"]) / 3
    kernel = probe.patch.kernel if probe.patch is not None else "no (interception off)"
    probe.close()
    rounds = []
    for r in range(args.rounds):
        arms = {}
        for arm in ("agent", "none") if r % 2 == 0 else ("none", "agent"):
            agent = attach(model=net, optimizer=opt) if arm == "agent" else None
            steps(2)
            wall, cpu = steps(args.steps)
            if agent is not None:
                agent.close()
            arms[arm] = {"median_s": statistics.median(wall), "min_s": min(wall), "cpu_ns": cpu}
        rounds.append(arms)
    with open(args.worker.format(rank=rank), "w") as f:
        json.dump(
            {"rank": rank, "rounds": rounds, "collectives_per_step": per_step, "kernel": kernel}, f
        )
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    from syncscope.lab.launch import launch, wait_all
    from syncscope.lab.servers import free_port, start_exporter

    tmp = tempfile.mkdtemp(prefix="syncscope-fsdp2-bench-")
    env = {k: v for k, v in os.environ.items() if k != "SYNCSCOPE_EXPORTER"}
    exporter = None
    if args.exporter == "http":
        port = free_port()
        exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env["SYNCSCOPE_EXPORTER"] = f"http://127.0.0.1:{port}"
    try:
        flags = list(argv if argv is not None else sys.argv[1:])
        flags += ["--worker", os.path.join(tmp, "rank{rank}.json")]
        world = args.world
        codes = wait_all(launch(world, flags, env=env, module="bench.bench_fsdp2_overhead"), 3600)
        assert codes == [0] * world, codes
    finally:
        if exporter is not None:
            exporter.terminate()
            exporter.wait(10)
    results = []
    for rank in range(args.world):
        with open(os.path.join(tmp, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    report(results, args)


def report(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    n_rounds = len(results[0]["rounds"])
    ratios, fastest, cpu = [], [], []
    for i in range(n_rounds):
        arms = [r["rounds"][i] for r in results]
        on = max(a["agent"]["median_s"] for a in arms)
        off = max(a["none"]["median_s"] for a in arms)
        ratios.append(on / off - 1)
        fastest.append(
            max(a["agent"]["min_s"] for a in arms) / max(a["none"]["min_s"] for a in arms) - 1
        )
        cpu += [
            r["rounds"][i]["agent"]["cpu_ns"] - r["rounds"][i]["none"]["cpu_ns"] for r in results
        ]
    per_step = statistics.median(r["collectives_per_step"] for r in results)
    low, high = median_ci(ratios, random.Random(0))
    bare = statistics.median(
        max(r["rounds"][i]["none"]["median_s"] for r in results) for i in range(n_rounds)
    )
    print(
        f"FSDP2, {args.world} ranks gloo CPU, exporter {args.exporter}, "
        f"{args.layers} fully_shard units of {args.hidden}^2, "
        f"{n_rounds} rounds x {args.steps} steps per arm; step {bare * 1e3:.1f} ms bare"
    )
    print(
        f"collectives per step (recorded by the agent): {per_step:.0f}, "
        f"timed by the {results[0]['kernel']} kernel"
    )
    print(
        f"step time, agent vs none: median {statistics.median(ratios):+.2%} "
        f"(90% CI {low:+.2%} .. {high:+.2%})"
    )
    low, high = median_ci(fastest, random.Random(0))
    print(
        f"fastest step of each arm (less of this machine's noise), agent vs none: median "
        f"{statistics.median(fastest):+.2%} (90% CI {low:+.2%} .. {high:+.2%})"
    )
    # each round's figure, so that runs of the same job can be pooled (docs/parallelism.md)
    print(f"round ratios, median step, agent/none - 1 (%): {[round(r * 100, 2) for r in ratios]}")
    cpu_med = statistics.median(cpu)
    print(
        f"training-thread CPU per step, agent minus none: {cpu_med / 1e3:+.0f} us "
        f"(quartiles {statistics.quantiles(cpu, n=4)[0] / 1e3:+.0f} .. "
        f"{statistics.quantiles(cpu, n=4)[2] / 1e3:+.0f}); per collective "
        f"{cpu_med / 1e3 / max(per_step, 1):+.1f} us"
    )


if __name__ == "__main__":
    main()
