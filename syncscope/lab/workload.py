"""A small real training job (gloo, CPU) with stragglers and jitter injected on purpose.

It is the demo's trainer and the integration tests' subject: one rank per process, started by
`syncscope.lab.launch` (or torchrun), with the agent attached through the public API only. The
model is data-parallel with DDP by default; `--parallel` runs it the ways large jobs do:
  fsdp2   fully_shard on every block and the root (`--no-reshard`: reshard_after_forward off;
          blocks prefetch the next one's all-gather explicitly)
  hsdp    fully_shard on a 2-D mesh ("replicate", "shard")
  tp      a 2-D mesh ("dp", "tp"): DTensor tensor parallel (parallelize_module, colwise then
          rowwise per block) inside each pair, fully_shard across pairs
  pp      a 2-D mesh ("dp", "pp"): each pair a two-stage pipeline (torch.distributed.pipelining,
          GPipe over 2 micro-batches by default, `--schedule` for the others, SCHEDULES; the first
          half of the layers, then the rest and the head), fully_shard across pairs; the slow
          rank's first stage sleeps in each micro-batch's forward
  gan     two DDP models and their two optimizers, a GAN's step: a generator (which the slow
          rank's sleep is in) and a critic (Net) stepped on its output first, then the
          generator through the critic; the agent is given both models and both optimizers
`--accumulate N` runs N micro-batches per optimizer step (DDP's under no_sync()).
`--checkpoint-every N --checkpoint-dir DIR` saves model, optimizer and step count with torch.save
every N steps, one file per rank, and a run that finds one there resumes from it: the agent is
attached with start_step (the step numbers go on) and the load is timed as checkpoint time. Each
rank also appends what its saves and loads took, timed here around the calls, to
DIR/measured-{rank}.jsonl (what the goodput test checks the exporter's checkpoint badput with).
`--steps` counts from step 0 of the first run, so a resumed run ends at the same step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import sys
import time
from collections.abc import Iterator
from typing import Any


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m syncscope.lab.workload", description=__doc__)
    p.add_argument("--steps", type=int, default=0, help="steps to run (0: until --duration)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds to run when --steps is 0")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank sleeps in every step")
    p.add_argument("--slow-ms", type=float, default=30.0)
    p.add_argument(
        "--slow-in",
        default="forward",
        choices=["forward", "backward", "data"],
        help="where the slow rank sleeps: in forward, in backward (its first stage's, before any "
        "gradient of its layers), or loading data (before any collective)",
    )
    p.add_argument(
        "--slow-after",
        type=float,
        default=0.0,
        help="the slow rank starts sleeping this many seconds into training (an onset)",
    )
    p.add_argument(
        "--control",
        default=None,
        help="a folder through which a test steers the run (with --duration, which stays a cap): "
        "the file `slow` there starts the slow rank's sleep, `stop` ends the run; rank 0 looks "
        "every 10 steps and writes `onset` (the first slowed step, then unix time)",
    )
    p.add_argument("--jitter-prob", type=float, default=0.0, help="chance a rank stalls in a step")
    p.add_argument("--jitter-ms", type=float, default=150.0)
    p.add_argument(
        "--jitter-until",
        type=float,
        default=0.0,
        help="stop jittering this many seconds into training (0: never), so a job can go steady",
    )
    p.add_argument("--data-ms", type=float, default=0.0, help="simulated data loading per step")
    p.add_argument(
        "--big-grad-mb", type=float, default=0.0, help="extra gradient bytes to all-reduce"
    )
    p.add_argument("--extra-allreduce", action="store_true", help="a direct all_reduce every step")
    p.add_argument("--parallel", default="ddp", choices=["ddp", "fsdp2", "hsdp", "tp", "pp", "gan"])
    p.add_argument("--no-reshard", action="store_true", help="fsdp2: reshard_after_forward off")
    p.add_argument(
        "--schedule",
        default="gpipe",
        choices=list(SCHEDULES),
        help="pp: the pipeline schedule (all but gpipe and 1f1b: two stages per rank)",
    )
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--no-agent", action="store_true", help="run without syncscope (baseline)")
    p.add_argument("--pacing", action="store_true")
    p.add_argument("--detail", default=None, choices=["default", "buckets"])
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument(
        "--checkpoint-dir", default=None, help="where checkpoints go and are resumed from"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--result",
        default=None,
        help="write this rank's step times as JSON here ({rank} is replaced)",
    )
    return p.parse_args(argv)


# --parallel pp's schedules (torch.distributed.pipelining) by --schedule: the class, how many
# stages each rank holds, where they sit, and its micro-batches per step (the zero-bubble ones
# need as many as stages). "loop": stage s on the pair's rank s mod 2 (interleaved 1F1B,
# Megatron's, and its zero-bubble form); "v": rank r holds stages r and 3 - r, so rank 0 holds
# the first and the last (ZB-V and DualPipeV). The zero-bubble schedules split a backward into
# its input and its weight gradients, computed apart by torch.autograd.grad.
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", 1, "loop", 2),
    "1f1b": ("Schedule1F1B", 1, "loop", 2),
    "interleaved": ("ScheduleInterleaved1F1B", 2, "loop", 2),
    "zb-interleaved": ("ScheduleInterleavedZeroBubble", 2, "loop", 4),
    "zbv": ("ScheduleZBVZeroBubble", 2, "v", 4),
    "dualpipev": ("ScheduleDualPipeV", 2, "v", 4),
}


class Checkpoints:
    """One rank's checkpoints in a directory: `DIR/rank{rank}.pt` holds model, optimizer and the
    steps done; `DIR/latest-{rank}` the steps done as text, written after the checkpoint (as
    Megatron's latest_checkpointed_iteration.txt is), so the step count is known before the
    agent is attached and the checkpoint itself is loaded under it."""

    def __init__(self, directory: str, rank: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"rank{rank}.pt")
        self.latest = os.path.join(directory, f"latest-{rank}")
        self.measured = open(  # noqa: SIM115 - line-buffered, open for the run
            os.path.join(directory, f"measured-{rank}.jsonl"), "a", buffering=1
        )

    def steps_done(self) -> int:
        try:
            with open(self.latest) as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _note(self, kind: str, step: int, seconds: float) -> None:
        import json

        self.measured.write(json.dumps({"kind": kind, "step": step, "seconds": seconds}) + "\n")

    def save(self, model: Any, opt: Any, steps_done: int) -> None:
        import torch

        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": steps_done}
        tmp = self.path + ".tmp"
        t0 = time.perf_counter()
        torch.save(state, tmp)
        self._note("save", steps_done, time.perf_counter() - t0)
        os.replace(tmp, self.path)
        with open(self.latest + ".tmp", "w") as f:
            f.write(str(steps_done))
        os.replace(self.latest + ".tmp", self.latest)

    def load(self, model: Any, opt: Any, steps_done: int) -> None:
        import torch

        t0 = time.perf_counter()
        state = torch.load(self.path, weights_only=True)
        self._note("load", steps_done, time.perf_counter() - t0)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])


def pipeline(
    net: Any, chunk: Any, args: argparse.Namespace, world: int, rank: int
) -> tuple[list[Any], Any, bool, bool]:
    """This rank's stages of `net` (pairs of ranks, fully_shard across pairs) and its
    schedule: (the stages' modules, schedule, whether it holds the first stage, whether it
    holds the last).

    `net`'s (Linear, ReLU) pairs are cut, in order, into 2 stages per rank pair times the
    --schedule's stages per rank; the last stage also holds the head. The stages sit on the
    pair's ranks as SCHEDULES says (loop: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3;
    v: rank 0 stages 0 and 3, rank 1 stages 1 and 2). `chunk(body, head, first)` makes a
    stage's module; `first`: the rank's first stage (a slowed rank sleeps there only, once per
    micro-batch whatever the schedule).
    """
    import torch
    from torch import nn
    from torch.distributed import pipelining
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "pp"))
    index = mesh["pp"].get_local_rank()
    kind, per_rank, placement, micro = SCHEDULES[args.schedule]
    stages = 2 * per_rank
    pairs = len(net.body) // 2
    if pairs < stages:
        raise SystemExit(f"--schedule {args.schedule}: at least {stages} layers")
    # 3 layers over 2 stages: one in stage 0, two in stage 1 (the uneven default).
    cuts = [2 * (pairs * s // stages) for s in range(stages)] + [len(net.body)]
    modules = list(net.body)
    mine = list(range(index, stages, 2))
    if placement == "v":
        mine = [index, stages - 1 - index]
    parts = []
    for s in mine:
        body = nn.Sequential(*modules[cuts[s] : cuts[s + 1]])
        part = chunk(body, net.head if s == stages - 1 else None, s == index)
        # The pipeline's micro-batches run forward and backward apart: gradients are reduced
        # once, after the last micro-batch (the schedule drives FSDP2's gradient sync).
        fully_shard(part, mesh=mesh["dp"], reshard_after_forward=False)
        parts.append(part)
    torch.manual_seed(args.seed)
    group = mesh["pp"].get_group()
    device = torch.device("cpu")
    held: list[Any] = [
        pipelining.PipelineStage(part, s, stages, device, group=group)
        for part, s in zip(parts, mine, strict=True)
    ]
    cls = getattr(pipelining, kind)
    loss = nn.functional.mse_loss
    schedule = cls(held if per_rank > 1 else held[0], micro, loss_fn=loss)
    return parts, schedule, 0 in mine, stages - 1 in mine


def parallelize(net: Any, args: argparse.Namespace, world: int) -> Any:
    """`net` made data-, fully-sharded- or tensor-parallel as `args.parallel` says."""
    import torch
    from torch import nn

    if args.parallel == "ddp":
        return nn.parallel.DistributedDataParallel(net)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    linears = [m for m in net.body if isinstance(m, nn.Linear)]
    if args.parallel == "tp":
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        # Linear pairs: the first splits its outputs over the pair, the second its inputs and
        # all-reduces the result (one all-reduce per pair in forward, one in backward).
        names = {id(m): name for name, m in net.body.named_children()}
        plan: dict[str, Any] = {}
        for first, second in zip(linears[0::2], linears[1::2], strict=False):
            plan[names[id(first)]] = ColwiseParallel()
            plan[names[id(second)]] = RowwiseParallel()
        parallelize_module(net.body, mesh["tp"], plan)
        shard_mesh = mesh["dp"]
    elif args.parallel == "hsdp":
        shard_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        shard_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    reshard = not args.no_reshard
    blocks = [fully_shard(m, mesh=shard_mesh, reshard_after_forward=reshard) for m in linears]
    if args.parallel == "fsdp2" and not reshard:
        for block, following in zip(blocks, blocks[1:], strict=False):
            block.set_modules_to_forward_prefetch([following])
    fully_shard(net, mesh=shard_mesh, reshard_after_forward=reshard)
    torch.manual_seed(args.seed)
    return net


def no_sync(model: Any) -> Any:
    """Skip gradient synchronisation for a micro-batch: DDP's no_sync(), FSDP2's
    set_requires_gradient_sync(False) (undone by the last micro-batch's context)."""
    if hasattr(model, "no_sync"):
        return model.no_sync()

    @contextlib.contextmanager
    def unsynced() -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    return unsynced()


_KEPT: list[dict] = []  # main()'s locals, alive until the process leaves (os._exit)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch import nn

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    init = os.environ.get("SYNCSCOPE_INIT_FILE")
    init_method = f"file://{init}" if init else "env://"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed * 1000 + rank)
    slow = args.slow_ms / 1000 if rank == args.slow_rank else 0.0
    slow_s = slow if args.slow_in == "forward" else 0.0  # slept in forward
    slow_data_s = slow if args.slow_in == "data" else 0.0  # slept loading the step's data
    slow_bwd_s = slow if args.slow_in == "backward" else 0.0  # slept in backward
    # Set when the loop starts, so that start-up time does not eat into the jittery phase.
    jitter_end = [float("inf")]
    slow_from = [float("inf")]

    class SleepInBackward(torch.autograd.Function):
        """Identity forward (a copy: a pipeline stage detaches its outputs in place, which a
        view refuses); its backward sleeps (once slowing has started)."""

        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            if time.monotonic() >= slow_from[0]:
                time.sleep(slow_bwd_s)
            return grad

    def slowed(out: torch.Tensor) -> torch.Tensor:
        """`out` whose backward sleeps first, on the rank slowed in backward."""
        return SleepInBackward.apply(out) if slow_bwd_s else out

    class Net(nn.Module):
        def __init__(self, stalls: bool = True) -> None:
            super().__init__()
            self.stalls = stalls  # the slowed rank's sleep and the jitter are in its forward
            dims = [args.hidden] * (args.layers + 1)
            self.body = nn.Sequential(
                *[
                    m
                    for d0, d1 in zip(dims, dims[1:], strict=False)
                    for m in (nn.Linear(d0, d1), nn.ReLU())
                ]
            )
            self.head = nn.Linear(args.hidden, 1)
            n_extra = int(args.big_grad_mb * 1024 * 1024 / 4)
            self.extra = nn.Parameter(torch.zeros(n_extra)) if n_extra else None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not self.stalls:  # a GAN's critic
                return self.head(self.body(x))
            stall()
            out = slowed(self.head(self.body(x)))
            if self.extra is not None:
                out = out + self.extra[:1].sum() * 0.0
            return out

    def stall() -> None:
        """The slowed rank's sleep and the jitter, at the start of a forward."""
        if slow_s and time.monotonic() >= slow_from[0]:
            time.sleep(slow_s)
        if (
            args.jitter_prob
            and time.monotonic() < jitter_end[0]
            and rng.random() < args.jitter_prob
        ):
            time.sleep(args.jitter_ms / 1000)

    class Stage(nn.Module):
        """A pipeline stage of Net: some of its layers, the head in the last stage."""

        def __init__(self, body: nn.Module, head: nn.Module | None, first: bool) -> None:
            super().__init__()
            self.body, self.head, self.first = body, head, first

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.first:
                stall()
            out = self.body(x)
            out = out if self.head is None else self.head(out)
            return slowed(out) if self.first else out

    class Generator(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = args.hidden
            self.body = nn.Sequential(nn.Linear(h, h), nn.ReLU(), nn.Linear(h, h))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            stall()
            return slowed(self.body(x))

    schedule = None
    model: Any
    saved: Any
    critic: Any = None  # --parallel gan's, and its optimizer
    if args.parallel == "gan":
        if args.accumulate != 1:
            raise SystemExit("--parallel gan: no --accumulate")
        ddp = nn.parallel.DistributedDataParallel
        generator, critic = ddp(Generator()), ddp(Net(stalls=False))
        critic_opt = torch.optim.SGD(critic.parameters(), lr=1e-3)
        model, saved = [generator, critic], nn.ModuleList([generator, critic])
        params = list(generator.parameters())
    elif args.parallel == "pp":
        if args.accumulate != 1 or world % 2:
            raise SystemExit("--parallel pp: an even world size, no --accumulate")
        parts, schedule, feeds, scores = pipeline(Net(), Stage, args, world, rank)
        # A rank's stages, one module each: the agent times every one's forward.
        model = parts[0] if len(parts) == 1 else parts
        params = [p for part in parts for p in part.parameters()]
        saved = torch.nn.ModuleList(parts)  # what a checkpoint holds: every stage's state
    else:
        model = saved = parallelize(Net(), args, world)
        params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=1e-3)
    checkpoints = Checkpoints(args.checkpoint_dir, rank) if args.checkpoint_dir else None
    start = checkpoints.steps_done() if checkpoints is not None else 0
    agent = None
    if not args.no_agent:
        from syncscope.agent import attach

        agent = attach(
            model=model,
            optimizer=opt if critic is None else [critic_opt, opt],
            pacing=args.pacing or None,
            detail=args.detail,
            start_step=start if checkpoints is not None else None,
        )
    if checkpoints is not None and start:
        checkpoints.load(saved, opt, start)  # under the agent: checkpoint time, not startup
    x = torch.randn(args.batch, args.hidden)
    y = torch.randn(args.batch, 1)
    y_real = torch.randn(args.batch, args.hidden)  # what a GAN's critic is shown as real
    probe = torch.ones(256)
    times: list[float] = []  # each step's duration (s)
    ends: list[float] = []  # and its end (unix s)
    deadline = time.monotonic() + args.duration
    if args.jitter_until > 0:
        jitter_end[0] = time.monotonic() + args.jitter_until
    if (slow_s or slow_data_s or slow_bwd_s) and not args.control:  # else when the test asks
        slow_from[0] = time.monotonic() + args.slow_after
        onset = time.time() + args.slow_after
        print(f"syncscope-workload: rank {rank} slow from unix {onset:.3f}", flush=True)
    step = start
    last = time.perf_counter()
    # With --duration, only rank 0's clock decides (by broadcast) so that all ranks stop together.
    while step < args.steps if args.steps else True:
        if args.data_ms:
            time.sleep(args.data_ms / 1000)
        if slow_data_s and time.monotonic() >= slow_from[0]:
            time.sleep(slow_data_s)
        opt.zero_grad(set_to_none=True)
        if schedule is not None:  # the pipeline runs forward and backward of every micro-batch
            schedule.step(
                *((x,) if feeds else ()), **({"target": y, "losses": []} if scores else {})
            )
        if critic is not None:  # the critic steps on the generator's output first
            fake = model[0](x)
            critic_opt.zero_grad(set_to_none=True)
            (critic(fake.detach()) - critic(y_real)).mean().backward()
            critic_opt.step()
            nn.functional.mse_loss(critic(fake), y).backward()  # the generator's, through it
        for micro in range(args.accumulate if schedule is None and critic is None else 0):
            last_micro = micro == args.accumulate - 1
            with contextlib.nullcontext() if last_micro else no_sync(model):
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
        opt.step()
        if args.extra_allreduce:
            dist.all_reduce(probe)
        if (
            checkpoints is not None
            and args.checkpoint_every
            and (step + 1) % args.checkpoint_every == 0
        ):
            checkpoints.save(saved, opt, step + 1)
        now = time.perf_counter()
        times.append(now - last)
        ends.append(time.time())  # when, for a test that locates a fault by the wall clock
        last = now
        step += 1
        if not args.steps and step % 10 == 0:
            go_on, slowing = time.monotonic() < deadline, slow_from[0] < float("inf")
            if args.control and rank == 0:
                go_on = go_on and not os.path.exists(os.path.join(args.control, "stop"))
                if not slowing and os.path.exists(os.path.join(args.control, "slow")):
                    slowing = True
                    _write(os.path.join(args.control, "onset"), f"{step} {time.time():.3f}")
            flags = torch.tensor([float(go_on), float(slowing)])
            dist.broadcast(flags, src=0)
            if flags[1].item() and slow_from[0] == float("inf"):
                slow_from[0] = time.monotonic()  # from the next step on
            if not flags[0].item():
                break
    if agent is not None:
        agent.close()
    if args.result:
        import json

        with open(args.result.format(rank=rank), "w") as f:
            json.dump(
                {
                    "rank": rank,
                    "step_times": times,
                    "step_ends": ends,
                    "stats": agent.stats if agent else None,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()
    # Nothing this run built is destroyed on the way out: at main()'s return its locals (the
    # model, the process group's tensors and works) were dropped while gloo's worker threads
    # still ran, and a rank could deadlock there (main thread and pt_gloo_runloop both in a
    # futex wait, the result already written). They go with the process, at os._exit below.
    _KEPT.append(locals())
    return 0


def _write(path: str, text: str) -> None:
    """`text` in `path`, whole or not at all for a reader."""
    with open(path + ".partial", "w") as f:
        f.write(text)
    os.replace(path + ".partial", path)


if __name__ == "__main__":
    import faulthandler

    faulthandler.enable()  # an abort prints every thread's stack
    code = main()
    # torch 2.13 keeps gloo's worker threads after destroy_process_group(), and an interpreter
    # finalizing while one drops a tensor aborts ("terminate called without an active
    # exception", pytorch#179291): measured on a --no-agent rank of this workload in CI. All
    # this process had to do is done and written (the result file closed, the checkpoint notes
    # line-buffered, the agent closed): it leaves without finalizing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
