"""The simulator's step loop: pacing in the loop, its mechanism, memory, params, Table 1 shape."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from syncscope.agent import pacing as agent_pacing
from syncscope.sim.compute import ComputeModel
from syncscope.sim.engine import Simulator
from syncscope.sim.fabric import Fabric, FabricModel
from syncscope.sim.params import SimParams, bundled_params, load_params, params_from_dict
from syncscope.sim.table1 import ablations, compare

from syncscope.wire import PHASES


def imbalanced_job(skew_coupling: float) -> SimParams:
    """Persistent per-rank speed spread across 4 leaves: pacing has something to act on."""
    return SimParams(
        samples_per_rank=8,
        compute=ComputeModel(
            forward_s=0.03, backward_s=0.06, jitter_cv=0.005, persistent_cv=0.03, drift_cv=0.01
        ),
        fabric=FabricModel(
            gradient_bytes=5e8,
            nic_bandwidth_Bps=2.5e10,
            nodes_per_leaf=4,
            oversubscription=4.0,
            buckets=4,
            skew_coupling=skew_coupling,
            park_limit_s=0.01,
        ),
    )


def test_the_loop_runs_the_agents_own_controller() -> None:
    sim = Simulator(imbalanced_job(0.5), 16, pacing=True)
    assert type(sim.controller) is agent_pacing.PacingController
    assert sim.controller.ranks == sim.ranks
    assert sim.controller.config.world_size == sim.ranks
    assert Simulator(imbalanced_job(0.5), 16).controller is None


def test_pacing_pays_only_through_its_explicit_mechanism() -> None:
    coupled, uncoupled = imbalanced_job(0.6), imbalanced_job(0.0)
    rows = {}
    for name, params in (("coupled", coupled), ("uncoupled", uncoupled)):
        base = Simulator(params, 16, seed=3).run(1500, 200)
        paced = Simulator(params, 16, pacing=True, seed=3).run(1500, 200)
        rows[name] = (base, paced)
    base, paced = rows["coupled"]
    assert paced.engagements > 0
    assert paced.mean_wait_s < 0.7 * base.mean_wait_s  # early ranks now arrive later...
    assert paced.mean_bucket_comm_s < base.mean_bucket_comm_s  # ...so the uplinks are less loaded
    assert paced.throughput > 1.02 * base.throughput
    base, paced = rows["uncoupled"]
    # Same compute, same fabric, no coupling: delaying early ranks cannot shorten any step.
    assert paced.mean_bucket_comm_s == pytest.approx(base.mean_bucket_comm_s, rel=1e-9)
    assert paced.throughput <= base.throughput * 1.0001


def test_pure_straggler_gains_nothing_and_costs_little() -> None:
    params = SimParams(
        compute=ComputeModel(forward_s=0.03, backward_s=0.06, slow_ranks=1, slow_factor=1.2),
        fabric=FabricModel(gradient_bytes=1e8, nic_bandwidth_Bps=1e10),
    )
    base = Simulator(params, 8).run(600, 50)
    paced = Simulator(params, 8, pacing=True).run(600, 50)
    assert paced.mean_delay_s > 0.005  # the seven fast ranks are paced...
    assert paced.mean_step_s == pytest.approx(base.mean_step_s, rel=1e-9)  # ...for nothing


def test_same_seed_same_numbers_and_phase_shares_add_up() -> None:
    params = imbalanced_job(0.3).with_overrides(
        {"compute.tail_prob": 0.01, "compute.episode_prob": 0.01}
    )
    a = Simulator(params, 8, seed=5).run(300, 0)
    b = Simulator(params, 8, seed=5).run(300, 0)
    assert a.mean_step_s == b.mean_step_s and a.cv == b.cv
    assert sum(a.phase_shares.values()) == pytest.approx(1.0, rel=1e-9)
    assert set(a.phase_shares) == set(PHASES)
    assert a.phase_shares["other"] > 0  # the hiccups


def test_per_rank_phases_add_up_to_the_step() -> None:
    sim = Simulator(imbalanced_job(0.3), 8, pacing=True)
    for chunk in sim.iter_chunks(400, chunk=100, keep_ranks=True):
        totals = chunk.rank_phase_s.sum(axis=2)
        np.testing.assert_allclose(
            totals, np.repeat(chunk.step_s[:, None], sim.ranks, 1), rtol=1e-9
        )
        np.testing.assert_allclose(chunk.waits.min(axis=1), 0.0, atol=1e-15)


def test_checkpoint_stall_on_rank_zero_is_not_an_imbalance() -> None:
    params = SimParams(
        compute=ComputeModel(forward_s=0.03, backward_s=0.06, jitter_cv=0.01),
        fabric=FabricModel(gradient_bytes=1e8, nic_bandwidth_Bps=1e10),
    ).with_overrides({"checkpoint": {"every_steps": 100, "stall_s": 2.0, "ranks": "first"}})
    paced = Simulator(params, 8, pacing=True).run(1000, 0)
    base = Simulator(params, 8).run(1000, 0)
    assert paced.engagements == 0
    assert paced.mean_step_s == pytest.approx(base.mean_step_s, rel=1e-9)
    assert base.phase_shares["other"] > 0.01


def test_memory_does_not_grow_with_steps() -> None:
    params = imbalanced_job(0.3)

    def peak(steps: int) -> int:
        sim = Simulator(params, 32, pacing=True)
        tracemalloc.start()
        sim.run(steps, 0)
        _, top = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return top

    short, long = peak(300), peak(3000)
    assert long < short * 1.2 + 64 * 1024, (short, long)


def test_contention_grows_with_leaves_and_load() -> None:
    model = FabricModel(gradient_bytes=1e9, nodes_per_leaf=4, oversubscription=4.0)
    rng = np.random.default_rng(0)
    one_leaf = Fabric(model, 4, rng)
    assert one_leaf.leaves == 1 and one_leaf.cross_fraction == 0.0
    times = [Fabric(model, n, rng).bucket_time() for n in (4, 8, 16, 64)]
    assert times == sorted(times) and times[-1] > 2 * times[0]
    loaded = Fabric(model, 16, rng)
    waits = np.full(loaded.ranks, 0.01)
    assert loaded.bucket_time(loaded.skew_load(waits)) == loaded.bucket_time()  # coupling off
    coupled = Fabric(FabricModel(**{**model.__dict__, "skew_coupling": 0.5}), 16, rng)
    small, large = (coupled.bucket_time(coupled.skew_load(np.full(16, w))) for w in (0.001, 0.05))
    assert coupled.bucket_time() < small < large
    # bounded: a wait beyond park_limit adds nothing more
    assert large == coupled.bucket_time(coupled.skew_load(np.full(16, 1.0)))


def test_params_files_and_overrides() -> None:
    assert "paper_table1" in bundled_params()
    params = load_params("paper_table1")
    assert params.nodes == (4, 8, 16, 32, 64)
    assert params.extra["paper"]["baseline_throughput"][-1] == 8200
    names = [name for name, _, _ in ablations(params)]
    assert names == ["no skew coupling", "pure straggler"]
    changed = params.with_overrides({"fabric.skew_coupling": 0.0, "steps": 10})
    assert changed.fabric.skew_coupling == 0.0 and changed.steps == 10
    assert changed.compute == params.compute
    with pytest.raises(ValueError, match="unknown fabric keys"):
        params_from_dict({"fabric": {"bandwith": 1}})
    with pytest.raises(ValueError, match="unknown parameter keys"):
        params_from_dict({"fabrik": {}})
    with pytest.raises(ValueError):
        params_from_dict({"pacing": {"gain": 5}})


def test_paper_table1_shape() -> None:
    """A short run of the calibrated set keeps the shape of the paper's Table 1."""
    params = load_params("paper_table1").with_overrides({"steps": 800, "warmup_steps": 200})
    result = compare(params, [4, 64])
    small, large = result.rows
    efficiency = (large.baseline.throughput / large.baseline.ranks) / (
        small.baseline.throughput / small.baseline.ranks
    )
    assert 0.4 < efficiency < 0.7  # paper: 0.50
    assert abs(small.throughput_gain) < 0.01  # paper: -0.6 %
    assert 0.04 < large.throughput_gain < 0.20  # paper: +11 %
    assert small.baseline.cv < 0.05 < large.baseline.cv  # paper: 0.02 -> 0.22
    assert large.paced.cv < large.baseline.cv  # paper: 0.22 -> 0.09
