"""A one-process NCCL DDP job on the GPU, timed by syncscope's GPU parts; writes a JSON verdict.

    python tests/gpu/nccl_ddp_job.py --out result.json [--via modules|attach] [--steps 120]
                                     [--wrap ddp|fsdp2|fsdp1]

--via modules  wires CudaPhaseClock + FlightRecorderReader + TopologySampler the way the
               proposed agent/core.py change does, with plain queues the script reads back;
--via attach   goes through syncscope.agent.attach() (needs that change applied) and a real
               exporter, and reads the exporter's /metrics.
Either way it compares the reader's records with Flight Recorder's own dump (through attach():
the exporter's collective counts per op) and the CUDA-event step times with the wall clock.
--wrap picks the data-parallel wrapper (attach only): DDP, FSDP2 (`fully_shard` per layer and
the root) or FSDP1 (`FullyShardedDataParallel`, which needs a GPU). Run by
tests/gpu/test_gpu_agent.py in a fresh process, so that TORCH_NCCL_ENABLE_TIMING and the
process group never leak into other tests.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import Counter, deque


def build(torch, layers: int, d: int, batch: int, seq: int, wrap: str = "ddp"):
    layer = torch.nn.TransformerEncoderLayer(
        d_model=d, nhead=16, dim_feedforward=4 * d, batch_first=True, dtype=torch.bfloat16
    )
    model = torch.nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=False)
    model = model.cuda()
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
    elif wrap == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        model = FullyShardedDataParallel(
            model,
            device_id=0,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.TransformerEncoderLayer}),
            use_orig_params=True,
        )
    else:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    x = torch.randn(batch, seq, d, device="cuda", dtype=torch.bfloat16)
    return model, opt, x


def train(torch, model, opt, x, steps: int) -> list[int]:
    """Steps with a host sync every step (as loss logging does); returns perf_counter_ns ends."""
    ends = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        loss.item()
        ends.append(time.perf_counter_ns())
    return ends


def fr_entries(torch) -> list[dict]:
    raw = torch._C._distributed_c10d._dump_nccl_trace(
        includeCollectives=True, includeStackTraces=False, onlyActive=False
    )
    return pickle.loads(raw)["entries"]


# Parsed here from the dump's documented fields, not with syncscope.agent.nccl_trace's helpers.
OWN_OPS = {
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "broadcast": "broadcast",
    "_broadcast_oop": "broadcast",
    "all_gather": "all_gather",  # DDP's constructor checks parameter shapes with one
    "_all_gather_base": "all_gather",
    "_reduce_scatter_base": "reduce_scatter",
    "all_gather_single": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
}
OWN_DTYPE_BYTES = {"Float": 4, "BFloat16": 2, "Half": 2, "Double": 8, "Long": 8, "Int": 4}


def timed_entries(torch) -> list[dict]:
    """Flight Recorder's completed, timed collectives (no point-to-point)."""
    return [
        e
        for e in fr_entries(torch)
        if e["state"] == "completed" and not e["is_p2p"] and e.get("duration_ms") is not None
    ]


def own_op(entry: dict) -> str:
    name = entry["profiling_name"].split(":", 1)[1]
    return OWN_OPS.get(name, "unknown:" + name)


def compare_with_flight_recorder(torch, records: list[tuple]) -> dict:
    own: Counter[tuple] = Counter()
    names: Counter[str] = Counter()
    for e in timed_entries(torch):
        name = e["profiling_name"].split(":", 1)[1]
        names[name] += 1
        op = own_op(e)
        sizes, dtypes = (
            (e["output_sizes"], e["output_dtypes"])
            if op == "all_gather"
            else (e["input_sizes"], e["input_dtypes"])
        )
        nbytes = 0
        for shape, dtype in zip(sizes, dtypes, strict=True):
            numel = 1
            for dim in shape:
                numel *= dim
            nbytes += numel * OWN_DTYPE_BYTES[dtype]
        own[(op, float(nbytes), round(e["duration_ms"] * 1e6))] += 1
    ours = Counter((r[0], r[2], r[3]) for r in records)
    return {
        "fr_completed_timed": sum(own.values()),
        "fr_names": dict(names),
        "reader_records": sum(ours.values()),
        "missing_from_reader": sum((own - ours).values()),
        "extra_in_reader": sum((ours - own).values()),
    }


