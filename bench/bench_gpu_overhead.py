"""GPU agent overhead, measured side by side in one run (interleaved A/B): target ≤ 0.2 %.

An 8-layer d=1024 bf16 transformer step under DDP/NCCL, agent attached (CUDA-event phases,
Flight Recorder reader, NVML topology sampling) vs detached, in alternating rounds (ABBA), each
round warmed up first. Every step ends in a host sync (`loss.item()`, as loss logging does), so
the agent's training-thread cost is on the critical path: the worst case for it. Prints median
and p99 step time per arm, their ratios, what the agent's GPU parts did, and PASS/FAIL.

Both arms run with TORCH_NCCL_ENABLE_TIMING=1 (a process-group setting that cannot differ
between rounds of one process); `--nccl-timing-ab` measures that setting's own cost in two
fresh processes instead.

The figure is the median over rounds of each round's ratio (attached median step over the
detached median of the same round pair), with a 90 % bootstrap interval; `--processes N` runs
the rounds in N fresh processes and resamples processes, then rounds within them (as
bench_agent_overhead.py does), so the interval also covers how much processes differ.

`--without PART` (repeatable) takes a part of the agent out of the attached arm, to find where a
cost lies: `events` (one CUDA event per step, at its end, instead of one at every phase
boundary), `reader` (no Flight Recorder dumps), `topology` (NVML and sysfs read once, at the
first flush), `reporter` (no flush during the run). Each arm's training-thread CPU per step is
reported beside its step time (`thread_cpu_us`): a cost that shows in the step but not there lies
in other threads contending for the GIL or the driver. `--profile N` ends the run with one more
round of N steps per arm under cProfile and prints each arm's costliest functions with their
calls per step, to name the code a training-thread cost comes from. `--cpus 2-5` pins each
measuring process (not the exporter it starts) to those CPUs, so that its threads and the
agent's stay on the same cores in both arms (a launch-bound step moves with the core its thread
lands on). `--steps-out PATH` writes every measured step's time, per process, round and arm, as
JSON: what a better statistic can be worked out from offline. `--device cpu` runs the same bench
on gloo with a small float32 model: a smoke test of this script where there is no GPU
(tests/unit/test_bench_gpu_overhead.py), not a measurement of the GPU path.

Run (GPU machine; one GPU is enough, torchrun for more):
  .venv/bin/python -m bench.bench_gpu_overhead [--rounds 8] [--steps 150] [--processes 2]
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

from syncscope.lab.stats import median_ci

TARGET_RATIO = 1.002
TARGET_CI_UPPER = 1.005


def need_cuda():
    try:
        import torch
    except ImportError:
        sys.exit("bench_gpu_overhead.py needs torch with CUDA; torch is not installed here.")
    if not torch.cuda.is_available():
        sys.exit(
            "bench_gpu_overhead.py needs a CUDA GPU and a CUDA build of torch "
            f"(found torch {torch.__version__}, CUDA available: False). "
            "Run it on the device machine; bench/bench_agent_overhead.py is the CPU bench."
        )
    return torch


def build(torch, layers: int, d: int, batch: int, seq: int, local_rank: int, cuda: bool = True):
    dtype = torch.bfloat16 if cuda else torch.float32
    layer = torch.nn.TransformerEncoderLayer(
        d_model=d, nhead=16, dim_feedforward=4 * d, batch_first=True, dtype=dtype
    )
    model = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    if not cuda:
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        return model, opt, torch.randn(batch, seq, d)
    model = torch.nn.parallel.DistributedDataParallel(
        model.cuda(local_rank), device_ids=[local_rank]
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(batch, seq, d, device=f"cuda:{local_rank}", dtype=dtype)
    return model, opt, x


PARTS = ("events", "reader", "topology", "reporter")


def without(agent, parts: list[str]) -> None:
    """Take `parts` (PARTS) out of an attached agent, as far as it has them."""
    clock, reader, topology = agent.clock, agent.nccl_reader, agent.topology
    if "events" in parts and hasattr(clock, "_mark"):
        clock.mark = lambda _kind: None  # the step end's own event stays (end_step)
    if "reader" in parts and reader is not None:
        reader.stop()
    if "topology" in parts and topology is not None:
        topology.interval_s = float("inf")


def run_steps(model, opt, x, steps: int, cpu: list[float] | None = None) -> list[float]:
    """Each step's wall time; with `cpu`, the training thread's CPU per step appended to it."""
    times = []
    cpu0 = time.thread_time_ns()
    last = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        loss.item()
        now = time.perf_counter()
        times.append(now - last)
        last = now
    if cpu is not None:
        cpu.append((time.thread_time_ns() - cpu0) / 1e3 / steps)
    return times


def profile_round(model, opt, x, steps: int, label: str, top: int = 25) -> None:
    """`steps` steps under cProfile: the costliest functions by own time, with calls per step.
    Then `steps` more under sys.setprofile: the agent's Python frames the training thread
    enters a step, exact, where cProfile may miss some (syncscope/lab/frames.py): on a GPU, a
    hook that leaves its path in C for Python's shows there."""
    import cProfile
    import pstats

    import syncscope.agent

    from syncscope.lab.frames import frames_entered, per_step

    agent_dir = os.path.dirname(syncscope.agent.__file__)

    prof = cProfile.Profile()
    prof.enable()
    run_steps(model, opt, x, steps)
    prof.disable()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    total = sum(v[2] for v in stats.values())
    print(f"profile, {label}: {total / steps * 1e6:.0f} µs of profiled own time per step")
    ours = sorted(
        ((k, v) for k, v in stats.items() if k[0].startswith(agent_dir)),
        key=lambda kv: kv[1][3],
        reverse=True,
    )[:top]
    for title, chosen in (("by own time", rows), ("syncscope's, by cumulative time", ours)):
        print(f" {title}:")
        for (path, line, name), (_cc, calls, tottime, cumtime, _callers) in chosen:
            where = f"{os.path.basename(path)}:{line}({name})"
            print(
                f"  {tottime / steps * 1e6:8.1f} µs own {cumtime / steps * 1e6:8.1f} µs cum "
                f"{calls / steps:6.1f} calls/step  {where}"
            )
    counts = frames_entered(agent_dir, lambda: run_steps(model, opt, x, steps))
    print(f" the agent's Python frames a step (sys.setprofile): {per_step(counts, steps)}")


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def agent_parts(agent) -> dict:
    import torch
    from syncscope.agent import native

    clock = getattr(agent, "clock", None)
    reader = getattr(agent, "nccl_reader", None)
    triggers = getattr(clock, "triggers", None)
    return {
        "clock": type(clock).__name__,
        # the agent's C++ library (`python -m syncscope.agent.native`): its hooks in C, the
        # backward's trigger C++'s; without it all of them are Python's
        "library": native.load(torch) is not None,
        "native_trigger": getattr(triggers, "native", None) is not None,
        "gpu_steps": getattr(clock, "gpu_steps", None),
        "cpu_steps": getattr(clock, "cpu_steps", None),
        "nccl_reader": None
        if reader is None
        else {k: reader.stats[k] for k in ("dumps", "last_dump_seconds", "records", "dropped")}
        | {
            "dump_every_steps": reader.timeline.dump_every,
            "dump_steps": list(reader.dump_steps),
            "fallback": reader.fallback_reason,
        },
        "topology": getattr(agent, "topology", None) is not None,
        "errors": agent.stats.get("errors"),
    }


