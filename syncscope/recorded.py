"""The names of the series syncscope's recording rules record, declared once.

The rules (syncscope.monitoring.records) record them, the dashboards read them, and the exporter
reads some back from Prometheus (syncscope.exporter.jobwide): a name lives here so that none of
those has to import another for it. Each name is `level:metric:operations`, named by what the
rule reads: `level` the labels it keeps; `metric` the metric it reads (`_total` dropped on a
rate; a label it selects written in, `phase_comm_exposed_seconds` for
`phase_seconds{phase="comm_exposed"}`; `a_per_b` for a ratio of two), or the earlier record it
is built from, and a name of its own only for a quantity of several inputs (goodput;
`phase_blocked_seconds`, the phases in which a rank is held at synchronisation:
syncscope.wire.BLOCKED), never one an exported metric has; `operations` outermost first, a sum
of rates just `rate`. The window is not in the names (it is configurable, and dashboards must
not change when a deployment picks another).

A renamed series is recorded under its old name too for one release (DEPRECATED_ALIASES).
"""

from __future__ import annotations

WORLD_SIZE = "job:syncscope_world_size:max"
RANKS_REPORTING = "job:syncscope_rank_last_report_timestamp_seconds:count"
STEPS_RATE = "job:syncscope_steps:avg_rate"
STEP_MEAN = "job:syncscope_step_duration_seconds:mean"
STEP_BUCKET_RATE = "job_le:syncscope_step_duration_seconds_bucket:rate"
STEP_QUANTILE = "job:syncscope_step_duration_seconds:histogram_quantile"
STEP_OUTLIER_QUANTILE = "job:syncscope_step_duration_seconds:outlier_quantile"
STEP_RATIO_BUCKET_RATE = "job_le:syncscope_step_duration_ratio_bucket:rate"
STEP_JITTER = "job:syncscope_step_duration_ratio:histogram_quantile"
# The band of step time around each rank's median that the jitter rule records.
JITTER_QUANTILES = (0.1, 0.9)
STEP_CV = "job:syncscope_step_time_cv:max"
PHASE_RATE = "job_phase:syncscope_phase_seconds:rate"
PHASE_RATIO = "job_phase:syncscope_phase_seconds:ratio"
COMM_EXPOSED_RATIO = "job:syncscope_phase_comm_exposed_seconds:ratio"
SYNC_AMPLIFICATION = "job:syncscope_sync_amplification:ratio"
TRANSFER_SAMPLED = "job_stride_slot:syncscope_node_sampled_transfer_seconds:min"
TRANSFER_NODE_MIN = "job:syncscope_node_transfer_seconds_per_step:min"
TRANSFER_SAMPLING_GAP = "job:syncscope_node_sampled_transfer_seconds:gap_to_node_min"
TRANSFER_PER_STEP = "job:syncscope_collective_transfer_seconds_per_step:min"
TRANSFER_INFLATION = "job:syncscope_collective_transfer_seconds_per_step:ratio_to_baseline"
DDP_BUS_BANDWIDTH = "job:syncscope_ddp_bus_bandwidth_bytes_per_second:ratio"
LINK_CAPACITY = "job_node:syncscope_node_link_capacity_bytes_per_second:max"
LINK_CAPACITY_RATIO = "job_node:syncscope_node_link_capacity_bytes_per_second:ratio_to_median"
# The job's node whose link carries least against the median node's, and that ratio: one series
# a job, what every exporter's read-back needs of the links.
SLOWEST_LINK = "job_node:syncscope_node_link_capacity_bytes_per_second:bottomk_ratio_to_median"
LINK_UTILIZATION = "job_node:syncscope_link_utilization_while_transferring:ratio"
# Job-wide verdicts are judged over full windows only: the job's nodes reporting, recorded only
# while every node's latest rank started reporting steps a straggler window ago and every
# node has been scraped since.
WINDOW_FULL = "job:syncscope_ranks_started_timestamp_seconds:count_full_window"
SYNC_PER_STEP = "job_rank:syncscope_phase_blocked_seconds_per_step:ratio"
SYNC_PER_STEP_MIN = "job:syncscope_phase_blocked_seconds_per_step:min"
SYNC_PER_STEP_STAGE_MIN = "job_stage:syncscope_phase_blocked_seconds_per_step:min"
# Job-wide: each rank's lead, its time blocked per step (in collectives, and held back by pacing
# for the rank it waits for) beyond the rank of the job blocked least, a pipeline's rank's
# beyond the least blocked rank of its stage (not the exporter's node-local gauge
# syncscope_arrival_lead_seconds); the skew, the largest lead; and the skew as a share of the
# mean step.
LEAD = "job_rank:syncscope_phase_blocked_seconds_per_step:minus_job_min"
STAGE_SKEW = "job_stage:syncscope_phase_blocked_seconds_per_step:max_minus_min"
SKEW = "job:syncscope_phase_blocked_seconds_per_step:max_minus_min"
SKEW_RATIO = "job:syncscope_phase_blocked_seconds_per_step:ratio_to_step_mean_max_minus_min"
STRAGGLER_LAG = "job_rank:syncscope_straggler_lag_seconds:argmin_lead"
# Job-wide, per process group (its label and lowest rank, group_first): the member with the
# least lead and that lead, whom the group's ranks wait for (the wait chain's next hop). An
# exporter reads one series per group its ranks are in, however many members the group has.
GROUP_NEXT_HOP = "job_group:syncscope_phase_blocked_seconds_per_step:bottomk_lead"
STRAGGLER_RATIO = "job_rank:syncscope_straggler_lag_step:ratio"
# Job-wide, per process group (its label: dp, tp, pp, shard, ...): the job's rank-time spent in
# that group's collectives beyond the rank there that spends least: which group it loses time in.
# Issue to completion (the first), then bounded by the time the ranks were blocked (the second).
GROUP_ISSUE_TO_COMPLETION = "job_group:syncscope_rank_collective_seconds_beyond_least:unbounded"
GROUP_WAIT = "job_group:syncscope_rank_collective_seconds_beyond_least:ratio"
BUS_BANDWIDTH = "job_op_group:syncscope_collective_bus_bandwidth_bytes_per_second:ratio"
TRANSFER_PER_CALL = "job_op_group:syncscope_collective_transfer_seconds:per_call"
CONTENTION = "job_op_group:syncscope_fabric_contention:index"
# What the transfer beyond that baseline costs: the share of each rank's time (per second of
# wall time, averaged over the job's ranks) that goes to it. SyncscopeFabricContention fires
# only where it reaches the alert's `min_cost_share` (thresholds.json): a tiny, rare call (a
# flag broadcast) can double its transfer and cost the job nothing.
CONTENTION_COST = "job_op_group:syncscope_fabric_contention_cost:ratio"
PACING_ACTIVE = "job:syncscope_pacing_active:sum"
PACING_RATIO = "job:syncscope_pacing_delay:ratio"
LOCALITY_FAULT = "job_rank_fault:syncscope_gpu_locality:bool"
# Work and energy (syncscope.monitoring.records.work): samples and tokens per second over the
# job's ranks (sum) and per GPU (mean over the ranks that report them), the job's energy per
# second by source and in all, and energy per unit of work.
SAMPLES_RATE = "job:syncscope_rank_samples:rate"
SAMPLES_PER_GPU = "job:syncscope_rank_samples:avg_rate"
TOKENS_RATE = "job:syncscope_rank_tokens:rate"
TOKENS_PER_GPU = "job:syncscope_rank_tokens:avg_rate"
GPU_ENERGY_RATE = "job:syncscope_gpu_energy_joules:rate"
CPU_ENERGY_RATE = "job:syncscope_node_cpu_energy_joules:rate"
ENERGY_RATE = "job:syncscope_energy_joules:rate"
ENERGY_PER_SAMPLE = "job:syncscope_energy_joules_per_sample:ratio"
ENERGY_PER_TOKEN = "job:syncscope_energy_joules_per_token:ratio"
# Goodput over the job's whole life, across restarts (syncscope.monitoring.records.goodput),
# from counters the exporters keep (and keep across their own restarts with a state file): the
# rank-seconds since the job's earliest process start (world size x elapsed), badput by
# category in rank-seconds, goodput and every category's share of those rank-seconds.
RANK_SECONDS = "job:syncscope_rank_seconds:since_start"
BADPUT_SECONDS = "job_category:syncscope_badput_seconds:sum"
GOODPUT = "job:syncscope_goodput:ratio"
BADPUT_RATIO = "job_category:syncscope_badput:ratio"
# Cost, where exporters are given a GPU-hour's price (--price-per-gpu-hour): what the job's
# GPUs cost per hour (each node's price x its ranks, one GPU a rank), per million tokens and
# per million samples at the current rates, and per hour of it not going into goodput.
COST_PER_HOUR = "job:syncscope_cost_per_hour:sum"
COST_PER_MILLION_TOKENS = "job:syncscope_cost_per_million_tokens:ratio"
COST_PER_MILLION_SAMPLES = "job:syncscope_cost_per_million_samples:ratio"
LOST_COST_PER_HOUR = "job:syncscope_lost_cost_per_hour:product"
# Trends over days, against the job's own first days ("runtime variance grows", "re-runs
# increase"): the job's restarts so far, and per day its restarts, its step-time CV and its
# throughput per GPU (samples, and steps where samples are not known).
RESTARTS = "job:syncscope_node_restarts:sum"
RESTARTS_PER_DAY = "job:syncscope_node_restarts:increase_sum"
STEP_CV_PER_DAY = "job:syncscope_step_time_cv:avg_over_time_max"
SAMPLES_PER_GPU_PER_DAY = "job:syncscope_rank_samples:avg_over_time_avg_rate"
STEPS_RATE_PER_DAY = "job:syncscope_steps:avg_over_time_avg_rate"

