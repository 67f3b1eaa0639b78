"""The agent's cost on the training thread in instructions, not time: what noisy shared cores
cannot blur.

Runs itself under callgrind (valgrind's tool; `scripts/setup` does not install valgrind, the
machine's package manager does) with collection off, and in the child switches it on only around
each arm's measured steps (`callgrind_control -z` before, `-d LABEL` after), the training thread
counted apart from the reporter's (`--separate-threads=yes`). Each arm runs on a DDP model
(gloo, one rank) of its own, built alike: torch keeps a parameter's C++ gradient hook after its
Python hooks are removed, so on a shared model one arm's leftovers would be counted in the next.
Python allocates with its own allocator (pymalloc), as in a user's process: under
PYTHONMALLOC=malloc the agent's ints and tuples cost glibc's malloc, ~8 k more a step.

Arms, instructions per step over the bare model's:
  the bare mechanisms the agent's hooks use, each added on top of the ones above it: the
  forward wrapped on the instance, optimizer pre- and post-hooks, torch.autograd.backward
  wrapped, a post-accumulate-grad hook on two parameters, one of which queues an autograd
  callback (queue_callback) at the first of them in each backward; then
  the agent as attach() installs it (no exporter), with the phases of 1 step in 16 timed
  (phase_every=16), and without reading the work from the batch (detect_work=False); then
  the phase clock alone, as attach() wires it with syncscope's C++ library, every step and 1 in
  16 timed: the CPU's PhaseClock, and the CudaPhaseClock a GPU job gets (an event at each
  boundary, its stream looked up, a StepTimeline for Flight Recorder, the resolver thread),
  its CUDA events stood in for by objects whose `record` is a C builtin: what the CUDA path
  itself costs the training thread, without a GPU (a real Event.record adds ~2.2 µs an event on
  an H100; bench_hook_costs.py prints the events a step).

Counts are exact for one run, but two models built alike differ by a few thousand
instructions a step (allocation, cache placement), so small differences between arms on
models of their own are within that.

`--cache-sim` also simulates the caches and adds each arm's estimated cycles (instructions plus
10 per first-level and 100 per last-level miss, callgrind's estimate): the agent's code runs on
caches the step's kernels have flushed, so its misses cost about as much as its instructions.
`--against REV` adds the agent as committed at REV (bench_agent_overhead.load_agent_at), with
its own defaults, to compare before and after; where both have a C++ library, torch takes the
syncscope:: ops from the first to load only, and REV's agent (loaded second) runs its backward
trigger in Python: its row then reads high. `--keep DIR` keeps callgrind's dumps there (cg.PID.N-01 is arm N's training thread), for
`callgrind_annotate --inclusive=yes` to say which functions an arm's instructions are in.

Run: .venv/bin/python bench/bench_instructions.py [--layers 1] [--steps 64] [--keep DIR]
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The arms, in the order the child measures them (its dumps are arm0, arm1, ...)
ARMS = (
    "bare",
    "+ forward wrapper",
    "+ optimizer pre/post hooks",
    "+ backward wrapper",
    "+ 2 gradient hooks",
    "+ queue_callback",
    "agent",
    "agent, 1 step in 16 timed",
    "agent, detect_work=False",
    "clock in C",
    "clock in C, 1 in 16",
    "CUDA clock in C",
    "CUDA clock in C, 1 in 16",
    "agent at REV",  # --against REV only: the agent as committed there, its defaults
)
AGAINST = ARMS[-1]
LABELS: list[str] = []  # the child's arms measured so far
WARM_STEPS = 40  # past the agent's first steps (trigger learning, the startup event)


class FreeEvent:
    """A CUDA event stand-in that costs the training thread a C call: its `record` is `id`."""

    __slots__ = ()
    record = staticmethod(id)

    def query(self) -> bool:
        return True

    def elapsed_time(self, _end: Any) -> float:
        return 0.0


def child(layers: int, steps: int, against: str | None) -> None:
    """Under callgrind: every arm's steps, each between a zero and a dump of the counters."""
    import time

    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT / "bench"))
    import syncscope.agent
    from bench_agent_overhead import make

    store = tempfile.mktemp(prefix="syncscope-bench-")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    x, y = torch.randn(4, 16), torch.randn(4, 1)
    pid = str(os.getpid())

    def control(*args: str) -> None:
        subprocess.run(["callgrind_control", *args, pid], check=True, capture_output=True)

    def measure(label: str, model: Any, opt: Any) -> None:
        def step() -> None:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        for _ in range(WARM_STEPS):
            step()
        # Every arm from an empty youngest generation: a collection the arms before left due
        # would land in this one's steps (~200 k instructions, 3 k a step of 64).
        gc.collect()
        control("-i", "on")
        control("-z")
        for _ in range(steps):
            step()
        assert label == ARMS[len(LABELS)], label
        control("-d", f"arm{len(LABELS)}")  # callgrind_control takes no spaces here
        LABELS.append(label)
        control("-i", "off")

    measure("bare", *make(16, layers))

    # The mechanisms, cumulative, on a model of their own.
    model, opt = make(16, layers)
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    model.forward = forward
    measure("+ forward wrapper", model, opt)
    opt.register_step_pre_hook(lambda *_: None)
    opt.register_step_post_hook(lambda *_: None)
    measure("+ optimizer pre/post hooks", model, opt)
    backward = torch.autograd.backward

    def wrapped_backward(*args: Any, **kwargs: Any) -> Any:
        return backward(*args, **kwargs)

    torch.autograd.backward = wrapped_backward
    measure("+ backward wrapper", model, opt)
    params = list(model.parameters())[-2:]
    handles = [p.register_post_accumulate_grad_hook(lambda _p: None) for p in params]
    measure("+ 2 gradient hooks", model, opt)
    queue = torch.autograd.Variable._execution_engine.queue_callback
    queued = [False]

    def done() -> None:
        queued[0] = False

    def first(_p: Any) -> None:
        if not queued[0]:
            queued[0] = True
            queue(done)

    for h in handles:
        h.remove()
    for p in params:
        p.register_post_accumulate_grad_hook(first)
    measure("+ queue_callback", model, opt)
    torch.autograd.backward = backward

    agents: list[tuple[str, dict[str, Any]]] = [
        ("agent", {}),
        ("agent, 1 step in 16 timed", {"phase_every": 16}),
        ("agent, detect_work=False", {"detect_work": False}),
    ]
    for label, options in agents:
        model, opt = make(16, layers)
        agent = syncscope.agent.attach(
            model=model, optimizer=opt, exporter=None, job="bench", **options
        )
        measure(label, model, opt)
        agent.close()
    # The phase clocks alone as attach() wires them (the hooks in C, the training thread's
    # waits, the C++ kernel's step counter, the transport's step hook): the CPU's PhaseClock, and
    # the CudaPhaseClock a GPU job gets (its events in the resolver's queue, its stream looked
    # up, a StepTimeline for Flight Recorder), its events free: their `record` a C builtin.
    import ctypes
    from collections import deque

    from syncscope.agent import native
    from syncscope.agent.collectives import Blocked
    from syncscope.agent.cuda_timing import CudaPhaseClock, StreamOf
    from syncscope.agent.nccl_trace import StepTimeline
    from syncscope.agent.phase_hooks import instrument
    from syncscope.agent.phases import PhaseClock

    lib = native.load(torch)
    if lib is None:
        raise SystemExit("syncscope's C++ library is not built: python -m syncscope.agent.native")
    queue = torch.autograd.Variable._execution_engine.queue_callback
    errors: list[BaseException] = []
    for label, cuda, every in (
        ("clock in C", False, 1),
        ("clock in C, 1 in 16", False, 16),
        ("CUDA clock in C", True, 1),
        ("CUDA clock in C, 1 in 16", True, 16),
    ):
        model, opt = make(16, layers)
        out: tuple[deque, deque] = (deque(maxlen=8192), deque(maxlen=32768))
        queues = (*out, queue, "g", 1.0, errors.append)
        clock = (
            CudaPhaseClock(
                *queues,
                ddp_model=model,
                event_factory=FreeEvent,
                thread_guard=lambda: None,
                stream_of=StreamOf(bool, object),
                timeline=StepTimeline(),
            )
            if cuda
            else PhaseClock(*queues, ddp_model=model)
        )
        clock.blocked, clock.step_counter = Blocked(), ctypes.c_int64(0)
        clock.after_step = lambda _step: time.perf_counter_ns() + 3600 * 10**9
        clock.phase_every = every
        hooks = instrument(clock, model, opt, lib)
        if cuda:
            clock.start()
        measure(label, model, opt)
        hooks.remove()
        if cuda:
            clock.stop()
        if errors:
            raise SystemExit(f"{label}: the clock reported {errors!r}")
    if against:
        from bench_agent_overhead import load_agent_at

        model, opt = make(16, layers)
        agent = load_agent_at(against).attach(model=model, optimizer=opt, exporter=None, job="b")
        measure(AGAINST, model, opt)
        agent.close()
    time.sleep(0.1)
    dist.destroy_process_group()


