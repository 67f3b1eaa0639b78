"""What each way of hooking a DDP training step costs the training thread, side by side.

The numbers behind the agent's hooks (agent/phase_hooks.py; docs/reliability.md): for each
mechanism, the training-thread CPU per step with it minus without it, median over interleaved
rounds, on a tiny DDP model (gloo, one process) so the hooks are visible. Mechanisms:
  module hooks       register_forward_pre_hook + register_forward_hook, no-op bodies
  instance wrapper   the model's forward wrapped on the instance (what the agent does)
  output hook/step   a no-op hook registered on the forward output's grad_fn every step
  param hook         a no-op post-accumulate-grad hook registered once on one parameter
  ... removed        one registered and removed on each of the 4 parameters: torch keeps the
                     tensor's C++ hook, called every backward on an empty dict (why the agent
                     learns its trigger parameters from a few of them, agent/grad_triggers.py)
  agent clock        the agent's whole PhaseClock (forward, backward, optimizer, callbacks),
                     built up: its forward wrapper only, then its optimizer hooks (the step's
                     end) too, then everything (the backward wrapper, the gradient trigger and
                     the engine callbacks: Python's), then with syncscope's C++ library, as
                     attach() installs it where the library is built: the backward triggered
                     from C++ (agent/grad_triggers.py's native mode) and the forward, backward
                     and optimizer hooks' common case in C (agent/csrc/hot_path.cpp)
  CUDA clock         the CUDA path's CudaPhaseClock with its resolver thread, CUDA stubbed:
                     events that cost nothing (a real Event.record is ~2.2 µs on an H100), so
                     the figure is the agent's own work per step on a GPU job; the events it
                     recorded a step are printed, to add their real cost. With the C++ library,
                     as attach() installs it: the forward wrapper and the optimizer's hooks in
                     C, calling the clock's `mark` (an event each) and its own step end, and
                     the backward wrapper in C in quiet steps; its gradient trigger is Python
  ... 1 in 16        both clocks with phase sampling (`phase_every=16`, agent/phases.py): the
                     phases of one step in 16 timed, the other steps only counted
Besides the training thread's CPU, the whole process's (the resolver thread's work included).
Run: .venv/bin/python bench/bench_hook_costs.py [--rounds 20] [--steps 400]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import deque
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from syncscope.agent import native
from syncscope.agent.cuda_timing import CudaPhaseClock, StreamOf
from syncscope.agent.nccl_trace import StepTimeline
from syncscope.agent.phase_hooks import instrument, wrap_forward
from syncscope.agent.phases import PhaseClock


def noop(*_: Any) -> None:
    pass


class StubEvent:
    """A CUDA event that is done as soon as recorded, timed by the host's clock, and free."""

    __slots__ = ("t",)
    recorded = 0  # records made, all events together

    def __init__(self) -> None:
        self.t = 0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter_ns()
        StubEvent.recorded += 1

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: StubEvent) -> float:
        return (end.t - self.t) / 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--steps", type=int, default=400)
    a = p.parse_args()
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = tempfile.mktemp(prefix="syncscope-bench-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    x, y = torch.randn(4, 16), torch.randn(4, 1)

    class Rig:
        """A model and optimizer of their own. Each mechanism gets one, and the arms without
        one run on a model nothing was ever installed on: torch keeps a parameter's C++
        gradient hook after its Python hooks are removed, so a shared model would carry one
        mechanism's leftovers into the others' arms."""

        def __init__(self) -> None:
            layers = torch.nn.Sequential(
                torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)
            )
            self.model = torch.nn.parallel.DistributedDataParallel(layers)
            self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
            self.per_step: list[Callable[[Any], None]] = []  # called on each forward output

    def run(rig: Rig, steps: int) -> tuple[float, float]:
        """Training-thread and whole-process CPU per step, µs."""
        model, opt, per_step = rig.model, rig.opt, rig.per_step
        cpu, proc = time.thread_time_ns(), time.process_time_ns()
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            out = model(x)
            for fn in per_step:
                fn(out)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
        return (
            (time.thread_time_ns() - cpu) / 1e3 / steps,
            (time.process_time_ns() - proc) / 1e3 / steps,
        )

    def module_hooks(rig: Rig) -> list:
        return [rig.model.register_forward_pre_hook(noop), rig.model.register_forward_hook(noop)]

    def instance_wrapper(rig: Rig) -> list:
        def timed(original: Callable[..., Any], count: bool = True) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                noop()
                out = original(*args, **kwargs)
                noop(out)
                return out

            return forward

        return [wrap_forward(rig.model, timed)]

    def output_hook(rig: Rig) -> list:
        rig.per_step.append(lambda out: out.grad_fn.register_prehook(noop))
        return [SimpleNamespace(remove=rig.per_step.clear)]

    def param_hook(rig: Rig) -> list:
        return [list(rig.model.parameters())[-1].register_post_accumulate_grad_hook(noop)]

    def param_hook_removed(rig: Rig) -> list:
        for p in rig.model.parameters():  # what torch leaves once a hook is gone, per parameter
            p.register_post_accumulate_grad_hook(noop).remove()
        return []

    def agent_clock(
        rig: Rig, every: int = 1, trigger: Any = None, backward: bool = True, step: bool = True
    ) -> list:
        """The PhaseClock's hooks: all of them, or without the backward's (a clock that cannot
        queue engine callbacks gets none) or the optimizer's."""
        queue = torch.autograd.Variable._execution_engine.queue_callback if backward else None
        clock = PhaseClock(
            deque(maxlen=8192), deque(maxlen=32768), queue, "g", 1.0, noop, ddp_model=rig.model
        )
        clock.phase_every = every
        return [instrument(clock, rig.model, rig.opt if step else None, trigger)]

    def cuda_clock(rig: Rig, every: int = 1, lib: Any = None) -> list:
        queue = torch.autograd.Variable._execution_engine.queue_callback
        clock = CudaPhaseClock(
            deque(maxlen=8192),
            deque(maxlen=32768),
            queue,
            "g",
            1.0,
            noop,
            ddp_model=rig.model,
            event_factory=StubEvent,
            thread_guard=lambda: None,
            # as attach() builds it on a GPU: the model's stream looked up by a StreamOf (here
            # never capturing, a stand-in stream), a StepTimeline for Flight Recorder
            stream_of=StreamOf(bool, object),
            timeline=StepTimeline(),
        )
        clock.phase_every = every
        hooks = instrument(clock, rig.model, rig.opt, lib)
        clock.start()

        def remove() -> None:
            hooks.remove()
            clock.stop()

        return [SimpleNamespace(remove=remove)]

    mechanisms: dict[str, Callable[[Rig], list]] = {
        "module hooks (pre + post)": module_hooks,
        "instance wrapper of forward": instance_wrapper,
        "output grad_fn hook, every step": output_hook,
        "post-accumulate-grad hook, once": param_hook,
        "the same, removed, on all 4 params": param_hook_removed,
        "PhaseClock: forward wrapper only": lambda rig: agent_clock(
            rig, backward=False, step=False
        ),
        "... and optimizer hooks": lambda rig: agent_clock(rig, backward=False),
        "agent PhaseClock, everything": agent_clock,
        "PhaseClock, the C++ library's": lambda rig: agent_clock(rig, trigger=built),
        "CudaPhaseClock, CUDA stubbed": cuda_clock,
        "CudaPhaseClock, the C++ library's": lambda rig: cuda_clock(rig, lib=built),
        "PhaseClock, phases 1 step in 16": lambda rig: agent_clock(rig, 16),
        "... the C++ library's, 1 in 16": lambda rig: agent_clock(rig, 16, trigger=built),
        "CudaPhaseClock, stubbed, 1 in 16": lambda rig: cuda_clock(rig, 16),
        "CudaPhaseClock, the library's, 1 in 16": lambda rig: cuda_clock(rig, 16, lib=built),
    }
    built = native.load(torch)
    if built is None:
        del mechanisms["PhaseClock, the C++ library's"]
        del mechanisms["... the C++ library's, 1 in 16"]
        del mechanisms["CudaPhaseClock, the C++ library's"]
        del mechanisms["CudaPhaseClock, the library's, 1 in 16"]
    bare = Rig()
    rigs = {name: Rig() for name in mechanisms}
    events: dict[str, float] = {}
    for rig in (bare, *rigs.values()):
        run(rig, 200)  # warm-up
    diffs: dict[str, list[float]] = {name: [] for name in mechanisms}
    process: dict[str, list[float]] = {name: [] for name in mechanisms}
    for i in range(a.rounds):
        for name, install in mechanisms.items():
            out = {}
            for with_it in (True, False) if i % 2 == 0 else (False, True):
                if with_it:
                    rig = rigs[name]
                    handles = install(rig)
                    run(rig, 20)  # the clock learns its trigger parameters on the first backward
                    before = StubEvent.recorded
                    out[True] = run(rig, a.steps)
                    events[name] = (StubEvent.recorded - before) / a.steps
                    for h in handles:
                        h.remove()
                else:
                    out[False] = run(bare, a.steps)
            diffs[name].append(out[True][0] - out[False][0])
            process[name].append(out[True][1] - out[False][1])
    base = run(bare, 1000)[0]
    print(f"DDP (gloo, 1 rank), tiny model: {base:.0f} µs of training-thread CPU per step")
    print(f"{a.rounds} rounds x {a.steps} steps; CPU per step, with minus without:")
    print(f"  {'':34s} {'training thread':28s} whole process  events a step")
    for name, d in diffs.items():
        q = statistics.quantiles(d, n=4)
        recorded = f"  {events[name]:.2f}" if events.get(name) else ""
        print(
            f"  {name:34s} {statistics.median(d):+6.1f} µs  (quartiles {q[0]:+.1f} .. {q[2]:+.1f})"
            f"  {statistics.median(process[name]):+6.1f} µs{recorded}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
