"""Recording rules of this area (promtool tests: deploy/prometheus/tests/fabric.test.yml): bus
bandwidth, transfer per call, contention (paper §3.3) and the slow link."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import STEP_SECONDS_COUNT, rate, sel, younger_than
from syncscope.monitoring.records.base import record
from syncscope.recorded import (
    BUS_BANDWIDTH,
    CONTENTION,
    CONTENTION_COST,
    DDP_BUS_BANDWIDTH,
    LINK_CAPACITY,
    LINK_CAPACITY_RATIO,
    LINK_UTILIZATION,
    SKEW_RATIO,
    SLOWEST_LINK,
    STEPS_RATE,
    TRANSFER_INFLATION,
    TRANSFER_PER_CALL,
    TRANSFER_PER_STEP,
    WORLD_SIZE,
)
from syncscope.thresholds import Thresholds

# nccl-tests' bus-bandwidth factors (doc/PERFORMANCE.md there): the share of the data each
# rank must move over its slowest link, as a function of the group size n.
BUS_FACTORS = {
    "all_reduce": "2 * (n - 1) / n",
    "all_gather": "(n - 1) / n",
    "reduce_scatter": "(n - 1) / n",
    "all_to_all": "(n - 1) / n",
    "broadcast": "n / n",  # 1, written as a per-job vector so the join on job still applies
}
# DDP's gradient sync is exported as exposed time only (its transfer overlaps backward), so
# bytes / time would not be a bandwidth and per-call transfer would not be a transfer.
NOT_A_TRANSFER = "ddp_grad_sync"


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        _bus_bandwidth(cfg),
        *_contention_records(cfg),
        *_link_records(cfg),
    ]


def _bus_bandwidth(cfg: Thresholds) -> dict[str, Any]:
    # One rule for every op: a per-(job, op) factor vector joined on op drops the ops that
    # have no bus bandwidth (barrier, ddp_grad_sync) and keeps promtool's duplicate lint quiet.
    factors = "\n    or\n".join(
        f'      label_replace({factor.replace("n", WORLD_SIZE)}, "op", "{op}", "", "")'
        for op, factor in BUS_FACTORS.items()
    )
    ops = f'op=~"{"|".join(BUS_FACTORS)}"'
    return record(
        BUS_BANDWIDTH,
        f"""
  sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_BYTES_TOTAL.name, ops)})
/
  (
      sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_SECONDS_TOTAL.name, ops)})
    -
      sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_WAIT_SECONDS_TOTAL.name, ops)})
    > 0
  )
* on (job, op) group_left ()
  (
{factors}
  )
""",
    )


def _contention_records(cfg: Thresholds) -> list[dict[str, Any]]:
    no_ddp = f'op!="{NOT_A_TRANSFER}"'
    calls = sel(cfg, M.COLLECTIVE_CALLS_TOTAL.name, no_ddp)
    return [
        # Once every rank's series of the op and group cover a full window, as the DDP path's
        # transfer per step (records/sync.py): the first readings would be the baseline.
        record(
            TRANSFER_PER_CALL,
            f"""
  (
      sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_SECONDS_TOTAL.name, no_ddp)})
    -
      sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_WAIT_SECONDS_TOTAL.name, no_ddp)})
  )
/
  (sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_CALLS_TOTAL.name, no_ddp)}) > 0)
unless on (job, op, group)
  {younger_than(calls, "job, node, rank, op, group", cfg.windows.rate)}
""",
        ),
        # Transfer per call against its own 10th percentile over the baseline window, only
        # while arrival skew is low (the wait estimate absorbs too much with a straggler), and
        # the DDP path's transfer per step (which excludes waiting by construction).
        record(
            CONTENTION,
            f"""
  (
      {TRANSFER_PER_CALL}
    /
      (quantile_over_time(0.1, {TRANSFER_PER_CALL}[{cfg.windows.contention_baseline}]) > 0)
    and on (job)
      ({SKEW_RATIO} < {cfg.contention_max_skew_ratio})
  )
or
  label_replace(
    label_replace({TRANSFER_INFLATION}, "op", "{NOT_A_TRANSFER}", "", ""),
    "group", "ddp", "", ""
  )
""",
        ),
        # What that inflation costs each rank: the transfer per call beyond its baseline, times
        # the calls each rank makes per second (the job's calls over its world size: a group
        # not every rank is in reads lower, never higher). Seconds per second: a share of time.
        record(
            CONTENTION_COST,
            f"""
  (
      {TRANSFER_PER_CALL}
    -
      quantile_over_time(0.1, {TRANSFER_PER_CALL}[{cfg.windows.contention_baseline}])
  )
* sum by (job, op, group) ({rate(cfg, M.COLLECTIVE_CALLS_TOTAL.name, no_ddp)})
/ on (job) group_left ()
  {WORLD_SIZE}
""",
        ),
        # DDP's bus bandwidth (nccl-tests' all-reduce factor): gradient bytes per step over
        # the job's transfer per step, the exposed sync after the last rank arrives. Where
        # DDP overlaps part of the transfer with backward this reads high: a lower bound on
        # the transfer time, an upper bound on the bandwidth.
        record(
            DDP_BUS_BANDWIDTH,
            f"""
  (
      sum by (job) ({rate(cfg, M.COLLECTIVE_BYTES_TOTAL.name, f'op="{NOT_A_TRANSFER}"')})
    /
      (sum by (job) ({rate(cfg, STEP_SECONDS_COUNT)}) > 0)
  )
* on (job)
  (2 * ({WORLD_SIZE} - 1) / {WORLD_SIZE})
/ on (job)
  ({TRANSFER_PER_STEP} > 0)
""",
        ),
    ]


def _link_records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        # The slow link: what each node's link is known to carry (negotiated speed, shaping)
        # against the median node of the job, and how busy it is while the job transfers.
        # In a synchronous ring every node moves the same bytes in the same time, so the
        # bandwidth achieved is one figure for the job; a link known to carry less than its
        # peers', and near saturation while the job transfers, is where it is lost.
        record(
            LINK_CAPACITY,
            f"max by (job, node) ({sel(cfg, M.NODE_LINK_CAPACITY_BYTES_PER_SECOND.name)})",
        ),
        record(
            LINK_CAPACITY_RATIO,
            f"""
  {LINK_CAPACITY}
/ on (job) group_left ()
  (quantile by (job) (0.5, {LINK_CAPACITY}) > 0)
""",
        ),
        # Once an evaluation, where every exporter's read-back would read every node's.
        record(SLOWEST_LINK, f"bottomk by (job) (1, {LINK_CAPACITY_RATIO})"),
        record(
            LINK_UTILIZATION,
            f"""
  max by (job, node) ({rate(cfg, M.NODE_LINK_BYTES_TOTAL.name)})
/ on (job) group_left ()
  ({STEPS_RATE} * {TRANSFER_PER_STEP} > 0)
/
  ({LINK_CAPACITY} > 0)
""",
        ),
    ]
