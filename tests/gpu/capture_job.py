"""CUDA graphs next to the agent, on the GPU; writes a JSON verdict.

    python tests/gpu/capture_job.py --out result.json --case compile|global|thread_local

compile  a DDP model under torch.compile(mode="reduce-overhead") trains with syncscope attached:
         the same losses as without the agent, CUDA-graph replays happening, no cudagraph skips.
global   a user's own torch.cuda.graph capture (default capture_error_mode="global") while the
         agent's background work runs in a loop through the whole capture: Flight Recorder
         dumps and CUDA-event queries, with a training step and its all-reduce still in flight
         on the GPU (behind a torch.cuda._sleep), so both really query unfinished events. The
         capture must succeed and replay. `--no-guard` runs the same without the thread-local
         capture mode (agent/capture_mode.py): what the agent did before.
thread_local  the same capture in capture_error_mode="thread_local".
One process per case (a failed capture can leave the CUDA context unusable).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time


def ddp_mlp(torch, d: int):
    torch.manual_seed(0)
    inner = torch.nn.Sequential(
        torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)
    ).cuda()
    return torch.nn.parallel.DistributedDataParallel(inner, device_ids=[0])


def compile_case(torch, attach_agent: bool, steps: int) -> dict:
    from syncscope.agent import attach

    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    ddp = ddp_mlp(torch, 1024)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    agent = attach(model=ddp, optimizer=opt, job="capture-check") if attach_agent else None
    compiled = torch.compile(ddp, mode="reduce-overhead")
    torch.manual_seed(1)
    xs = [torch.randn(64, 1024, device="cuda") for _ in range(4)]
    losses, times = [], []
    for i in range(steps):
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(xs[i % len(xs)]).float().pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        times.append(time.perf_counter() - t)
    stats = {}
    if agent is not None:
        time.sleep(0.5)
        stats = dict(agent.stats)
        clock = getattr(agent, "clock", None)
        stats["gpu_steps"] = getattr(clock, "gpu_steps", None)
        stats["cpu_steps"] = getattr(clock, "cpu_steps", None)
        stats["last_error"] = repr(agent.last_error) if agent.last_error else None
        agent.close()
    inductor = dict(counters["inductor"])
    return {
        "losses": losses,
        "median_step_ms": sorted(times[5:])[len(times[5:]) // 2] * 1e3,
        "cudagraph_skips": inductor.get("cudagraph_skips", 0),
        "graph_breaks": sum(counters["graph_break"].values()),
        "unique_graphs": counters["stats"]["unique_graphs"],
        "inductor": {k: v for k, v in inductor.items() if "cudagraph" in k},
        "agent": stats,
    }


def global_case(torch, seconds: float, guard: bool, mode: str = "global") -> dict:
    """A capture (in `mode`) while the agent's dump and event resolution loop on a thread."""
    from syncscope.agent import attach

    ddp = ddp_mlp(torch, 1024)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    agent = attach(model=ddp, optimizer=opt, job="capture-check")
    x = torch.randn(64, 1024, device="cuda")
    for _ in range(5):  # some steps, so there are pending events and Flight Recorder entries
        opt.zero_grad(set_to_none=True)
        ddp(x).pow(2).mean().backward()
        opt.step()
    reader, clock = agent.nccl_reader, agent.clock
    if not guard:
        clock.thread_guard = lambda: False
    stop = threading.Event()
    loops = {"polls": 0, "resolves": 0, "errors": [], "pending_at_capture": 0}

    def background() -> None:  # what the agent's own threads do, as fast as they can
        if guard and reader is not None:
            reader.thread_guard()  # as the reader's own thread does first (_run)
        while not stop.is_set():
            try:
                if reader is not None:
                    reader.active = True
                    reader.poll()
                    loops["polls"] += 1
                clock.resolve()
                loops["resolves"] += 1
            except Exception as exc:  # noqa: BLE001
                loops["errors"].append(repr(exc)[:200])
                return

    a = torch.randn(2048, 2048, device="cuda")
    static_out = torch.empty_like(a)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        static_out.copy_(a @ a)  # warm-up outside the capture (cuBLAS workspace)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # Work still in flight during the capture: ~1 s of GPU sleep, then a step and its all-reduce
    torch.cuda._sleep(2_000_000_000)
    opt.zero_grad(set_to_none=True)
    ddp(x).pow(2).mean().backward()
    opt.step()
    loops["pending_at_capture"] = len(clock.pending)
    thread = threading.Thread(target=background, daemon=True)
    thread.start()
    time.sleep(0.05)
    graph = torch.cuda.CUDAGraph()
    captured, error = True, None
    try:
        with torch.cuda.graph(graph, capture_error_mode=mode):  # "global" is the default
            b = a
            for _ in range(100):  # keep the capture open while the thread works
                b = torch.tanh(b @ a) * 0.5
                time.sleep(seconds / 100)
            static_out.copy_(b)
        graph.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001
        captured, error = False, repr(exc)[:400]
    stop.set()
    thread.join(5)
    agent_errors = agent.errors
    agent.close()
    return {
        "capture_ok": captured,
        "error": error,
        "background": loops,
        "agent_errors": agent_errors,
        "reader_stats": reader.stats if reader is not None else None,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--case", choices=("compile", "global", "thread_local"), required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--no-guard", action="store_true", help="without thread-local capture mode")
    args = p.parse_args()
    os.environ.setdefault("SYNCSCOPE_EXPORTER", "http://127.0.0.1:9")  # nothing listening
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    if args.case == "compile":
        # attach() before init, as the docs advise: it turns NCCL timing on
        from syncscope.agent.nccl_trace import prepare_environment

        prepare_environment()
    store = tempfile.mktemp(prefix="syncscope-capture-job-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        if args.case == "compile":
            without = compile_case(torch, False, args.steps)
            with_agent = compile_case(torch, True, args.steps)
            result = {"without": without, "with": with_agent}
        else:
            result = global_case(torch, seconds=0.5, guard=not args.no_guard, mode=args.case)
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
