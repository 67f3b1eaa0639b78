"""Recording rules of this area (promtool tests: deploy/prometheus/tests/sync.test.yml): the
job's phase shares, its transfer per step T and what it spends waiting beyond it (the
synchronization amplification, paper §3.3), each rank's lead, the arrival skew, the straggler
and the process group the job loses time in."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.promql import (
    STEP_SECONDS_COUNT,
    STEP_SECONDS_SUM,
    indent,
    rate,
    sel,
    younger_than,
)
from syncscope.monitoring.records.base import record
from syncscope.recorded import (
    COMM_EXPOSED_RATIO,
    GROUP_ISSUE_TO_COMPLETION,
    GROUP_NEXT_HOP,
    GROUP_WAIT,
    LEAD,
    PHASE_RATE,
    PHASE_RATIO,
    SKEW,
    SKEW_RATIO,
    STAGE_SKEW,
    STEP_MEAN,
    STRAGGLER_LAG,
    STRAGGLER_RATIO,
    SYNC_AMPLIFICATION,
    SYNC_PER_STEP,
    SYNC_PER_STEP_MIN,
    SYNC_PER_STEP_STAGE_MIN,
    TRANSFER_INFLATION,
    TRANSFER_NODE_MIN,
    TRANSFER_PER_STEP,
    TRANSFER_SAMPLED,
    TRANSFER_SAMPLING_GAP,
    WINDOW_FULL,
    WORLD_SIZE,
)
from syncscope.thresholds import Thresholds, duration_seconds
from syncscope.wire import BLOCKED, Phase

# The phase counter's series a rank's blocked time adds up, and pacing's of them.
BLOCKED_PHASES = f'phase=~"{"|".join(p.label for p in BLOCKED)}"'
PACING_PHASE = f'phase="{Phase.PACING.label}"'


def records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        window_full(cfg),
        *_phase_records(cfg),
        *_sampled_transfer_records(cfg),
        *_transfer_records(cfg),
        *_straggler_records(cfg),
        # Each rank's collective time per step in each group beyond the rank of the job that
        # spends least in that group's collectives, summed over the ranks, as a share of the
        # job's rank-time. A group label names a mesh dimension, so every dp group of a 2-D
        # job is one "dp". Issue-to-completion time: the overlap an async collective shares
        # with every rank cancels in the difference.
        record(GROUP_ISSUE_TO_COMPLETION, _group_wait(cfg)),
        # What does not cancel (a pipeline's receives, posted ahead, overlap its compute and
        # each other: 175 % of the interleaved job's rank-time) is bounded by the time the
        # ranks were blocked: where the groups' sum exceeds the job's exposed communication
        # over the same window, they share it in their proportions. Job-level series only:
        # the same bound per rank read every rank's rates twice more (the exporter bounds
        # each rank's own waits).
        record(
            GROUP_WAIT,
            f"""
  {GROUP_ISSUE_TO_COMPLETION}
* on (job) group_left ()
  clamp_max(
      sum by (job) ({SYNC_PER_STEP})
    / on (job)
      clamp_min(
          sum by (job) ({GROUP_ISSUE_TO_COMPLETION})
        * on (job)
          ({WORLD_SIZE} * {STEP_MEAN}),
        1e-09
      ),
    1
  )
""",
        ),
    ]


def window_full(cfg: Thresholds) -> dict[str, Any]:
    """The job's nodes reporting, recorded only while every rank of the job has a full straggler
    window of its own: the exporter received the first step of the latest rank to start on
    each node a window ago (an agent's first steps come in seconds after its attach: a compile,
    lazy init, its first flush, and its series start there). Before that a rank's rates cover
    the few scrapes since it appeared, with the job still settling: one node's ranks can read
    more blocked than another's, and the straggler's condition would name a rank. The
    straggler's chain, the amplification and SyncscopeStepTimeCVHigh are judged from here on,
    all alike: the straggler, with the shortest for:, still comes first
    and inhibits the others (judged from the same start, not the straggler a window later).
    Identity, not a count: a relaunched rank elsewhere has a window of its own to fill. And
    not before this Prometheus has scraped every node for a window: a node it began to scrape
    later (its first scrapes come seconds after its start; a node added to a running job; a
    Prometheus restarted) has rates over those scrapes only, whenever its ranks began. One
    series a node, no range: it sits first in the straggler group, and vmalert inlines it into
    the rates there rather than reading it back an evaluation late."""
    started = sel(cfg, M.RANKS_STARTED_TIMESTAMP_SECONDS.name)
    window = f"{duration_seconds(cfg.windows.straggler):g}"
    return record(
        WINDOW_FULL,
        f"""
  count by (job) ({started})
and on (job)
  (max by (job) ({started}) <= time() - {window})
unless on (job)
  ({started} unless {started} offset {window}s)
