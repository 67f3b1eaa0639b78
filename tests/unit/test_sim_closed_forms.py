"""The simulator against closed forms: ring/tree all-reduce cost, order statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from syncscope.sim.compute import ComputeModel
from syncscope.sim.engine import Simulator
from syncscope.sim.fabric import Fabric, FabricModel
from syncscope.sim.params import SimParams
from syncscope.sim.stats import QuantileSketch, StreamingMoments, expected_max_normal

# E[max of n i.i.d. N(0, 1)] from the order-statistic tables (Harter 1961; n=2 is 1/sqrt(pi)).
KNOWN_EXPECTED_MAX = {
    2: 0.564190,
    3: 0.846284,
    4: 1.029375,
    5: 1.162964,
    10: 1.538753,
    20: 1.867475,
    50: 2.249073,
    100: 2.507594,
}


def ring_time(n: int, size: float, bandwidth: float, latency: float) -> float:
    return 2 * (n - 1) / n * size / bandwidth + 2 * (n - 1) * latency


@pytest.mark.parametrize("nodes", [1, 2, 3, 8, 64, 1000])
@pytest.mark.parametrize("size", [1e6, 4e8])
def test_step_time_is_compute_plus_ring_all_reduce_exactly(nodes: int, size: float) -> None:
    compute = ComputeModel(data_s=0.004, forward_s=0.03, backward_s=0.06, optimizer_s=0.002)
    fabric = FabricModel(gradient_bytes=size, nic_bandwidth_Bps=12.5e9, nic_latency_s=7e-6)
    summary = Simulator(SimParams(compute=compute, fabric=fabric), nodes).run(50, 0)
    expected = 0.096 + (ring_time(nodes, size, 12.5e9, 7e-6) if nodes > 1 else 0.0)
    assert summary.mean_step_s == pytest.approx(expected, rel=1e-12)
    assert summary.std_step_s == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("nodes", [2, 5, 16, 100])
def test_tree_and_auto_all_reduce_closed_forms(nodes: int) -> None:
    rng = np.random.default_rng(0)
    size, bw, lat = 3e8, 25e9, 2e-5
    tree = Fabric(
        FabricModel(gradient_bytes=size, algorithm="tree", nic_bandwidth_Bps=bw, nic_latency_s=lat),
        nodes,
        rng,
    )
    auto = Fabric(
        FabricModel(gradient_bytes=size, algorithm="auto", nic_bandwidth_Bps=bw, nic_latency_s=lat),
        nodes,
        rng,
    )
    tree_expected = 2 * size / bw + 2 * math.ceil(math.log2(nodes)) * lat
    assert tree.bucket_time() == pytest.approx(tree_expected, rel=1e-12)
    assert auto.bucket_time() == pytest.approx(
        min(tree_expected, ring_time(nodes, size, bw, lat)), rel=1e-12
    )


def test_hierarchical_intra_node_phases() -> None:
    g, size = 8, 1e9
    model = FabricModel(
        gradient_bytes=size,
        gpus_per_node=g,
        intra_bandwidth_Bps=3e11,
        intra_latency_s=3e-6,
        nic_bandwidth_Bps=2.5e10,
        nic_latency_s=1e-5,
    )
    fabric = Fabric(model, 4, np.random.default_rng(0))
    intra = 2 * ((g - 1) / g * size / 3e11 + (g - 1) * 3e-6)
    assert fabric.ranks == 32
    assert fabric.bucket_time() == pytest.approx(
        intra + ring_time(4, size, 2.5e10, 1e-5), rel=1e-12
    )


def test_buckets_overlap_backward() -> None:
    # Zero jitter: B buckets overlap the backward pass; only the last one (and any backlog) shows.
    compute = ComputeModel(forward_s=0.05, backward_s=0.10)
    for buckets in (1, 4, 10):
        fabric = FabricModel(
            gradient_bytes=1e8, nic_bandwidth_Bps=1e10, nic_latency_s=0.0, buckets=buckets
        )
        step = Simulator(SimParams(compute=compute, fabric=fabric), 8).run(10, 0).mean_step_s
        bucket = ring_time(8, 1e8 / buckets, 1e10, 0.0)
        # buckets are ready every 0.1/B s and each takes `bucket` s (< 0.1/B here): no backlog
        assert step == pytest.approx(0.15 + bucket, rel=1e-12)


@pytest.mark.parametrize("n", sorted(KNOWN_EXPECTED_MAX))
def test_expected_max_quadrature_matches_tables(n: int) -> None:
    assert expected_max_normal(n) == pytest.approx(KNOWN_EXPECTED_MAX[n], abs=2e-6)


@pytest.mark.parametrize(("ranks", "steps"), [(4, 40_000), (10, 30_000), (100, 20_000)])
def test_simulated_barrier_is_the_expected_max_within_one_percent(ranks: int, steps: int) -> None:
    """Synchronisation amplification from first principles: with i.i.d. normal compute times the
    step is the maximum of N of them, so its excess over the mean is E[max of N] sigma."""
    jitter, mean = 0.05, 0.1
    compute = ComputeModel(forward_s=mean / 3, backward_s=2 * mean / 3, jitter_cv=jitter)
    fabric = FabricModel(gradient_bytes=1e-3, nic_bandwidth_Bps=1e12, nic_latency_s=0.0)
    summary = Simulator(SimParams(compute=compute, fabric=fabric), ranks, seed=7).run(steps, 0)
    comm = ring_time(ranks, 1e-3, 1e12, 0.0)
    excess_in_sigmas = (summary.mean_step_s - comm - mean) / (mean * jitter)
    assert excess_in_sigmas == pytest.approx(
        KNOWN_EXPECTED_MAX.get(ranks, expected_max_normal(ranks)), rel=0.01
    )


def test_streaming_moments_match_numpy() -> None:
    rng = np.random.default_rng(3)
    data = rng.gamma(2.0, 0.05, 10_000)
    moments, sketch = StreamingMoments(), QuantileSketch()
    for block in np.array_split(data, 37):
        moments.add_array(block)
        sketch.add_array(block)
    assert moments.mean == pytest.approx(data.mean(), rel=1e-12)
    assert moments.std == pytest.approx(data.std(ddof=1), rel=1e-10)
    assert moments.cv == pytest.approx(data.std(ddof=1) / data.mean(), rel=1e-10)
    assert sketch.quantile(0.99) == pytest.approx(np.quantile(data, 0.99), rel=0.01)
    assert sketch.quantile(0.5) == pytest.approx(np.median(data), rel=0.01)