def ab(args) -> int:
    cuda = args.device == "cuda"
    if cuda:
        torch = need_cuda()
    else:
        import torch
    import torch.distributed as dist
    from syncscope.agent import attach

    if args.emit:  # a child of `pooled`: should it die, every thread's stack on its stderr
        faulthandler.enable()
    machine = os.sched_getaffinity(0)
    if args.cpus:  # first, so that every thread torch, gloo/NCCL and the agent start is here
        os.sched_setaffinity(0, args.cpus)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(local_rank)
    if "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend)
    else:
        store = tempfile.mktemp(prefix="syncscope-gpu-bench-")
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    options = dict(args.attach_option)
    if "reporter" in args.without:
        options["flush_interval_s"] = 3600.0
    exporter_proc, url = None, None if args.exporter == "none" else args.exporter
    if args.exporter == "auto":
        # a real exporter, so the reporter sends and the topology sampler runs, as in production
        from syncscope.lab.servers import free_port, start_exporter

        port = free_port()
        others = machine - args.cpus if args.cpus else set()
        exporter_proc = start_exporter(
            port,
            stdout=subprocess.DEVNULL,
            # the sidecar keeps to the other cores, every thread of it (set before its exec)
            preexec_fn=(lambda: os.sched_setaffinity(0, others)) if others else None,
        )
        url = f"http://127.0.0.1:{port}"
    # A model per arm, the same from the same seed: what an agent leaves on a model's
    # parameters (torch keeps a tensor's C++ gradient hook after its Python hooks are removed)
    # stays off the detached arm's steps.
    models = {}
    for attached in (False, True):
        torch.manual_seed(0)
        models[attached] = build(torch, args.layers, args.d, args.batch, args.seq, local_rank, cuda)
        model, opt, x = models[attached]
        run_steps(model, opt, x, args.warmup)
    times: dict[bool, list[float]] = {False: [], True: []}
    per_round: list[dict[str, list[float]]] = []  # each round's step times, per arm (--steps-out)
    thread_cpu: dict[bool, list[float]] = {False: [], True: []}  # µs per step, per round
    round_ratios: list[float] = []  # per round pair: attached median / detached median
    parts = None
    dumps_per_round: list[int] = []  # Flight Recorder dumps inside each attached round

    def attached_agent():
        """The attached arm's agent: `--without` parts out, `--dump-every` applied."""
        model, opt, _ = models[True]
        agent = attach(model=model, optimizer=opt, exporter=url, **options)
        without(agent, args.without)
        reader = getattr(agent, "nccl_reader", None)
        if reader is not None and args.dump_every and "reader" not in args.without:
            # dumps inside every measured round, far more often than the budget allows
            reader.timeline.dump_every = args.dump_every
            reader.reschedule = lambda: None
        return agent

    for i in range(args.rounds):
        per_round.append({})
        for attached in (False, True) if i % 2 == 0 else (True, False):
            agent = attached_agent() if attached else None
            reader = getattr(agent, "nccl_reader", None)
            model, opt, x = models[attached]
            run_steps(model, opt, x, args.warmup)
            before = reader.stats["dumps"] if reader is not None else 0
            measured = run_steps(model, opt, x, args.steps, thread_cpu[attached])
            times[attached] += measured
            per_round[-1]["attached" if attached else "detached"] = measured
            if attached:
                attached_median = statistics.median(measured)
            else:
                detached_median = statistics.median(measured)
            if agent is not None:
                if reader is not None:
                    dumps_per_round.append(reader.stats["dumps"] - before)
                parts = agent_parts(agent)
                agent.close()
        round_ratios.append(attached_median / detached_median)
    if args.profile:
        model, opt, x = models[False]
        profile_round(model, opt, x, args.profile, "detached")
        agent = attached_agent()
        model, opt, x = models[True]
        run_steps(model, opt, x, args.warmup)
        profile_round(model, opt, x, args.profile, f"attached (without {args.without or 'none'})")
        agent.close()
    dist.destroy_process_group()
    if exporter_proc is not None:
        exporter_proc.terminate()
    if rank != 0:
        return 0
    m0, m1 = statistics.median(times[False]), statistics.median(times[True])
    q0, q1 = p99(times[False]), p99(times[True])
    result = {
        "device": torch.cuda.get_device_name(local_rank) if cuda else "cpu",
        "without": args.without,
        "world_size": world,
        "steps_per_arm": len(times[False]),
        "median_ms": {"detached": m0 * 1e3, "attached": m1 * 1e3},
        "p99_ms": {"detached": q0 * 1e3, "attached": q1 * 1e3},
        "thread_cpu_us": {
            "detached": statistics.median(thread_cpu[False]),
            "attached": statistics.median(thread_cpu[True]),
        },
        "median_ratio": m1 / m0,
        "round_ratios": round_ratios,
        "p99_ratio": q1 / q0,
        "agent": parts,
        "dumps_per_attached_round": dumps_per_round,
        "exporter": url,
        "cpus": sorted(os.sched_getaffinity(0)),
    }
    if args.steps_out:
        steps_out(args.steps_out, {"argv": sys.argv[1:], "rounds": per_round})
    print(json.dumps(result, indent=1, default=str))
    if args.emit:
        with open(args.emit, "w") as f:
            json.dump(result, f, default=str)
        # The result is on disk: skip the interpreter's teardown. torch 2.13 keeps gloo's
        # worker threads after destroy_process_group (pt_gloo_runloop ×2 and gloo_tcp_loop
        # still run here after it and a gc, without the agent too); a finalizing interpreter
        # racing such a worker is torch's known abort at exit (pytorch#179291), which is what
        # one CI run's child showed ("terminate called without an active exception"; not
        # reproduced here in 227 runs, loaded or pinned to one core).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if cuda and (parts is None or parts["clock"] != "CudaPhaseClock" or not parts["nccl_reader"]):
        print(
            "NOTE: attach() did not enable the GPU parts (agent/core.py wiring not applied?): "
            "this measured the CPU agent only."
        )
    return verdict(round_ratios, None, f"p99 {q1 / q0:.4f}", args)