""",
    )


def _phase_records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        # Phases add up to the step, so each phase's share is its rate over the sum of all;
        # every rank's phases are read once.
        record(PHASE_RATE, f"sum by (job, phase) ({rate(cfg, M.PHASE_SECONDS_TOTAL.name)})"),
        record(
            PHASE_RATIO,
            f"{PHASE_RATE}\n/ ignoring (phase) group_left ()\n  sum by (job) ({PHASE_RATE})\n",
        ),
        record(COMM_EXPOSED_RATIO, f'sum without (phase) ({PHASE_RATIO}{{phase="comm_exposed"}})'),
    ]


def _sampled_transfer_records(cfg: Thresholds) -> list[dict[str, Any]]:
    return [
        # Job-wide truth from every node. At step k a rank's collective time is
        # d(r,k) = T(k) + W(r,k), transfer plus wait for the last rank; the job's T(k) is the
        # minimum over nodes of each node's minimum in step k. Each exporter keeps its minimum
        # at sampled steps in rings indexed alike everywhere (exporter/pooling.py); a slot
        # counts where every node of the job holds the same step in it: one step value held
        # by as many nodes as the job has. One count_values over the slots' steps, where a
        # min, a max and a count were three aggregations (vmalert computes this expression
        # twice an evaluation, here and inlined in the gap: engines.SAME_GROUP_RECORDS).
        record(
            TRANSFER_SAMPLED,
            f"""
  min by (job, stride, slot) ({sel(cfg, M.NODE_SAMPLED_TRANSFER_SECONDS.name)})
and on (job, stride, slot)
  (
      count_values by (job, stride, slot) ("step", {sel(cfg, M.NODE_SAMPLED_STEP.name)})
    == on (job) group_left ()
      count by (job) (count by (job, instance) ({sel(cfg, M.NODE_POOLED_STEPS_TOTAL.name)}))
  )
""",
        ),
        # The job's transfer per step, T. The smallest of the nodes' mean per-step minima over
        # the rate window has every step in it and no sampling noise, but reads high when the
        # last rank moves between nodes from step to step (E[min] < min E). The agreed samples
        # measure that gap: per evaluation, their mean minimum over nodes minus the smallest
        # node's mean over the same samples. The transfer's own variation, common to every
        # node, cancels in the difference (a control variate), so the gap, averaged over the
        # transfer window, is far steadier than the samples themselves. On one node, or with
        # a persistent straggler, the gap is 0 and T is exact. Every node holds every agreed
        # slot, so the gap is minus the smallest node's mean excess over the slots' minima:
        # one join with the agreed slots, where the mean of their minima and a filter by them
        # read them twice (and vmalert, inlining them, computed them twice more).
        # Only once every node's counters cover a full window: a node's first readings are
        # rates over its first scrapes, which read low, and the lowest reading of the job
        # becomes the contention baseline for the next hour: a steady job would read inflated.
        record(
            TRANSFER_NODE_MIN,
            f"""
  min by (job) (
      sum by (job, instance) ({rate(cfg, M.NODE_TRANSFER_SECONDS_TOTAL.name)})
    /
      (sum by (job, instance) ({rate(cfg, M.NODE_POOLED_STEPS_TOTAL.name)}) > 0)
  )
unless on (job)
  {younger_than(sel(cfg, M.NODE_POOLED_STEPS_TOTAL.name), "job, instance", cfg.windows.rate)}
""",
        ),
        record(
            TRANSFER_SAMPLING_GAP,
            f"""
0 - min by (job) (
  avg by (job, instance) (
      {sel(cfg, M.NODE_SAMPLED_TRANSFER_SECONDS.name)}
    - on (job, stride, slot) group_left ()
      {TRANSFER_SAMPLED}
  )
)
""",
        ),
    ]


def _transfer_records(cfg: Thresholds) -> list[dict[str, Any]]:
    w = cfg.windows
    return [
        record(
            TRANSFER_PER_STEP,
            f"""
  {TRANSFER_NODE_MIN}
+ on (job)
  (
      avg_over_time({TRANSFER_SAMPLING_GAP}[{w.transfer}])
    or
      0 * {TRANSFER_NODE_MIN}
  )
""",
        ),
        # Contention (paper §3.3: queueing on shared links) is the transfer inflated against
        # its own uncontended baseline: the transfer per step over its own 10th percentile over
        # the contention-baseline window. A share of
        # the step is not contention (a small model on a fast fabric has a large one), nor is
        # a link slow from the start (no uncontended baseline to beat: see the slow link).
        record(
            TRANSFER_INFLATION,
            f"""
  {TRANSFER_PER_STEP}
/
  (quantile_over_time(0.1, {TRANSFER_PER_STEP}[{w.contention_baseline}]) > 0)
""",
        ),
        # Rank-seconds spent waiting per rank-second of stepping: the synchronization-
        # amplification ratio (paper §3.3), job-wide, transient waits included: every rank's
        # collective time beyond the job's transfer, and the delay pacing held a rank back by
        # (time it no longer waits in the collective), over the ranks' step time.
        record(
            SYNC_AMPLIFICATION,
            f"""
clamp_min(
    (
        sum by (job) ({rate(cfg, M.COLLECTIVE_SECONDS_TOTAL.name)})
      +
        sum by (job) ({rate(cfg, M.PHASE_SECONDS_TOTAL.name, PACING_PHASE)})
      -
        {TRANSFER_PER_STEP} * on (job) sum by (job) ({rate(cfg, STEP_SECONDS_COUNT)})
    )
  /
    sum by (job) ({rate(cfg, STEP_SECONDS_SUM)}),
  0
)
and on (job)
  {WINDOW_FULL}
