"""Flight Recorder dumps at agreed steps vs at each rank's own times: what a synchronous job pays.

A dump (`_dump_nccl_trace` + `pickle.loads`, ~45 ms for 2000 entries on the H100) holds the GIL,
stalling its rank's training thread; in synchronous training every rank then waits for that
one at the next collective. Dumped at each rank's own times, an N-rank job pays about N stalls
per round of dumps; dumped right after the same step on every rank (agent/nccl_trace.py), the
stalls overlap and it pays about one.

This runs a 4-rank gloo job on this machine whose training thread needs the GIL the way a GPU
job's does (short Python bursts between waits), with the real FlightRecorderReader and a dump
replaced by a 45 ms GIL-holding stall, in three arms, interleaved (none, aligned, unaligned,
unaligned, aligned, none):
  none       no dumps: the job's own step time
  aligned    the reader's own thread, woken by StepTimeline after every 16th step on each rank
  unaligned  the same reader polled from a timer every 16 steps' worth of seconds, each rank
             from its own phase: how the reader worked before (its own timer per rank)
Both arms dump equally often (the period is fixed at 16 steps here; the agent picks a power of
two of steps from the dump's cost and its budget, tests/unit/test_nccl_trace.py). Prints the
mean step time of each arm, the dumps per rank, and the job time lost per round of dumps in
units of one stall: about 1 when the stalls coincide, up to the number of ranks when not.

  .venv/bin/python bench/bench_dump_alignment.py [--ranks 4] [--steps 160] [--stall-ms 45]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import pickle
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

PERIOD = 16  # steps between dumps, both arms


def gil_stall(seconds: float):
    """A dump stand-in that holds the GIL for `seconds` without using a CPU: libc usleep through
    ctypes.PyDLL, which keeps the GIL across the call. (A busy loop would make four ranks
    stalling together on this 2-core machine take twice as long, which a real node's per-rank
    cores would not.)"""
    usleep = ctypes.PyDLL(None).usleep
    micros = int(seconds * 1e6)
    one = pickle.dumps({"entries": [{"record_id": 0, "state": "scheduled"}]})

    def stall() -> bytes:
        usleep(micros)
        return one

    return stall


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from syncscope.agent.nccl_trace import FlightRecorderReader, StepTimeline

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init}", rank=rank, world_size=args.ranks
    )
    stall = gil_stall(args.stall_ms / 1000)
    timeline = StepTimeline(dump_every=PERIOD)
    reader = FlightRecorderReader(
        deque(maxlen=10),
        dump=stall,
        timeline=timeline,
        current_step=lambda: len(ends),
        thread_guard=lambda: True,
    )
    reader.reschedule = lambda: None  # type: ignore[method-assign]  # the period stays PERIOD
    stop = threading.Event()
    ends: list[float] = []
    if args.arm == "aligned":
        reader.start()
    elif args.arm == "unaligned":

        def timer() -> None:  # the old loop: a period of its own, from this rank's own start
            def interval() -> float:
                return PERIOD * (timeline.step_seconds() or 0.05)

            if stop.wait(random.Random(rank).uniform(0, interval())):
                return
            while True:
                reader.poll()
                if stop.wait(interval()):
                    return

        threading.Thread(target=timer, daemon=True).start()

    x = torch.randn(64, 64)
    grad = torch.zeros(4096)
    for step in range(args.warmup + args.steps):
        for _ in range(20):  # the training thread: short GIL-holding bursts between waits
            x = torch.tanh(x @ x) * 0.5
            time.sleep(0.002)
        dist.all_reduce(grad)  # the synchronisation point
        timeline.mark(step)
        ends.append(time.perf_counter())
    stop.set()
    reader.stop()
    dist.barrier()
    window = ends[args.warmup :]
    result = {
        "rank": rank,
        "mean_step_ms": (window[-1] - window[0]) / (len(window) - 1) * 1e3,
        "dumps": reader.stats["dumps"],
        "dump_every": timeline.dump_every,
        "dump_steps": list(reader.dump_steps)[:8],
    }
    dist.destroy_process_group()
    print(json.dumps(result), flush=True)


def run_arm(arm: str, args: argparse.Namespace) -> list[dict]:
    init = os.path.join(tempfile.mkdtemp(prefix="syncscope-bench-dumps-"), "store")
    procs = []
    for rank in range(args.ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
            GLOO_SOCKET_IFNAME="lo",
            OMP_NUM_THREADS="1",
        )
        cmd = [sys.executable, __file__, "--worker", "--arm", arm, "--init", init]
        cmd += ["--ranks", str(args.ranks), "--steps", str(args.steps)]
        cmd += ["--warmup", str(args.warmup), "--stall-ms", str(args.stall_ms)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            sys.exit(f"{arm}: a rank exited with {proc.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    shutil.rmtree(os.path.dirname(init), ignore_errors=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--steps", type=int, default=160)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--stall-ms", type=float, default=45.0)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="none", help=argparse.SUPPRESS)
    p.add_argument("--init", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    order = ["none", "aligned", "unaligned", "unaligned", "aligned", "none"]
    step_ms: dict[str, list[float]] = {arm: [] for arm in order}
    dumps: dict[str, list[int]] = {arm: [] for arm in order}
    for arm in order:
        results = run_arm(arm, args)
        # the job's step time: every rank waits for the slowest at each all_reduce
        step_ms[arm].append(max(r["mean_step_ms"] for r in results))
        dumps[arm].extend(r["dumps"] for r in results)
        print(
            f"{arm:10s} step {step_ms[arm][-1]:7.2f} ms  dumps per rank "
            f"{[r['dumps'] for r in results]}  period (steps) {[r['dump_every'] for r in results]}"
            f"  first dump steps {results[0]['dump_steps'][:4]}",
            flush=True,
        )
    mean = {arm: statistics.mean(v) for arm, v in step_ms.items()}
    extra_aligned = mean["aligned"] - mean["none"]
    extra_unaligned = mean["unaligned"] - mean["none"]
    print(f"\n{args.ranks} ranks, {args.stall_ms:.0f} ms GIL-holding dump every {PERIOD} steps")
    for arm in ("none", "aligned", "unaligned"):
        print(
            f"  {arm:10s} mean step {mean[arm]:7.2f} ms   dumps per rank per run "
            f"{statistics.mean(dumps[arm]):5.1f}"
        )
    print(
        f"  extra step time: aligned {extra_aligned:+.2f} ms, unaligned {extra_unaligned:+.2f} ms"
    )
    for arm, extra in (("aligned", extra_aligned), ("unaligned", extra_unaligned)):
        rounds = statistics.mean(dumps[arm])  # dumps per rank per run = rounds of dumps
        lost = extra * args.steps / rounds if rounds else 0.0
        print(
            f"  {arm:10s} job time lost per round of dumps {lost:6.1f} ms"
            f" = {lost / args.stall_ms:.2f} stalls"
        )
    if extra_aligned > 0:
        print(f"  unaligned / aligned extra step time = {extra_unaligned / extra_aligned:.2f}")
    print(f"  job step time unaligned / aligned = {mean['unaligned'] / mean['aligned']:.3f}")


if __name__ == "__main__":
    main()