def totals(out_dir: str) -> dict[str, tuple[int, int | None]]:
    """{dump label: the main thread's (instructions, estimated cycles or None without the cache
    simulation)} from callgrind's dump files (thread 1 of each, cg.PID.N-01), in dump order."""
    found: dict[str, tuple[int, int | None]] = {}
    dumps = []
    for path in glob.glob(os.path.join(out_dir, "cg.*.*-01")):
        number = re.search(r"\.(\d+)-01$", path)
        if number:
            dumps.append((int(number.group(1)), path))
    for _, path in sorted(dumps):
        text = Path(path).read_text(errors="replace")
        label = re.search(r"^desc: Trigger: dump (.*)$", text, re.M)
        events = re.search(r"^events: (.*)$", text, re.M)
        total = re.search(r"^totals: ([\d ]+)$", text, re.M)
        if not (label and events and total and label.group(1).startswith("arm")):
            continue
        counts = dict(zip(events.group(1).split(), map(int, total.group(1).split()), strict=True))
        cycles = None
        if "I1mr" in counts:
            l1 = counts["I1mr"] + counts["D1mr"] + counts["D1mw"]
            cycles = (
                counts["Ir"] + 10 * l1 + 100 * (counts["ILmr"] + counts["DLmr"] + counts["DLmw"])
            )
        found[ARMS[int(label.group(1)[3:])]] = (counts["Ir"], cycles)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=1, help="Linear(16,16) layers (2 tensors each)")
    p.add_argument("--steps", type=int, default=64, help="measured steps per arm")
    p.add_argument("--keep", metavar="DIR", help="keep callgrind's dumps in DIR")
    p.add_argument(
        "--cache-sim",
        action="store_true",
        help="simulate the caches too, and print estimated cycles (Ir + 10 L1 + 100 LL misses)",
    )
    p.add_argument("--against", metavar="REV", help="also the agent as committed at REV")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.layers, a.steps, a.against)
        return
    missing = [tool for tool in ("valgrind", "callgrind_control") if shutil.which(tool) is None]
    if missing:
        sys.exit(f"bench_instructions.py needs {' and '.join(missing)} (the valgrind package)")
    with tempfile.TemporaryDirectory(prefix="syncscope-callgrind-") as scratch:
        out_dir = a.keep or scratch
        os.makedirs(out_dir, exist_ok=True)
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            *(["--cache-sim=yes"] if a.cache_sim else []),
            "--separate-threads=yes",
            f"--callgrind-out-file={out_dir}/cg.%p",
            sys.executable,
            __file__,
            "--child",
            "--layers",
            str(a.layers),
            "--steps",
            str(a.steps),
            *(["--against", a.against] if a.against else []),
        ]
        # torch >= 2.6 records every gloo collective in Flight Recorder, 2000 entries kept by
        # default in a vector that grows by doubling: the arm whose steps pass the 512th and the
        # 1024th entry counted the ~500 and ~1,000 entries moved (+4 k and +8 k a step). A buffer
        # that is full before the first arm's warm-up ends costs each arm the same per entry.
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_FR_BUFFER_SIZE="16")
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        found = totals(out_dir)
    bare = found.get("bare")
    if bare is None:
        sys.exit(f"no dump of the bare arm among {sorted(found)}")
    cycles = bare[1] is not None

    def per_step(count: int, sign: str = "+") -> str:
        return f"{count / a.steps / 1e3:{sign}9.1f} k"

    print(
        f"DDP (gloo, 1 rank), {a.layers} Linear(16,16) layer(s): training-thread instructions"
        + (" and estimated cycles" if cycles else "")
        + f" per step under callgrind, {a.steps} steps an arm after {WARM_STEPS}"
    )
    print(
        f"  {'bare model':40s} {per_step(bare[0], '')}"
        + (f"  {per_step(bare[1] or 0, '')} cycles" if cycles else "")
    )
    previous = bare
    for label, total in found.items():
        if label == "bare":
            continue
        shown = f"agent at {a.against}" if label == AGAINST else label
        line = f"  {shown:40s} {per_step(total[0] - bare[0])}"
        if label.startswith("+"):
            line += f"  ({per_step(total[0] - previous[0]).strip()})"
            previous = total
        if cycles:
            line += f"  {per_step((total[1] or 0) - (bare[1] or 0))} cycles"
        print(line)


if __name__ == "__main__":
    main()
