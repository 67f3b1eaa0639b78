"""What the agent costs an FSDP2 job, whose steps issue tens of collectives: step time and
training-thread CPU with the agent against without, side by side in one run (a real exporter
beside it), and the interception's cost per collective.

Two ways to put the arms side by side (--mode; auto picks paired where the machine has the
cores for it, 2 x world + 2, else interleaved):
- paired: two copies of the job run at the same time, one with the agent attached once for the
  whole run (as a real job has it), one never attached. Rounds start at the same wall-clock
  marks in both, and each rank holds one core of its own, the two jobs trading core sets every
  round; what moves the whole machine (a neighbour, the clock speed, the memory bus) moves both
  arms of a round alike, and the cores' differences cancel over the rounds.
- interleaved: one job; in each round one arm attaches the agent, runs its steps and closes it,
  the other runs them bare, the order alternating (what 2 shared cores allow).
A round's ratio is the agent arm's median step over the bare arm's, for the ranks' slowest (the
job's step); the CI bootstraps rounds. Also the same for each arm's fastest step, which noise
moves less than the median.
Run: .venv/bin/python -m bench.bench_fsdp2_overhead [--rounds 30] [--steps 20] [--layers 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from syncscope.lab.stats import median_ci

MODULE = "bench.bench_fsdp2_overhead"
ARMS = ("agent", "none")


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
    p.add_argument(
        "--mode",
        choices=("auto", "paired", "interleaved"),
        default="auto",
        help="paired: the two arms as two jobs at once, each rank on a core of its own; "
        "interleaved: one job, the arms in turn (auto: paired where there are 2 x world + 2 "
        "cores; paired on fewer shares them)",
    )
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # result path of a rank
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # a paired job's arm
    p.add_argument("--cores", default=None, help=argparse.SUPPRESS)  # its rounds' core sets
    p.add_argument("--sync", default=None, help=argparse.SUPPRESS)  # the jobs' meeting place
    return p.parse_args(argv)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from syncscope.agent import attach
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = int(os.environ["RANK"])
    cores = _core_sets(args.cores)[rank] if args.cores else None
    if cores is not None:  # before any thread starts: gloo's and the agent's start here too
        os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
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

    def arm(wall: list[float], cpu: float) -> dict[str, float]:
        return {"median_s": statistics.median(wall), "min_s": min(wall), "cpu_ns": cpu}

    steps(5)
    # Every job (both of a paired run) counts its collectives with an agent of its own, closed
    # again before the measured rounds: each has loaded and unloaded the same kernels.
    probe = attach(model=net, optimizer=opt, exporter=None, flush_interval_s=3600)
    steps(3)
    if probe.patch is not None:
        probe.patch.poll()
    per_step = len([c for c in probe.queues.collectives if c[0] != "ddp_grad_sync"]) / 3
    kernel = probe.patch.kernel if probe.patch is not None else "no (interception off)"
    probe.close()
    # One JSON line per round as it completes, after a first line of facts, so that a run cut
    # short (the device call's time, a timeout) still reports the rounds it finished.
    out = open(args.worker.format(rank=rank), "w")  # noqa: SIM115 - written round by round
    _line(out, {"rank": rank, "collectives_per_step": per_step, "kernel": kernel})
    if cores is not None:  # paired: this job is one arm, attached (or not) for the whole run
        agent = attach(model=net, optimizer=opt) if args.arm == "agent" else None
        # Both jobs warm up together, so that each measures its step beside the other; the
        # rounds then start at the same wall-clock marks in both, a period apart that leaves
        # the slower job's round a fifth again to spare.
        me = f"{args.arm}-{rank}"
        _meet(args.sync, "ready", me, args.world)
        warm, _ = steps(10)
        seen = _meet(args.sync, "warm", me, args.world, step_s=statistics.median(warm))
        period = 1.2 * (args.steps + 2) * max(s["step_s"] for s in seen) + 0.05
        start = max(s["at"] for s in seen) + 0.5
        if rank == 0:
            warm_ms = ", ".join(f"{s['step_s'] * 1e3:.1f}" for s in seen)
            print(
                f"{args.arm}: {args.rounds} rounds, {period:.2f} s apart (warm steps, ms: "
                f"{warm_ms})",
                file=sys.stderr,
                flush=True,
            )
        for r in range(args.rounds):
            delay = start + r * period - time.time()
            _pin_process(cores[r % 2])
            if delay > 0:
                time.sleep(delay)
            steps(2)
            _line(out, {"round": {args.arm: arm(*steps(args.steps))}, "late": delay <= 0})
            if rank == 0 and (r + 1) % 10 == 0:
                print(f"{args.arm}: round {r + 1}", file=sys.stderr, flush=True)
        if agent is not None:
            agent.close()
    else:
        for r in range(args.rounds):
            arms = {}
            for name in ARMS if r % 2 == 0 else ARMS[::-1]:
                agent = attach(model=net, optimizer=opt) if name == "agent" else None
                steps(2)
                arms[name] = arm(*steps(args.steps))
                if agent is not None:
                    agent.close()
            _line(out, {"round": arms, "late": False})
    out.close()
    dist.destroy_process_group()


def _line(out: Any, record: dict[str, Any]) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def read_rank(path: str) -> dict[str, Any]:
    """A rank's result file (its facts, then a line per round; a line cut off mid-write by a
    kill is left out) as report() takes it."""
    with open(path) as f:
        lines = []
        for text in f:
            with contextlib.suppress(ValueError):
                lines.append(json.loads(text))
    facts = lines[0] if lines else {}
    rounds = [line for line in lines[1:] if "round" in line]
    return {
        **facts,
        "rounds": [line["round"] for line in rounds],
        "late_rounds": sum(bool(line["late"]) for line in rounds),
    }


def _core_sets(text: str) -> list[tuple[int, int]]:
    """ "a,b/c,d": rank i's core in even rounds (a, b, ...) and in odd ones (c, d, ...)."""
    even, odd = ([int(c) for c in half.split(",")] for half in text.split("/"))
    return list(zip(even, odd, strict=True))