def gpu_step_check(steps: list[tuple], ends: list[int], first: int) -> dict:
    """GPU step totals vs the wall clock between host-synchronised step ends."""
    by_step = {s[0]: s for s in steps}
    window = [i for i in range(first, len(ends)) if i in by_step]
    gpu_total = sum(by_step[i][2] for i in window)
    wall = ends[window[-1]] - ends[window[0] - 1]
    other = sum(max(0, by_step[i][2] - sum(by_step[i][3:])) for i in window)
    return {
        "steps_checked": len(window),
        "gpu_over_wall": gpu_total / wall,
        "other_share": other / gpu_total,
        "median_phases_ms": {
            name: statistics.median(by_step[i][3 + k] for i in window) / 1e6
            for k, name in enumerate(("data", "forward", "backward", "optimizer", "comm", "pacing"))
        },
    }


def sampling_check(steps: list[tuple], every: int, first: int) -> dict:
    """With phase sampling: each quiet step's phase shares against its timed step's (the last
    step before it whose number is a multiple of `every`)."""
    by_step = {s[0]: s for s in steps}

    def shares(row: tuple) -> list[float]:
        return [ns / row[2] for ns in row[3:9]]

    compared = mismatched = 0
    for step, row in by_step.items():
        timed = step - step % every
        if every == 1 or step == timed or timed < first or timed not in by_step:
            continue
        compared += 1
        if any(abs(a - b) > 1e-6 for a, b in zip(shares(row), shares(by_step[timed]), strict=True)):
            mismatched += 1
    return {"every": every, "quiet_steps_compared": compared, "mismatched": mismatched}


def via_modules(torch, args) -> dict:
    from syncscope.agent.cuda_timing import CudaPhaseClock
    from syncscope.agent.nccl_trace import FlightRecorderReader, StepTimeline
    from syncscope.agent.phase_hooks import instrument
    from syncscope.agent.topology import TopologySampler, locator_from_torch

    model, opt, x = build(torch, args.layers, args.d, args.batch, args.seq)
    steps: deque = deque(maxlen=100_000)
    colls: deque = deque(maxlen=100_000)
    timeline = StepTimeline()
    errors: list = []
    clock = CudaPhaseClock(
        steps,
        colls,
        torch.autograd.Variable._execution_engine.queue_callback,
        "default_pg",
        float(sum(p.numel() * p.element_size() for p in model.parameters())),
        errors.append,
        timeline=timeline,
    )
    clock.phase_every = args.phase_every
    instrument(clock, model, opt)
    fr_sink: deque = deque(maxlen=100_000)
    reader = FlightRecorderReader(
        fr_sink, timeline=timeline, current_step=lambda: clock.step, min_interval_s=1.0
    )  # dumps after agreed steps (StepTimeline), as in the agent
    clock.start()
    reader.start()
    sampler = TopologySampler(locator_from_torch(torch, 0))
    topo = sampler()
    real_sync = torch.cuda.synchronize

    def forbidden(*_a, **_k):
        raise AssertionError("torch.cuda.synchronize() called during the timed loop")

    torch.cuda.synchronize = forbidden
    try:
        ends = train(torch, model, opt, x, args.steps)
    finally:
        torch.cuda.synchronize = real_sync
    real_sync()
    time.sleep(1.5)  # the NCCL watchdog marks entries completed
    clock.stop(timeout=2.0)
    reader.stop()
    reader.active = True
    reader.poll()  # the last entries
    sampler.close()
    return {
        "errors": [repr(e) for e in errors],
        "topology": topo,
        "torch_device_name": torch.cuda.get_device_name(0),
        "gpu_steps": clock.gpu_steps,
        "cpu_steps": clock.cpu_steps,
        "cuda": gpu_step_check(list(steps), ends, first=10),
        "sampling": sampling_check(list(steps), args.phase_every, first=10),
        "fr": compare_with_flight_recorder(torch, list(fr_sink)),
        "fr_stats": reader.stats,
        "fr_fallback": reader.fallback_reason,
        "ddp_records": [list(c) for c in list(colls)[-3:]],
        "steps_of_fr_records": [min(r[4] for r in fr_sink), max(r[4] for r in fr_sink)]
        if fr_sink
        else None,
    }


