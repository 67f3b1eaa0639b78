"""GPU-only checks (skipped with a reason where there is no CUDA; see tests/conftest.py).

On the device machine:  .venv/bin/pytest -q -m gpu tests/gpu -s
  * topology shows the real GPU (NVML through pynvml, sysfs), and the fixture capture works;
  * a one-process NCCL DDP job timed by CudaPhaseClock: GPU step times sum to the wall clock
    within 5 %, no torch.cuda.synchronize() in the timed loop; likewise with phase sampling;
  * the Flight Recorder reader's records equal Flight Recorder's own dump, entry for entry;
  * the same job through attach() and a real exporter, and FSDP2 and FSDP1 jobs likewise: the
    exporter counts, per op, exactly the collectives Flight Recorder timed on the GPU (a CPU
    enqueue timed beside them would double a count);
  * torch.compile(mode="reduce-overhead") and CUDA-graph capture in global and thread-local
    mode next to the agent: the same losses, graphs and graph breaks as without it.
The overhead ratio is bench/bench_gpu_overhead.py's job (minutes, not a test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def run_script(tmp_path: Path, script: str, *args: str) -> dict:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name(script)), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=ROOT,
    )
    print(proc.stdout[-6000:], proc.stderr[-4000:])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def run_job(tmp_path: Path, *args: str) -> dict:
    return run_script(tmp_path, "nccl_ddp_job.py", *args)


def test_topology_shows_the_real_gpu():
    import torch
    from syncscope.agent.topology import TopologySampler, locator_from_torch

    torch.cuda.init()
    locator = locator_from_torch(torch, 0)
    sampler = TopologySampler(locator)
    topo = sampler()
    sampler.close()
    print(json.dumps(topo, indent=1))
    assert sampler.nvml_error is None, f"NVML unavailable: {sampler.nvml_error}"
    assert topo["gpu_name"] == torch.cuda.get_device_name(0)
    assert topo["pci_bus_id"] == locator.pci_bus_id
    assert topo["gpu_uuid"].startswith("GPU-") and topo["gpu_uuid"] == locator.uuid
    assert topo["pcie_link_max_width"] and topo["pcie_link_max_generation"]
    assert isinstance(topo["throttle_reasons"], int) and topo["sm_clock_hertz"] > 0
    assert topo["power_watts"] > 0 and topo["temperature_celsius"] > 0
    assert topo["topology_source"].startswith("nvml")


def test_fixture_capture_runs_and_replays(tmp_path):
    from syncscope.agent.topology import DeviceLocator, TopologySampler

    from tests.fixtures.gpu import load_case

    out = tmp_path / "captured"
    proc = subprocess.run(
        [sys.executable, "tests/fixtures/gpu/capture.py", "--out", str(out), "--fr"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    live = json.loads((out / "topology.json").read_text())
    device, sysfs = load_case(str(out), tmp_path / "replay")
    replayed = TopologySampler(
        DeviceLocator(pci_bus_id=live["pci_bus_id"]), open_nvml=lambda _l: device, sysfs=sysfs
    )()
    static = ("gpu_uuid", "pci_bus_id", "pcie_link_max_width", "gpu_numa_node", "nic")
    assert {k: replayed[k] for k in static} == {k: live[k] for k in static}
    entries = json.loads((out / "fr-dump.json").read_text())["entries"]
    assert any("duration_ms" in e for e in entries), "NCCL timing did not reach Flight Recorder"


def test_nccl_ddp_job_cuda_phases_and_flight_recorder(tmp_path):
    r = run_job(tmp_path, "--via", "modules")
    assert r["errors"] == []
    assert r["topology"]["gpu_name"] == r["torch_device_name"]
    cuda = r["cuda"]
    assert cuda["steps_checked"] >= 100
    assert abs(cuda["gpu_over_wall"] - 1) <= 0.05, cuda  # GPU step times sum to the wall clock
    assert cuda["other_share"] < 0.10, cuda  # the named phases explain the step
    assert cuda["median_phases_ms"]["forward"] > 0 and cuda["median_phases_ms"]["backward"] > 0
    assert r["gpu_steps"] >= 100
    fr = r["fr"]
    assert r["fr_fallback"] is None
    assert fr["fr_completed_timed"] > 0
    assert fr["missing_from_reader"] == 0 and fr["extra_in_reader"] == 0, fr
    assert r["fr_stats"]["errors"] == 0
    print("dump cost", r["fr_stats"]["last_dump_seconds"], "s per dump")


def test_phase_sampling_still_times_every_gpu_step(tmp_path):
    """phase_every=8: one event on the quiet steps, so the GPU step totals still sum to the
    wall clock; their phases are their timed step's shares (agent/phases.py)."""
    r = run_job(tmp_path, "--via", "modules", "--phase-every", "8")
    assert r["errors"] == []
    cuda = r["cuda"]
    assert abs(cuda["gpu_over_wall"] - 1) <= 0.05, cuda
    assert cuda["other_share"] < 0.10, cuda
    assert r["gpu_steps"] >= 100
    sampling = r["sampling"]
    assert sampling["quiet_steps_compared"] >= 80 and sampling["mismatched"] == 0, sampling
    assert r["fr"]["missing_from_reader"] == 0 and r["fr"]["extra_in_reader"] == 0, r["fr"]