def _pin_process(core: int) -> None:
    """Every thread of this process (the training thread, gloo's, the agent's) onto `core`."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that has just exited
            os.sched_setaffinity(int(tid), {core})


def _meet(sync: str, phase: str, me: str, world: int, **mine: float) -> list[dict[str, float]]:
    """Wait until every rank of both jobs has reached `phase`; what each wrote there (its
    time of arrival, `at`, and `mine`)."""
    path = os.path.join(sync, f"{phase}.{me}")
    with open(path + ".tmp", "w") as f:
        json.dump({"at": time.time(), **mine}, f)
    os.rename(path + ".tmp", path + ".json")
    deadline = time.monotonic() + 600
    while True:
        names = [n for n in os.listdir(sync) if n.startswith(phase + ".") and n.endswith(".json")]
        if len(names) == 2 * world:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the other job never reached {phase}: {sorted(names)}")
        time.sleep(0.05)
    seen = []
    for name in names:
        with open(os.path.join(sync, name)) as f:
            seen.append(json.load(f))
    return seen


def paired_cores(world: int, force: bool = False) -> tuple[str, set[int]] | None:
    """The ranks' core sets for a paired run (see _core_sets) and the cores left for the rest,
    or None where this machine has fewer than 2 x world + 2 (unless `force`: then ranks share
    cores, round robin, and the figure is only as good as that). The first two are left to the
    exporter and the system where there are cores to spare."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 * world + 2 and not force:
        return None
    skip = 2 if len(cores) >= 2 * world + 4 else 0
    ranks = [cores[(skip + i) % len(cores)] for i in range(2 * world)]
    a, b = ranks[:world], ranks[world:]
    rest = (set(cores) - set(ranks)) or set(cores)

    def text(even: list[int], odd: list[int]) -> str:
        return ",".join(map(str, even)) + "/" + ",".join(map(str, odd))

    # the agent's job holds set a in even rounds, the bare job set b; they trade each round
    return text(a, b) + "|" + text(b, a), rest


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    from syncscope.lab.launch import RankProcess, launch, wait_all
    from syncscope.lab.servers import free_port, start_exporter

    plan = (
        paired_cores(args.world, force=args.mode == "paired")
        if args.mode != "interleaved"
        else None
    )
    tmp = tempfile.mkdtemp(prefix="syncscope-fsdp2-bench-")
    if plan is not None:
        os.sched_setaffinity(0, plan[1])  # the exporter and this process keep off the ranks'
    env = {k: v for k, v in os.environ.items() if k != "SYNCSCOPE_EXPORTER"}
    exporter = None
    if args.exporter == "http":
        port = free_port()
        exporter = start_exporter(port, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        env["SYNCSCOPE_EXPORTER"] = f"http://127.0.0.1:{port}"
    jobs: list[list[RankProcess]] = []
    cut_short = False

    def stop(_signum: int, _frame: Any) -> None:
        raise TimeoutError

    signal.signal(signal.SIGTERM, stop)  # `timeout`'s: report the rounds done so far
    try:
        flags = list(argv if argv is not None else sys.argv[1:])
        if plan is None:
            flags += ["--worker", os.path.join(tmp, "interleaved-rank{rank}.result")]
            jobs.append(launch(args.world, flags, env=env, module=MODULE))
        else:
            for name, cores in zip(ARMS, plan[0].split("|"), strict=True):
                job = [f"--arm={name}", f"--cores={cores}", f"--sync={tmp}"]
                job += ["--worker", os.path.join(tmp, name + "-rank{rank}.result")]
                jobs.append(launch(args.world, flags + job, env=env, module=MODULE))
        for procs in jobs:
            codes = wait_all(procs, 3600)
            assert codes == [0] * args.world, codes
    except (TimeoutError, KeyboardInterrupt):
        cut_short = True
        for p in (p for procs in jobs for p in procs if p.poll() is None):
            p.kill()
            p.wait()
    finally:
        if exporter is not None:
            exporter.terminate()
            exporter.wait(10)
    results = []
    for rank in range(args.world):
        if plan is None:
            results.append(read_rank(os.path.join(tmp, f"interleaved-rank{rank}.result")))
            continue
        agent, bare = (read_rank(os.path.join(tmp, f"{n}-rank{rank}.result")) for n in ARMS)
        # one record per rank, its rounds holding both jobs' arms (what report() reads)
        merged = dict(agent, late_rounds=agent["late_rounds"] + bare["late_rounds"])
        # (cut short, one job may be a round ahead of the other: the rounds both finished)
        pairs = zip(agent["rounds"], bare["rounds"], strict=False)
        merged["rounds"] = [{**a, **n} for a, n in pairs]
        results.append(merged)
    done = min(len(r["rounds"]) for r in results)
    if cut_short:
        print(f"cut short: {done} of {args.rounds} rounds done by every rank", flush=True)
    if done == 0:
        raise SystemExit("no round finished")
    for r in results:
        del r["rounds"][done:]
    args.mode = "interleaved" if plan is None else "paired"
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
    late = sum(r.get("late_rounds", 0) for r in results)
    print(
        f"arms {getattr(args, 'mode', 'interleaved')}"
        + (f"; {late} rank-rounds started after their mark" if late else "")
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
