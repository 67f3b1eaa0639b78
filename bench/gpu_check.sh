#!/usr/bin/env bash
# Every GPU check the GPU issue asks for, in one run of under 8 minutes on the device machine,
# its figures in one file ($OUT/gpu-figures.txt) and each check's whole log beside it.
#
# On the device (one call; the wheels it lacks travel from here, made by scripts/device-wheels):
#   run(command="BUDGET_S=550 bash bench/gpu_check.sh", carry=[".whl"], timeout_s=560)
# BUDGET_S (bench/device_common.sh) cuts every section's timeout to what is left of it, so that
# the call's own limit never kills the script before it writes its figures: set it a little
# under the call's timeout_s.
# Here (no GPU) it runs in seconds and says what it skipped and why. SECTIONS="fsdp2-cpu
# overhead-launch" (any of tests-gpu energy overhead-launch overhead-50ms fsdp2-cpu, in the order
# given) runs only those, so that a session's 15 device minutes can be split over two calls on
# the same warm machine.
#
# Sections, each under its own timeout so that one hang cannot cost the rest:
#   versions    GPU, driver, torch, CUDA, NCCL
#   install     the exporter's web stack from .whl/, syncscope itself (editable, no deps), and
#               the agent's C++ library built for the device's torch (the hooks in C)
#   tests/gpu   pytest: NVML topology, fixture capture, DDP/NCCL phases and Flight Recorder,
#               DDP, FSDP2 and FSDP1 through attach() with a real exporter, reduce-overhead
#               compile, CUDA-graph capture in global and thread-local mode
#   energy      NVML's energy counter over a fixed matmul load, and what the agent reports
#   fsdp2-cpu   only with FSDP2_CPU=1 (about 1.5 minutes more on an H200's host at 40 rounds
#               of 10 steps an arm; FSDP2_ROUNDS, FSDP2_STEPS change them): the FSDP2 overhead
#               bench of the parallelism issue on gloo, 4 ranks on this machine's quiet cores
#               (paired: two copies of the job at once, a core per rank, one with the agent),
#               with the C++ collective kernel built at install: a figure 2 shared
#               vCPUs cannot resolve (docs/parallelism.md)
#   overhead-launch, overhead-50ms
#               bench/bench_gpu_overhead.py, agent vs none, interleaved rounds in 2 fresh
#               processes: a GPU-bound step of ≥ 50 ms (batch 48), a launch-bound one
#               (2 layers, batch 2: 6 to 7 ms on an H200, whose host launches no faster), and that
#               one again with phase sampling (phase_every=16: one step in 16 timed); the
#               launch-bound runs with each arm's training-thread CPU per step and a cProfile
#               round of each arm (--profile), to name the code the cost comes from; each
#               measuring process pinned to BENCH_CPUS (2-5 where there are ≥ 8), every step's
#               time in $OUT/steps-*.json
set -uo pipefail
cd "$(dirname "$0")/.."
FIGURES=gpu-figures.txt
. bench/device_common.sh

section versions
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$FIG" \
  || say "nvidia-smi: not found"
"$PY" - <<'PY' 2>&1 | tee -a "$FIG"
import platform
try:
    import torch
except ImportError:
    print("torch: not installed")
else:
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a"
    print(f"python {platform.python_version()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, available {cuda}, NCCL {nccl}")
    if cuda:
        print(f"device: {torch.cuda.get_device_name(0)}")