def test_nccl_ddp_job_through_attach_and_a_real_exporter(tmp_path):
    r = run_job(tmp_path, "--via", "attach", "--steps", "80")
    wired = r["wired"]
    if wired["cuda_clock"] != "CudaPhaseClock" or not wired["nccl_reader"]:
        pytest.fail(f"agent/core.py does not wire the GPU parts yet: {wired} (see docs/gpu.md)")
    assert r["stats"]["errors"] == 0
    assert wired["event"] == "Event" and r["gpu_steps"] >= 40, (wired, r["gpu_steps"])  # torch's
    # The C++ trigger on CUDA parameters, its hook entered from the engine's device thread, for
    # the whole run (`python -m syncscope.agent.native` builds the library; gpu_check.sh does)
    assert wired["native_trigger"] and wired["native_trigger_after"], wired
    assert any(ln.startswith("syncscope_gpu_info{") for ln in r["gpu_metric_lines"]), (
        "no syncscope_gpu_info: collectors.py does not register collect_gpu yet"
    )
    assert r["topology"]["gpu_name"] == r["torch_device_name"]
    assert any('op="all_reduce"' in ln for ln in r["collective_lines"])
    assert nccl_calls(r) == r["flight_recorder_calls"], r["reader_stats"]


def nccl_calls(r: dict) -> dict:
    """The exporter's calls per op, less the agent's own record of DDP's exposed sync."""
    return {op: n for op, n in r["exported_calls"].items() if op != "ddp_grad_sync"}


@pytest.mark.parametrize("wrap", ["fsdp2", "fsdp1"])
def test_sharded_jobs_collectives_are_the_gpus_not_cpu_enqueues(tmp_path, wrap):
    r = run_job(tmp_path, "--via", "attach", "--wrap", wrap, "--steps", "60", "--layers", "4")
    assert r["stats"]["errors"] == 0
    assert r["wired"]["cuda_clock"] == "CudaPhaseClock" and r["wired"]["nccl_reader"], r["wired"]
    # FSDP2 on one rank skips its collectives (measured: torch 2.11, none in Flight Recorder);
    # FSDP1 on one rank still all-reduces its gradients (NO_SHARD)
    assert (sum(r["flight_recorder_calls"].values()) > 0) == (wrap == "fsdp1")
    # every collective Flight Recorder timed on the GPU, once: none missing, none timed twice
    assert nccl_calls(r) == r["flight_recorder_calls"], r["reader_stats"]
    assert r["gpu_steps"] >= 50, r["gpu_steps"]  # phases from CUDA events, step for step


def test_a_reduce_overhead_compiled_model_trains_with_the_agent_attached(tmp_path):
    r = run_script(tmp_path, "capture_job.py", "--case", "compile")
    without, with_agent = r["without"], r["with"]
    assert with_agent["losses"] == without["losses"]  # the same training, step for step
    assert with_agent["cudagraph_skips"] == 0 == without["cudagraph_skips"]
    assert with_agent["graph_breaks"] == without["graph_breaks"], (with_agent, without)
    assert with_agent["unique_graphs"] == without["unique_graphs"], (with_agent, without)
    assert with_agent["agent"]["errors"] == 0 and with_agent["agent"]["gpu_steps"] > 0


@pytest.mark.parametrize("mode", ["global", "thread_local"])
def test_a_capture_survives_the_agents_background_work(tmp_path, mode):
    r = run_script(tmp_path, "capture_job.py", "--case", mode)
    assert r["background"]["pending_at_capture"] > 0  # events really unfinished at capture
    assert r["background"]["polls"] > 0 and r["background"]["errors"] == []
    assert r["capture_ok"], r["error"]


def test_pacing_is_fed_the_gpus_exposed_communication(tmp_path):
    none, slowed = run_script(tmp_path, "pacing_job.py", "--delay-ms", "10")
    for arm in (none, slowed):
        assert arm["clock"] == "CudaPhaseClock" and arm["gpu_steps"] > 50, arm
    # Rank 0 waits longer for its slowed peer, and its pacer is fed that on top of the transfer
    # it sees without a straggler. Less than the 10 ms: both ranks share the one GPU, so part
    # of the delay overlaps rank 0's own kernels. The lead, not the wait: pacing rank 0 turns
    # part of its wait into its own delay (H200, 2026-11-27: lead +5.0 ms; H100: wait +6.9 ms).
    extra = slowed["unpaced_ms_median"] - none["unpaced_ms_median"]
    assert 3.0 <= extra <= 15.0, (slowed, none)