def via_attach(torch, args) -> dict:
    from prometheus_client.parser import text_string_to_metric_families
    from syncscope.agent import attach

    from syncscope.lab.servers import free_port, start_exporter

    port = free_port()
    exporter = start_exporter(port)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/healthz", timeout=1).read()
                break
            except OSError:
                time.sleep(0.1)
        model, opt, x = build(torch, args.layers, args.d, args.batch, args.seq, args.wrap)
        agent = attach(model=model, optimizer=opt, exporter=url, job="gpu-check")
        wired = {
            "cuda_clock": type(getattr(agent, "clock", None)).__name__,
            "nccl_reader": getattr(agent, "nccl_reader", None) is not None,
            "topology": getattr(agent, "topology", None) is not None,
            "event": type(agent.clock.event_factory()).__name__,  # torch.Event's: recorded in C
            # the backward's trigger C++'s, calling the hook in C (the library built)
            "native_trigger": agent.clock.triggers.native_calls,
        }
        train(torch, model, opt, x, args.steps)
        wired["native_trigger_after"] = agent.clock.triggers.native_calls  # no backward missed
        torch.cuda.synchronize()
        time.sleep(1.5)  # the NCCL watchdog retires the last entries
        reader = agent.nccl_reader
        agent.close()  # its reader dumps a last time: the entries since its last dump
        time.sleep(1.0)
        metrics = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        state = json.loads(urllib.request.urlopen(url + "/v1/state", timeout=5).read())
        flight_recorder = Counter(own_op(e) for e in timed_entries(torch))
    finally:
        exporter.terminate()
    gpu_lines = [ln for ln in metrics.splitlines() if ln.startswith("syncscope_gpu_")]
    coll_lines = [
        ln for ln in metrics.splitlines() if ln.startswith("syncscope_collective_calls_total")
    ]
    exported: Counter[str] = Counter()  # calls per op, summed over groups
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == "syncscope_collective_calls_total":
                exported[sample.labels["op"]] += int(sample.value)
    return {
        "wrap": args.wrap,
        "exported_calls": dict(exported),
        "flight_recorder_calls": dict(flight_recorder),
        "reader_stats": None if reader is None else reader.stats,
        "gpu_steps": getattr(agent.clock, "gpu_steps", None),
        "wired": wired,
        "stats": agent.stats,
        "gpu_metric_lines": gpu_lines,
        "collective_lines": coll_lines,
        "topology": state["jobs"]["gpu-check"]["ranks"][0]["topology"],
        "torch_device_name": torch.cuda.get_device_name(0),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--via", choices=("modules", "attach"), default="modules")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--wrap", choices=("ddp", "fsdp2", "fsdp1"), default="ddp")
    p.add_argument("--phase-every", type=int, default=1, help="phase sampling (--via modules)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d", type=int, default=1024)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args()
    os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")  # nothing evicted: exact comparison
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    store = tempfile.mktemp(prefix="syncscope-gpu-job-")
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        result = via_modules(torch, args) if args.via == "modules" else via_attach(torch, args)
    finally:
        dist.destroy_process_group()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