PY
GPU=$("$PY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

section install
install_syncscope
# The agent's C++ library, as scripts/setup builds it (the image has ninja and a compiler):
# without it the hooks run in Python, and neither tests/gpu nor the overhead benches measure
# what an install runs (the benches print which they had).
TAIL=3 run native-library 180 "$PY" -m syncscope.agent.native \
  || say "the agent's C++ library did not build: the hooks below are Python's"

if [ "$GPU" != 1 ]; then
  section skipped
  say "no CUDA GPU here: tests/gpu, the overhead bench and the energy check need one"
  exit 0
fi

tests_gpu() {
  section tests/gpu
  TAIL=25 run tests-gpu 270 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider
}

energy() {
  section energy
TAIL=10 run energy 45 "$PY" - <<'PY'
"""NVML's energy counter across a fixed load, read apart from syncscope, beside the agent's own
topology reading of the same counter (agent.topology): both in joules, and their difference."""
import time

import pynvml
import torch

from syncscope.agent.topology import ENERGY_KEY, TopologySampler, locator_from_torch

pynvml.nvmlInit()
index = torch.cuda.current_device()
handle = pynvml.nvmlDeviceGetHandleByIndex(index)
now = [0.0]  # the sampler's clock: each call below is a new interval, so it reads NVML again
sampler = TopologySampler(locator_from_torch(torch, index), interval_s=1.0, clock=lambda: now[0])


def agent_joules():
    now[0] += 1.0
    return (sampler() or {}).get(ENERGY_KEY)


x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
mj0 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
a0 = agent_joules()
t0 = time.perf_counter()
while time.perf_counter() - t0 < 10:
    for _ in range(50):
        x @ x
    torch.cuda.synchronize()
mj1 = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
a1 = agent_joules()
seconds = time.perf_counter() - t0
nvml_j = (mj1 - mj0) / 1e3
print(f"NVML: {nvml_j:.1f} J in {seconds:.1f} s ({nvml_j / seconds:.0f} W)")
if a0 is None or a1 is None:
    print(f"agent: no energy reading ({ENERGY_KEY}: {a0!r}, {a1!r})")
else:
    agent_j = a1 - a0
    print(f"agent: {agent_j:.1f} J; differs from NVML by {abs(agent_j - nvml_j) / nvml_j:.1%}")
PY
}

# Each measuring process pinned to 4 cores (the exporter to the rest), so that its threads and
# the agent's sit on the same cores in both arms; every step's time kept for offline analysis
# of the rounds' spread (±8 % at the launch-bound step on 2026-11-27, unpinned).
PIN=()
if [ "$(nproc)" -ge 8 ]; then PIN=(--cpus "${BENCH_CPUS:-2-5}"); fi

overhead_launch() {
  section overhead-launch
  TAIL=4 run overhead-launch-bound 130 "$PY" -m bench.bench_gpu_overhead --processes 2 \
    --rounds 8 --steps 200 --warmup 30 --layers 2 --batch 2 --no-fail --profile 100 \
    "${PIN[@]}" --steps-out "$OUT/steps-launch-bound.json"
  # again with phase sampling (phase_every=16: one step in 16 timed, one event on the others;
  # attach()'s default times every step, docs/gpu.md): what sampling saves with real events.
  TAIL=4 run overhead-launch-bound-sampled 130 "$PY" -m bench.bench_gpu_overhead \
    --processes 2 --rounds 5 --steps 250 --warmup 30 --layers 2 --batch 2 --no-fail \
    --attach-option phase_every=16 --profile 100 \
    "${PIN[@]}" --steps-out "$OUT/steps-launch-bound-sampled.json"
  overhead_figures
}

overhead_50ms() {
  section overhead-50ms
  TAIL=4 run overhead-50ms 150 "$PY" -m bench.bench_gpu_overhead --processes 2 --rounds 4 \
    --steps 60 --warmup 15 --batch 48 --no-fail "${PIN[@]}" --steps-out "$OUT/steps-50ms.json"
  overhead_figures
}

overhead_figures() {
  grep -h '"library"\|"dumps_per_attached_round"\|"median_ms"\|"thread_cpu_us"\|^process ' -A2 \
    "$OUT"/overhead-*.log | head -60 >>"$FIG"
  # the agent's Python frames a step on the training thread, each profile round's (a hook
  # that left its C path on the GPU names itself here)
  grep -H "^ the agent's Python frames" "$OUT"/overhead-*.log | head -16 >>"$FIG"
}

fsdp2_cpu() {
  section fsdp2-cpu
  local rounds=${FSDP2_ROUNDS:-40} steps=${FSDP2_STEPS:-10}
  # its timeout grows with the rounds and steps asked (interleaved, 40 x 10 ran in about 90 s
  # on an H200's host; a fixed 200 s would cut 40 x 30 short). Paired (16 cores), rounds start
  # 1.2 x (steps + 2) steps apart: 40 x 30 at ~62 ms about 100 s after the jobs' start-up (an
  # estimate: no paired run has finished on a device yet). Cut short, it reports the rounds
  # every rank finished.
  TAIL=9 run fsdp2-cpu $((60 + rounds * steps * 3 / 10)) "$PY" -m bench.bench_fsdp2_overhead \
    --world 4 --rounds "$rounds" --steps "$steps"
}

DEFAULT="tests-gpu energy overhead-launch overhead-50ms"
if [ "${FSDP2_CPU:-0}" = 1 ]; then DEFAULT="$DEFAULT fsdp2-cpu"; fi
for name in ${SECTIONS:-$DEFAULT}; do
  case $name in
    tests-gpu | energy | overhead-launch | overhead-50ms | fsdp2-cpu) "${name//-/_}" ;;
    *) say "unknown section $name (tests-gpu energy overhead-launch overhead-50ms fsdp2-cpu)" ;;
  esac
done

say ""
say "figures: $FIG; logs: $OUT"
