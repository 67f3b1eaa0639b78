"""The clock-free arrival estimator on synthetic durations with a known answer."""

from __future__ import annotations

import random

import pytest

from syncscope.arrival import ArrivalEstimator, collective_key

KEY = collective_key("ddp_grad_sync", "default_pg", 4 * 2**20)


def feed(
    est: ArrivalEstimator, late_rank: int | None, late_s: float, steps: int, noise_s: float = 0.001
) -> None:
    rng = random.Random(7)
    transfer = 0.004
    for step in range(steps):
        for rank in range(4):
            wait = 0.0 if (late_rank is None or rank == late_rank) else late_s
            est.observe(rank, [(KEY, transfer + wait + rng.uniform(0, noise_s), step)])


def test_steady_straggler_sets_the_baseline_for_everyone():
    est = ArrivalEstimator()
    feed(est, late_rank=2, late_s=0.030, steps=100)
    leads = {r: est.lead(r) for r in range(4)}
    assert min(leads, key=leads.get) == 2
    assert leads[2] < 0.001
    for r in (0, 1, 3):
        assert leads[r] == pytest.approx(0.030, abs=0.002)
    assert est.baseline(KEY) == pytest.approx(0.004, abs=0.0002)


def test_balanced_ranks_have_equal_small_leads():
    est = ArrivalEstimator()
    feed(est, late_rank=None, late_s=0.0, steps=100)
    leads = [est.lead(r) for r in range(4)]
    assert max(leads) - min(leads) < 0.0005


def test_lead_is_per_step_not_diluted_by_follow_up_calls():
    est = ArrivalEstimator()
    small = collective_key("broadcast", "default_pg", 4)
    for step in range(64):
        est.observe(0, [(KEY, 0.034, step), (small, 0.0001, step)])
        est.observe(1, [(KEY, 0.004, step), (small, 0.0001, step)])
    assert est.lead(0) == pytest.approx(0.030, abs=1e-6)


def test_external_baselines_merge_and_forget():
    est = ArrivalEstimator()
    est.observe("self", [(KEY, 0.034, 0)])
    assert est.lead("self") == 0.0  # alone, a rank cannot see a persistent wait
    est.merge_baselines({KEY: 0.004})
    assert est.lead("self") == pytest.approx(0.030)
    est.forget("self")
    assert est.lead("self") is None
