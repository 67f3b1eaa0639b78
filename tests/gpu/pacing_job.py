"""Pacing on the CUDA path is fed the GPU's exposed communication; writes a JSON verdict.

    python tests/gpu/pacing_job.py --out result.json [--delay-ms 10] [--steps 120]

Two ranks on the one GPU (gloo with CUDA tensors: NCCL refuses two ranks on one device), DDP
with syncscope attached and pacing on. Rank 1 is a straggler (a CPU sleep before its forward);
an arm without delay gives the exposed communication of the transfer alone (gloo copies CUDA
tensors through the host: milliseconds here). Rank 0 records what its pacer is fed per step
(CudaPhaseClock feeds it from resolved GPU steps) and what the CPU clock measured as exposed
communication (what the pacer was fed before), and the pacing controller's state at the end.
Pacing is on, so rank 0's own delay shortens the wait it is fed: the lead the controller
regulates is that wait plus the delay it decided at the step before (agent/pacing.py,
`unpaced`), reported beside it.

No GPU-side delay (`torch.cuda._sleep` on rank 1): the two processes time-slice the one GPU
(the likely cause, not traced), so rank 1's sleeping kernel holds up rank 0's kernels as much as
its own, and rank 0 does not arrive earlier. Measured on an H200 (2026-11-27), against the arm
without delay: rank 0's wait +2.2 ms in one run and its lead -0.3 ms in the next, where the CPU
sleep gave +5.0 ms. That case needs two GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from syncscope.agent import attach

    rank = int(os.environ["RANK"])
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", init_method=f"file://{args.init}", rank=rank, world_size=2)
    torch.manual_seed(0)
    inner = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    ddp = torch.nn.parallel.DistributedDataParallel(inner, device_ids=[0])
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    agent = attach(model=ddp, optimizer=opt, exporter=None, pacing=True, job="pacing-check")
    clock = agent.clock
    fed: list[int] = []
    unpaced: list[int] = []  # fed + the delay the pacer decided before: the lead it controls
    cpu_comm: list[int] = []
    pacer = clock.pacer
    if pacer is not None:
        decided = [0]

        def recording_pacer(comm_ns: int, step_ns: int) -> int:
            fed.append(comm_ns)
            unpaced.append(comm_ns + decided[0])
            decided[0] = pacer(comm_ns, step_ns)
            return decided[0]

        clock.pacer = recording_pacer
    # on the class (this process's one clock): the clock's instance has __slots__
    own_pace = type(clock)._pace

    def recording_pace(self, comm_ns: int, step_ns: int) -> int:
        cpu_comm.append(comm_ns)  # the CPU clock's exposed communication: the old feed
        return own_pace(self, comm_ns, step_ns)

    type(clock)._pace = recording_pace
    x = torch.randn(256, 1024, device="cuda")
    for step in range(args.steps):
        if rank == 1 and args.arm == "cpu":
            time.sleep(args.delay_ms / 1000)
        opt.zero_grad(set_to_none=True)
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        if step % 10 == 9:
            loss.item()  # logging every 10 steps: the only host sync
    torch.cuda.synchronize()
    time.sleep(0.5)
    state = agent.pacer.state() if getattr(agent, "pacer", None) is not None else None
    stats = {
        "gpu_steps": getattr(clock, "gpu_steps", None),
        "cpu_steps": getattr(clock, "cpu_steps", None),
        "clock": type(clock).__name__,
        "errors": agent.stats["errors"],
    }
    agent.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        tail = slice(len(fed) // 4, None)  # after start-up
        result = {
            "arm": args.arm,
            "delay_ms": args.delay_ms,
            "fed_gpu_comm_ms_median": statistics.median(fed[tail]) / 1e6 if fed else None,
            "unpaced_ms_median": statistics.median(unpaced[tail]) / 1e6 if unpaced else None,
            "fed_steps": len(fed),
            "cpu_comm_ms_median": statistics.median(cpu_comm[len(cpu_comm) // 4 :]) / 1e6,
            "pacing_state": repr(state),
            **stats,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--arm", default="cpu", help=argparse.SUPPRESS)
    p.add_argument("--init", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    results = []
    for arm in ("none", "cpu"):
        init = os.path.join(tempfile.mkdtemp(prefix="syncscope-pacing-job-"), "store")
        out = args.out + f".{arm}"
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", "--arm", arm, "--init", init]
                + ["--out", out, "--steps", str(args.steps), "--delay-ms", str(args.delay_ms)],
                env=dict(os.environ, RANK=str(rank), GLOO_SOCKET_IFNAME="lo"),
            )
            for rank in range(2)
        ]
        codes = [proc.wait(timeout=300) for proc in procs]
        if any(codes):
            print(f"{arm}: exit codes {codes}", file=sys.stderr)
            return 1
        with open(out) as f:
            results.append(json.load(f))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
