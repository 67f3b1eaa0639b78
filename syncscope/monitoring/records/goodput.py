"""Recording rules of this area (promtool tests: deploy/prometheus/tests/goodput.test.yml):
goodput and badput over the job's whole life, and what the job costs (its trends over days:
trends.py)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import indent, sel
from syncscope.monitoring.records.base import record
from syncscope.recorded import (
    BADPUT_RATIO,
    BADPUT_SECONDS,
    COST_PER_HOUR,
    COST_PER_MILLION_SAMPLES,
    COST_PER_MILLION_TOKENS,
    GOODPUT,
    LOST_COST_PER_HOUR,
    RANK_SECONDS,
    SAMPLES_RATE,
    TOKENS_RATE,
    WORLD_SIZE,
)
from syncscope.thresholds import Thresholds


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [*_goodput_records(cfg), *_cost_records(cfg)]


def _goodput_records(cfg: Thresholds) -> list[dict[str, Any]]:
    """Goodput and badput over the job's whole life, across its restarts and checkpoints: the
    counters' values as they stand (no range, so a job of days costs one sample per series),
    over the rank-seconds since the job's earliest process start. Goodput is productive step
    time less the steps restarts ran again; badput by category: startup, checkpoint saves and
    loads, lost progress (the exporters' counters), data wait, synchronization wait (exposed
    communication) and pacing (the phase counters), and nothing running: the rest, not below
    0. Goodput and the shares add up to 1."""
    badput = M.NODE_BADPUT_SECONDS_TOTAL.name
    productive = f"sum by (job) ({sel(cfg, M.NODE_PRODUCTIVE_SECONDS_TOTAL.name)})"
    phases = sel(cfg, M.PHASE_SECONDS_TOTAL.name, 'phase=~"data|comm_exposed|pacing"')
    # The phases' counters read once, each phase named as its category.
    by_phase = f"sum by (job, phase) ({phases})"
    for phase, category in (
        ("data", "data_wait"),
        ("comm_exposed", "sync_wait"),
        ("pacing", "pacing"),
    ):
        by_phase = (
            f"label_replace(\n{indent(by_phase, 2)},\n"
            f'  "category", "{category}", "phase", "{phase}"\n)'
        )
    lost_only = f'category="{M.LOST_PROGRESS}"'
    lost = f"sum by (job) ({sel(cfg, badput, lost_only)})"
    rank_seconds = f"({RANK_SECONDS} > 0)"
    return [
        # World size x seconds since the earliest process start any exporter saw for the job.
        record(
            RANK_SECONDS,
            f"""
  {WORLD_SIZE}
* on (job)
  (time() - min by (job) ({sel(cfg, M.JOB_STARTED_TIMESTAMP_SECONDS.name)}))
""",
        ),
        record(
            BADPUT_SECONDS,
            f"""
  sum by (job, category) ({sel(cfg, badput)})
or
  sum by (job, category) (
{indent(by_phase, 4)}
  )
""",
        ),
        record(GOODPUT, f"\n  ({productive} - on (job) {lost})\n/ on (job)\n  {rank_seconds}\n"),
        record(
            BADPUT_RATIO,
            f"""
  {BADPUT_SECONDS}
/ on (job) group_left ()
  {rank_seconds}
or
  label_replace(
    clamp_min(
        (
            {RANK_SECONDS}
          - on (job) {productive}
          - on (job) sum by (job) ({BADPUT_SECONDS}{{category!="{M.LOST_PROGRESS}"}})
        )
      / on (job)
        {rank_seconds},
      0
    ),
    "category", "nothing_running", "", ""
  )
""",
        ),
    ]


def _cost_records(cfg: Thresholds) -> list[dict[str, Any]]:
    """What the job costs, where its exporters are given a GPU-hour's price: per hour (each
    node's price times its ranks, one GPU a rank), per million tokens and samples at the
    current rates, and per hour the share not going into goodput (1 - goodput) costs. No
    price, no series."""
    ranks = f"count by (job, node) ({sel(cfg, M.STEPS_TOTAL.name)})"
    price = sel(cfg, M.GPU_HOUR_PRICE.name)
    per_second = f"({COST_PER_HOUR} / 3600)"
    return [
        record(
            COST_PER_HOUR,
            f"""
sum by (job) (
    {price}
  * on (job, node)
    {ranks}
)
""",
        ),
        record(
            COST_PER_MILLION_TOKENS, f"\n  {per_second}\n/ on (job)\n  ({TOKENS_RATE} > 0)\n* 1e6\n"
        ),
        record(
            COST_PER_MILLION_SAMPLES,
            f"\n  {per_second}\n/ on (job)\n  ({SAMPLES_RATE} > 0)\n* 1e6\n",
        ),
        record(LOST_COST_PER_HOUR, f"\n  {COST_PER_HOUR}\n* on (job)\n  (1 - {GOODPUT})\n"),
    ]