def steps_out(path: str, record: dict) -> None:
    """Add one process's per-step times (`--steps-out`) to the JSON list at `path`."""
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            runs = json.load(f)
    runs.append(record)
    with open(path, "w") as f:
        json.dump(runs, f)


def cpu_list(text: str) -> set[int]:
    """'2-5,8' -> {2, 3, 4, 5, 8}."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.partition("-")
            cpus.update(range(int(first), int(last or first) + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected CPUs like 2-5,8, got {text!r}") from None
    if not cpus:
        raise argparse.ArgumentTypeError("no CPUs given")
    return cpus


def verdict(ratios: list[float], groups: list[int] | None, extra: str, args) -> int:
    """The median round ratio and its 90 % interval against the targets; the exit status."""
    median = statistics.median(ratios)
    low, high = median_ci(ratios, random.Random(0), groups=groups)
    ok = median <= TARGET_RATIO and high <= TARGET_CI_UPPER
    print(
        f"{'PASS' if ok else 'FAIL'}: median round ratio {median:.4f} (90 % CI {low:.4f} to "
        f"{high:.4f}; targets ≤ {TARGET_RATIO}, upper ≤ {TARGET_CI_UPPER}) over "
        f"{len(ratios)} rounds, {extra}"
    )
    return 0 if ok or args.no_fail else 1


def pooled(args) -> int:
    """The A/B in fresh processes, one after another; rounds pooled, resampled by process."""
    ratios: list[float] = []
    groups: list[int] = []
    medians: list[str] = []
    forwarded = [*sys.argv[1:], "--processes", "1"]  # the last one counts
    with tempfile.TemporaryDirectory(prefix="syncscope-gpu-bench-") as tmp:
        for i in range(args.processes):
            emit = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, "-m", "bench.bench_gpu_overhead", *forwarded, "--emit", emit]
            subprocess.run(cmd, check=True)
            with open(emit) as f:
                r = json.load(f)
            ratios += r["round_ratios"]
            groups += [i] * len(r["round_ratios"])
            ms = r["median_ms"]
            medians.append(f"{ms['detached']:.3f}/{ms['attached']:.3f}")
            cpu = r["thread_cpu_us"]
            print(
                f"process {i}: rounds {[round(x, 4) for x in r['round_ratios']]}, training "
                f"thread {cpu['detached']:.0f}/{cpu['attached']:.0f} µs CPU per step",
                flush=True,
            )
    return verdict(ratios, groups, f"{args.processes} processes (ms: {', '.join(medians)})", args)


def nccl_timing_ab(args) -> int:
    """TORCH_NCCL_ENABLE_TIMING's own cost: fresh processes, no agent, alternating."""
    need_cuda()
    medians: dict[str, list[float]] = {"0": [], "1": []}
    for i in range(args.rounds):
        for timing in ("0", "1") if i % 2 == 0 else ("1", "0"):
            env = dict(os.environ, TORCH_NCCL_ENABLE_TIMING=timing)
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "bench.bench_gpu_overhead",
                    "--baseline-only",
                    *sys.argv[1:],
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            medians[timing].append(float(out.strip().splitlines()[-1]))
    m0, m1 = statistics.median(medians["0"]), statistics.median(medians["1"])
    print(f"NCCL timing off {m0 * 1e3:.3f} ms, on {m1 * 1e3:.3f} ms, ratio {m1 / m0:.4f}")
    return 0


