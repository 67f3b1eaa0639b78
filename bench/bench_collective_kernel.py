"""What the collective interception costs per call: the C++ kernel against the Python one and
against none, side by side in interleaved rounds of one process (gloo, world of one, so the
collective itself is a local copy and the interception shows).

Each round times N calls of each kind in each arm, the arms in rotating order; per arm the
median over rounds of the mean time per call, and the arm minus none. The agent's bookkeeping is
in it (records queued, blocked time counted); the reporter's thread is not running. A DDP
backward is one call: its reducer issues the bucket's all-reduce from the autograd engine,
which holds no GIL (the interceptor leaves that all-reduce out, but the kernel runs); "busy
thread": the same while another Python thread wants the GIL, as a data loader's does (a
kernel that needs the GIL waits for it, up to the 5 ms switch interval each time).
Run: .venv/bin/python -m bench.bench_collective_kernel [--rounds 15] [--calls 1000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

ARMS = ("none", "c++", "python")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--calls", type=int, default=1000)
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from syncscope.agent.collectives import Blocked, CollectiveInterceptor, GroupLabels
    from syncscope.agent.queues import RecordQueues

    torch.set_num_threads(1)
    init = os.path.join(tempfile.mkdtemp(prefix="syncscope-kernel-bench-"), "init")
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    t, out = torch.ones(1024), torch.empty(1024)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    x = torch.randn(4, 16)

    def ddp_step() -> None:  # the reducer calls the kernel from autograd, without the GIL
        ddp(x).sum().backward()

    def ddp_step_busy() -> None:  # ... while another Python thread wants the GIL
        busy.set()
        try:
            ddp(x).sum().backward()
        finally:
            busy.clear()

    busy = threading.Event()

    def spin() -> None:  # a Python thread that runs whenever it gets the GIL (a data loader)
        while True:
            busy.wait()
            n = 0
            while busy.is_set() and n < 100_000:
                n += 1

    threading.Thread(target=spin, daemon=True).start()
    kinds: dict[str, Callable[[], Any]] = {
        "all_gather (blocking)": lambda: gather(out, t),
        "all_reduce (async + wait)": lambda: dist.all_reduce(t, async_op=True).wait(),
        "DDP backward, 1 bucket": ddp_step,
        "DDP backward, busy thread": ddp_step_busy,
    }

    def timed(call: Callable[[], Any], n: int) -> float:
        t0 = time.perf_counter_ns()
        for _ in range(n):
            call()
        return (time.perf_counter_ns() - t0) / n / 1e3

    per: dict[tuple[str, str], list[float]] = {(a, k): [] for a in ARMS for k in kinds}
    kernels = {}
    for r in range(args.rounds):
        for arm in ARMS[r % 3 :] + ARMS[: r % 3]:
            interceptor = None
            if arm != "none":
                queues = RecordQueues(args.calls * len(kinds))
                interceptor = CollectiveInterceptor(
                    queues, GroupLabels(), Blocked(), native=arm == "c++"
                )
                interceptor.install()
                kernels[arm] = interceptor.kernel
            for kind, call in kinds.items():
                n = args.calls // 20 if "busy" in kind else args.calls  # ~40 ms a call
                timed(call, 5)
                per[arm, kind].append(timed(call, n))
                if interceptor is not None:
                    interceptor.poll()
                    queues.collectives.clear()
            if interceptor is not None:
                interceptor.uninstall()
    dist.destroy_process_group()
    print(
        f"collective interception, gloo world of one, {args.rounds} rounds x {args.calls} calls "
        f"(kernels: {kernels})"
    )
    for kind in kinds:
        bare = statistics.median(per["none", kind])
        line = f"{kind:28s} none {bare:6.1f} us"
        for arm in ARMS[1:]:
            extra = [a - b for a, b in zip(per[arm, kind], per["none", kind], strict=True)]
            line += f" | {arm} +{statistics.median(extra):5.1f} us"
        print(line)


if __name__ == "__main__":
    main()