# Renamed in 0.1 to be named by what the rules read (old name -> new): each old name is still
# recorded, as a copy of the new series, for one release by the rule group
# syncscope.deprecated-aliases, so that dashboards, queries and exporters of the release before
# keep working; nothing here reads them, and the next release drops the group. A deployment that
# reads no old name can drop it now: the per-rank aliases cost two series per rank.
DEPRECATED_ALIASES: dict[str, str] = {
    "job:syncscope_ranks_reporting:count": RANKS_REPORTING,
    "job:syncscope_steps:rate": STEPS_RATE,
    "job:syncscope_comm_exposed:ratio": COMM_EXPOSED_RATIO,
    "job_stride_slot:syncscope_sampled_transfer_seconds:min": TRANSFER_SAMPLED,
    "job:syncscope_sampled_transfer_seconds:gap_to_node_min": TRANSFER_SAMPLING_GAP,
    "job_node:syncscope_link_capacity_bytes_per_second:max": LINK_CAPACITY,
    "job_node:syncscope_link_capacity:ratio_to_median": LINK_CAPACITY_RATIO,
    "job_rank:syncscope_collective_seconds_per_step:ratio": SYNC_PER_STEP,
    "job:syncscope_collective_seconds_per_step:min": SYNC_PER_STEP_MIN,
    "job_rank:syncscope_arrival_lead_seconds:avg": LEAD,
    "job:syncscope_arrival_lead_seconds:max_minus_min": SKEW,
    "job:syncscope_arrival_skew_step:ratio": SKEW_RATIO,
    "job_group:syncscope_collective_seconds_beyond_least:ratio": GROUP_WAIT,
    "job_op_group:syncscope_collective_bus_bandwidth_bytes_per_second:rate": BUS_BANDWIDTH,
    "job:syncscope_restarts:increase1d": RESTARTS_PER_DAY,
    "job:syncscope_step_time_cv:avg_over_1d": STEP_CV_PER_DAY,
    "job:syncscope_rank_samples:avg_rate_avg_over_1d": SAMPLES_PER_GPU_PER_DAY,
    "job:syncscope_steps:rate_avg_over_1d": STEPS_RATE_PER_DAY,
    # The gate reads each node's latest rank start, not every rank's counter
    # (the old series counted ranks, the new one nodes).
    "job:syncscope_steps_total:count_full_window": WINDOW_FULL,
}