def baseline_only(args) -> int:
    torch = need_cuda()
    import torch.distributed as dist

    torch.cuda.set_device(0)
    store = tempfile.mktemp(prefix="syncscope-gpu-bench-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    model, opt, x = build(torch, args.layers, args.d, args.batch, args.seq, 0)
    run_steps(model, opt, x, args.warmup)
    print(statistics.median(run_steps(model, opt, x, args.steps)))
    dist.destroy_process_group()
    return 0


def attach_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--steps", type=int, default=150, help="measured steps per round")
    p.add_argument("--warmup", type=int, default=20, help="steps before each round")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument(
        "--exporter",
        default="auto",
        help="auto (start a real exporter, the default), none, or an http:// URL",
    )
    p.add_argument("--no-fail", action="store_true", help="exit 0 even above the target")
    p.add_argument(
        "--attach-option",
        type=attach_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an attach() keyword for the attached arm, e.g. flush_interval_s=10 (repeatable)",
    )
    p.add_argument(
        "--dump-every",
        type=int,
        default=0,
        help="force a Flight Recorder dump every N steps (a power of two; default: the "
        "agent's own period, from the dump's cost and its 0.1 %% budget: rarely inside a round)",
    )
    p.add_argument("--processes", type=int, default=1, help="fresh processes, rounds pooled")
    p.add_argument("--without", action="append", default=[], choices=PARTS, metavar="PART")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--cpus", type=cpu_list, default=None, help="pin each measuring process here")
    p.add_argument("--steps-out", default=None, metavar="PATH", help="every step's time, JSON")
    p.add_argument(
        "--profile", type=int, default=0, metavar="N", help="one more round per arm under cProfile"
    )
    p.add_argument("--emit", help=argparse.SUPPRESS)  # a child's result file (--processes)
    p.add_argument("--nccl-timing-ab", action="store_true")
    p.add_argument("--baseline-only", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.attach_option = dict(args.attach_option)
    if args.baseline_only:
        return baseline_only(args)
    if args.nccl_timing_ab:
        return nccl_timing_ab(args)
    if args.processes > 1:
        return pooled(args)
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    return ab(args)


if __name__ == "__main__":
    sys.exit(main())