""",
        ),
    ]


def _straggler_records(cfg: Thresholds) -> list[dict[str, Any]]:
    w = cfg.windows
    return [
        # Each rank's time blocked per step (its exposed communication, and the delay pacing
        # held it back by: wire.BLOCKED) over the straggler window; the rank blocked least
        # waits for nobody persistently, and the others' lead over it is their persistent
        # skew. Differences of means carry no noise bias (a rolling minimum did). Blocked time,
        # not issue-to-completion time: an async collective (FSDP2's prefetched all-gathers)
        # overlaps compute until someone waits.
        # A pipeline's rank keeps its `stage` (the exporter's label on its phase counter;
        # absent for any other rank).
        record(
            SYNC_PER_STEP,
            f"""
  sum by (job, node, rank, stage) (
    {rate(cfg, M.PHASE_SECONDS_TOTAL.name, BLOCKED_PHASES, window=w.straggler)}
  )
/ on (job, node, rank) group_left ()
  (
    sum by (job, node, rank) ({rate(cfg, M.STEPS_TOTAL.name, window=w.straggler)})
    > 0
  )
and on (job)
  {WINDOW_FULL}
""",
        ),
        record(SYNC_PER_STEP_MIN, f"min by (job) ({SYNC_PER_STEP})"),
        # A pipeline's stages differ in work by design (the last computes the head and the
        # loss), so its ranks are compared with their own stage's (diagnosis.stage_root):
        # their lead is over their stage's least blocked rank. A job that is no pipeline is
        # one stage, labelled "": its ranks' lead is over the job's least blocked rank. One
        # read of the per-rank ratio, no join.
        record(SYNC_PER_STEP_STAGE_MIN, f"min by (job, stage) ({SYNC_PER_STEP})"),
        record(
            LEAD,
            f"{SYNC_PER_STEP} - on (job, stage) group_left () {SYNC_PER_STEP_STAGE_MIN}",
        ),
        # A stage's skew is its largest lead, the job's the largest of its stages'. Read from
        # the per-rank ratio, not from the leads: vmalert reads a per-rank record back an
        # evaluation late, and the straggler would wait one more for the leads.
        record(
            STAGE_SKEW,
            f"max by (job, stage) ({SYNC_PER_STEP}) - on (job, stage) {SYNC_PER_STEP_STAGE_MIN}",
        ),
        record(SKEW, f"max by (job) ({STAGE_SKEW})"),
        record(SKEW_RATIO, f"{SKEW} / {STEP_MEAN}"),
        # The straggler is the rank that arrives last, i.e. with the smallest lead (blocked
        # least: its lead is 0), in the stage whose skew is the job's; its lag is how much
        # later than the earliest rank of that stage it arrives, which is the job's skew.
        record(
            STRAGGLER_LAG,
            f"""
  0 * (
      {SYNC_PER_STEP} == on (job, stage) group_left () {SYNC_PER_STEP_STAGE_MIN}
    and on (job, stage)
      ({STAGE_SKEW} == on (job) group_left () {SKEW})
  )
+ on (job) group_left ()
  {SKEW}
""",
        ),
        record(STRAGGLER_RATIO, f"{STRAGGLER_LAG} / on (job) group_left () {STEP_MEAN}"),
        # Each process group's least blocked member (its lead the least; of ties, whichever):
        # whom its ranks wait for. Groups of one label are disjoint, so a group is its label
        # and lowest rank (the exporter's group_first); its members are the ranks with a
        # collective counter there. The lead's own labels (node, stage) come along from one
        # series per rank (topk: a rank relaunched elsewhere within the window has two), so the
        # join never matches many to many. Once an evaluation here, where every exporter
        # would otherwise ask for the least of each of its groups' members by their ranks.
        record(
            GROUP_NEXT_HOP,
            f"""
bottomk by (job, group, group_first) (
  1,
    group by (job, rank, group, group_first) (
      {sel(cfg, M.RANK_COLLECTIVE_SECONDS_TOTAL.name, 'group_first!=""')}
    )
  * on (job, rank) group_left (node, stage)
    topk by (job, rank) (1, {LEAD})
)
""",
        ),
    ]


def _group_wait(cfg: Thresholds) -> str:
    window = cfg.windows.straggler
    per_rank = f"""
  sum by (job, node, rank, group) (
    {rate(cfg, M.RANK_COLLECTIVE_SECONDS_TOTAL.name, window=window)}
  )
/ on (job, node, rank) group_left ()
  (sum by (job, node, rank) ({rate(cfg, M.STEPS_TOTAL.name, window=window)}) > 0)"""
    return f"""
  sum by (job, group) (
{indent(per_rank, 4)}
    - on (job, group) group_left ()
      min by (job, group) (
{indent(per_rank, 8)}
      )
  )
/ on (job) group_left ()
  ({WORLD_SIZE} * {STEP_MEAN} > 0)
"""
