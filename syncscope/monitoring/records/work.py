"""Recording rules of this area (promtool tests: deploy/prometheus/tests/work.test.yml): work
done and the energy it took."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import rate
from syncscope.monitoring.records.base import record
from syncscope.recorded import (
    CPU_ENERGY_RATE,
    ENERGY_PER_SAMPLE,
    ENERGY_PER_TOKEN,
    ENERGY_RATE,
    GPU_ENERGY_RATE,
    SAMPLES_PER_GPU,
    SAMPLES_RATE,
    TOKENS_PER_GPU,
    TOKENS_RATE,
)
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    """Samples and tokens per second over the job's ranks and per GPU (the mean over the ranks
    that report them); joules per second from the GPUs' counters, the nodes' CPU packages and
    both; joules per sample and per token wherever the job has both energy and work. Ranks that
    do not report work are in neither the sum nor the mean: no series, not zero."""
    samples, tokens = M.RANK_SAMPLES_TOTAL.name, M.RANK_TOKENS_TOTAL.name
    by_source = f"""
sum by (job) (
    label_replace({GPU_ENERGY_RATE}, "source", "gpu", "", "")
  or
    label_replace({CPU_ENERGY_RATE}, "source", "cpu", "", "")
)
"""
    return [
        record(SAMPLES_RATE, f"sum by (job) ({rate(cfg, samples)})"),
        record(SAMPLES_PER_GPU, f"avg by (job) ({rate(cfg, samples)})"),
        record(TOKENS_RATE, f"sum by (job) ({rate(cfg, tokens)})"),
        record(TOKENS_PER_GPU, f"avg by (job) ({rate(cfg, tokens)})"),
        record(GPU_ENERGY_RATE, f"sum by (job) ({rate(cfg, M.GPU_ENERGY_JOULES_TOTAL.name)})"),
        record(CPU_ENERGY_RATE, f"sum by (job) ({rate(cfg, M.NODE_CPU_ENERGY_JOULES_TOTAL.name)})"),
        # Each source once: a GPU-less job has only its CPUs, a host without RAPL only GPUs.
        record(ENERGY_RATE, by_source),
        record(ENERGY_PER_SAMPLE, f"{ENERGY_RATE}\n/\n  ({SAMPLES_RATE} > 0)\n"),
        record(ENERGY_PER_TOKEN, f"{ENERGY_RATE}\n/\n  ({TOKENS_RATE} > 0)\n"),
    ]
