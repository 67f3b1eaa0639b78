"""Every metric family the exporter emits, and the foreign ones its rules read, declared once.

The exporter's collectors build their families from these specs; deploy/metrics-contract.txt
(`contract_text`), the README's metric table (`markdown_table`), the Prometheus rules and the
Grafana dashboards are generated from them. Stdlib only: importing the catalog needs neither
prometheus_client nor the exporter's dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass

from syncscope import recorded

# Steps every rolling figure looks back over: the step-time CV, phase shares, medians and the
# diagnosis (the exporter's default window). Metric help, rules and the status page quote it.
STEP_WINDOW = 100

TYPES = ("counter", "gauge", "histogram", "info")
CONDITIONS = (
    "always",
    "gpu",
    "gpu_fault",
    "pacing",
    "straggler",
    "sampled",
    "link",
    "rejections",
    "process",
    "prometheus",
    "work",
    "rapl",
    "verdict",
    "price",
    "phase_sampling",
)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family as exposed: what Prometheus, rules and dashboards can rely on."""

    name: str  # the family as exposed; counters INCLUDE the _total suffix
    type: str  # one of TYPES; "info" is a gauge whose value is 1
    help: str
    labels: tuple[str, ...]  # label names the exporter sets (not instance/job added by Prometheus)
    condition: str  # one of CONDITIONS: when the family has series (see CONTRACT_HEADER)
    unit: str = ""  # base unit, also the name's last word before _total: "seconds", "bytes", ...

    @property
    def family(self) -> str:
        """The name without a trailing "_total" (what CounterMetricFamily takes)."""
        return self.name.removesuffix("_total")


@dataclass(frozen=True)
class Section:
    """A group of families, headed by a comment line in the contract file."""

    title: str
    metrics: tuple[MetricSpec, ...]


@dataclass(frozen=True)
class ClockEventReason:
    """One bit of NVML's clocks-event ("throttle") reasons mask, as the agent reports it."""

    bit: int
    short: str  # as the metric's help lists it
    words: str  # as the diagnosis and the status page say it
    # The GPU is being slowed down, as opposed to idle (0x1), application clocks (0x2), sync
    # boost (0x10) or display clocks (0x100), none of which explains a slow rank.
    slows: bool


CLOCK_EVENT_REASONS = (
    ClockEventReason(0x1, "GPU idle", "GPU idle", slows=False),
    ClockEventReason(0x4, "SW power cap", "software power cap", slows=True),
    ClockEventReason(0x8, "HW slowdown", "hardware slowdown", slows=True),
    ClockEventReason(0x20, "SW thermal", "software thermal slowdown", slows=True),
    ClockEventReason(0x40, "HW thermal", "hardware thermal slowdown", slows=True),
    ClockEventReason(0x80, "power brake", "power brake", slows=True),
)

# A rank's series name its node (the hostname its agent reports), so a page names where it is.
RANK = ("job", "node", "rank", "local_rank")
# What every rank of a node shares or sums to is exposed once per node (series per
# rank, and what the rules re-read every evaluation, fall 8× on an 8-GPU node).
NODE = ("job", "node")
COLLECTIVE = (*NODE, "op", "group")
# Every GPU family is GPU_PREFIX + the topology key it reports (a counter: + "_total").
GPU_PREFIX = "syncscope_gpu_"


def _rank(
    name: str, type_: str, help_: str, unit: str = "", condition: str = "always"
) -> MetricSpec:
    return MetricSpec(name, type_, help_, RANK, condition, unit)


def _gpu(key: str, help_: str, unit: str = "") -> MetricSpec:
    return MetricSpec(GPU_PREFIX + key, "gauge", help_, RANK, "gpu", unit)


def _gpu_fault(key: str, help_: str) -> MetricSpec:
    """A GPU gauge with a series only where it is non-zero (a fault's code or flag)."""
    return MetricSpec(GPU_PREFIX + key, "gauge", help_, RANK, "gpu_fault")


def _process(name: str, type_: str, help_: str, unit: str = "") -> MetricSpec:
    return MetricSpec(name, type_, help_, (), "process", unit)


# -- per node: steps; per rank: steps and phases
STEP_DURATION_SECONDS = MetricSpec(
    "syncscope_step_duration_seconds",
    "histogram",
    "Training step wall time, every step of every rank on the node.",
    NODE,
    "always",
    "seconds",
)
STEP_DURATION_RATIO = MetricSpec(
    "syncscope_step_duration_ratio",
    "histogram",
    "Each step's wall time over its rank's median step (of the last "
    f"{STEP_WINDOW} steps), every step of every rank on the node: jitter at any step length.",
    NODE,
    "always",
    "ratio",
)
STEPS_TOTAL = _rank("syncscope_steps_total", "counter", "Training steps completed.")
PHASE_SECONDS_TOTAL = MetricSpec(
    "syncscope_phase_seconds_total",
    "counter",
    "Time spent per step phase; phases add up to step time. `stage`: a pipeline's rank's stage, "
    "its place in the process group its point-to-point ops run in (empty, so absent, for any "
    f"other rank); the lead rule compares a rank with the ranks of its own stage ({recorded.LEAD}).",
    (*RANK, "phase", "stage"),
    "always",
    "seconds",
)
PHASE_SAMPLING_EVERY = _rank(
    "syncscope_phase_sampling_every",
    "gauge",
    "N where the rank times its phases in 1 step of N (phase sampling, for steps of a few ms); "
    "the other steps' phases are the last timed step's shares of their own time. No series "
    "where every step is timed.",
    condition="phase_sampling",
)
# -- per node: collectives, summed over the node's ranks; per rank: collective time
COLLECTIVE_CALLS_TOTAL = MetricSpec(
    "syncscope_collective_calls_total",
    "counter",
    "Collective calls, summed over the node's ranks.",
    COLLECTIVE,
    "always",
)
COLLECTIVE_SECONDS_TOTAL = MetricSpec(
    "syncscope_collective_seconds_total",
    "counter",
    "Collective time, entry to exit, summed over the node's ranks.",
    COLLECTIVE,
    "always",
    "seconds",
)
COLLECTIVE_BYTES_TOTAL = MetricSpec(
    "syncscope_collective_bytes_total",
    "counter",
    "Bytes moved by collectives, summed over the node's ranks.",
    COLLECTIVE,
    "always",
    "bytes",
)
COLLECTIVE_WAIT_SECONDS_TOTAL = MetricSpec(
    "syncscope_collective_wait_seconds_total",
    "counter",
    "Part of collective time spent waiting for the last peer, summed over the node's ranks.",
    COLLECTIVE,
    "always",
    "seconds",
)
RANK_COLLECTIVE_SECONDS_TOTAL = MetricSpec(
    "syncscope_rank_collective_seconds_total",
    "counter",
    "Collective time on this rank, issue to completion, every op, per process group (its "
    "label: the mesh dimension it spans; group_first: its lowest global rank, which tells "
    "apart the groups of one label; empty where the agent did not report its ranks).",
    (*RANK, "group", "group_first"),
    "always",
    "seconds",
)
ARRIVAL_LEAD_SECONDS = _rank(
    "syncscope_arrival_lead_seconds",
    "gauge",
    "How early this rank arrives at collectives, per step, relative to the rank on this node "
    "that waits least (the exporter's own measurement, mean of the last 64 steps). Job-wide: "
    f"the recording rule {recorded.LEAD}.",
    "seconds",
)
STEP_TIME_CV = _rank(
    "syncscope_step_time_cv",
    "gauge",
    f"Coefficient of variation of step time over the last {STEP_WINDOW} steps.",
)
# -- per rank: liveness and transport
WORLD_SIZE = MetricSpec(
    "syncscope_world_size", "gauge", "World size the node's ranks report.", NODE, "always"
)
RANK_LAST_REPORT_TIMESTAMP_SECONDS = _rank(
    "syncscope_rank_last_report_timestamp_seconds",
    "gauge",
    "Unix time of the rank's last report.",
    "seconds",
)
AGENT_RECORDS_DROPPED_TOTAL = _rank(
    "syncscope_agent_records_dropped_total",
    "counter",
    "Records the rank's agent could not deliver.",
)
# -- per rank: work done (agent/step_work.py says how a step's work is known)
RANK_SAMPLES_TOTAL = _rank(
    "syncscope_rank_samples_total",
    "counter",
    "Samples this rank processed in its training steps, as the user set them or as the "
    "model's inputs show (their leading dimension); absent where neither says.",
    condition="work",
)
RANK_TOKENS_TOTAL = _rank(
    "syncscope_rank_tokens_total",
    "counter",
    "Tokens this rank processed in its training steps, as the user set them or as the "
    "model's token-id inputs show (batch x sequence length, padding included).",
    condition="work",
)
# -- per rank: pacing controller
PACING_ACTIVE = _rank(
    "syncscope_pacing_active",
    "gauge",
    "1 while the pacing controller is engaged.",
    condition="pacing",
)
PACING_DELAY_SECONDS_TOTAL = _rank(
    "syncscope_pacing_delay_seconds_total",
    "counter",
    "Delay inserted by pacing.",
    "seconds",
    "pacing",
)
PACING_CURRENT_DELAY_SECONDS = _rank(
    "syncscope_pacing_current_delay_seconds",
    "gauge",
    "Delay pacing inserts before each iteration now.",
    "seconds",
    "pacing",
)
PACING_THRESHOLD_SECONDS = _rank(
    "syncscope_pacing_threshold_seconds",
    "gauge",
    "Current adaptive engage threshold.",
    "seconds",
    "pacing",
)
PACING_ENGAGEMENTS_TOTAL = _rank(
    "syncscope_pacing_engagements_total", "counter", "Times pacing engaged.", condition="pacing"
)
# -- per rank: GPU topology and state
# What a GPU's placement and capability are does not change while it runs: labels of its info
# series, not a gauge each (three of those were 3 series per rank). Its faults against them are
# GPU_LOCALITY_FAULT's, written only where a GPU has one.
GPU_INFO = MetricSpec(
    "syncscope_gpu_info",
    "info",
    "The rank's GPU, its nearest NIC, the NUMA nodes the process may run on, and the PCIe "
    "link width and generation the GPU and slot support (value 1).",
    (
        *RANK,
        "gpu_uuid",
        "pci_bus_id",
        "name",
        "numa_node",
        "process_numa_nodes",
        "nic",
        "nic_distance",
        "pcie_link_max_width",
        "pcie_link_max_generation",
    ),
    "gpu",
)
GPU_LOCALITY_FAULT = MetricSpec(
    GPU_PREFIX + "locality_fault",
    "gauge",
    "1 for each locality fault the rank's GPU has (absent while it has none): fault "
    "pcie_width or pcie_generation, the link under load below what the GPU and slot support; "
    "numa_mismatch, the process may not run on the GPU's NUMA node.",
    (*RANK, "fault"),
    "gpu",
)
GPU_PCIE_LINK_WIDTH = _gpu("pcie_link_width", "Current PCIe link width (lanes).")
GPU_PCIE_LINK_GENERATION = _gpu(
    "pcie_link_generation", "Current PCIe link generation, sampled while the GPU is busy."
)
GPU_NVLINK_ACTIVE_LINKS = _gpu(
    "nvlink_active_links", "NVLink links up (absent where NVML reports NVLink as not supported)."
)
GPU_SM_CLOCK_HERTZ = _gpu("sm_clock_hertz", "Current SM clock.", "hertz")
GPU_THROTTLE_REASONS = _gpu(
    "throttle_reasons",
    "NVML clocks-event reasons bitmask (0 = none; "
    + ", ".join(f"{r.bit:#x} {r.short}" for r in CLOCK_EVENT_REASONS)
    + ").",
)
GPU_TEMPERATURE_CELSIUS = _gpu("temperature_celsius", "GPU core temperature.", "celsius")
GPU_POWER_WATTS = _gpu("power_watts", "GPU board power draw.", "watts")
GPU_ENERGY_JOULES_TOTAL = MetricSpec(
    GPU_PREFIX + "energy_joules_total",
    "counter",
    "Energy the rank's GPU used since its driver loaded (NVML total energy; absent where NVML "
    "has no such counter).",
    RANK,
    "gpu",
    "joules",
)
GPU_XID_ERRORS_TOTAL = MetricSpec(
    GPU_PREFIX + "xid_errors_total",
    "counter",
    "XID critical-error events NVML delivered for the rank's GPU since its agent started "
    "watching (absent where NVML cannot deliver them).",
    RANK,
    "gpu",
)
GPU_LAST_XID = _gpu_fault(
    "last_xid",
    "The last XID code NVML delivered for the rank's GPU since its agent started watching "
    "(as DCGM_FI_DEV_XID_ERRORS; absent while none has come, and where NVML cannot deliver "
    "them: xid_errors_total tells which).",
)
GPU_ECC_UNCORRECTED_ERRORS_TOTAL = MetricSpec(
    GPU_PREFIX + "ecc_uncorrected_errors_total",
    "counter",
    "Uncorrected ECC memory errors on the rank's GPU since its driver loaded (NVML volatile "
    "count; absent where ECC is off or not supported).",
    RANK,
    "gpu",
)
GPU_ROW_REMAP_PENDING = _gpu_fault(
    "row_remap_pending",
    "1 while a memory row remapping waits for a GPU reset (Ampere and later; absent while "
    "none waits, and before Ampere).",
)
GPU_ROW_REMAP_FAILURE = _gpu_fault(
    "row_remap_failure",
    "1 if a memory row remapping failed on the rank's GPU (Ampere and later; absent while "
    "none has, and before Ampere).",
)
# -- per exporter: local diagnosis
DIAGNOSIS = MetricSpec(
    "syncscope_diagnosis",
    "gauge",
    "Failure-mode score 0..1 (paper §3.3).",
    ("job", "mode"),
    "always",
)
STRAGGLER_CAUSE = MetricSpec(
    "syncscope_straggler_cause",
    "gauge",
    "1 for the named straggler and its cause.",
    ("job", "node", "rank", "cause"),
    "straggler",
)
VICTIM_WAIT_SECONDS = MetricSpec(
    "syncscope_victim_wait_seconds",
    "gauge",
    f"While a straggler is named: per step over its last {STEP_WINDOW} steps, how long a rank here waits "
    "in the group it waits in most, for the rank it waits for there (waits_for; empty: a rank this exporter does not "
    "see). Following waits_for from any victim leads to the straggler.",
    ("job", "node", "rank", "group", "waits_for"),
    "straggler",
)
JOB_VERDICT = MetricSpec(
    "syncscope_job_verdict",
    "gauge",
    "1 while this exporter's diagnosis finds the job losing time (a failure mode, or throughput "
    "per GPU fallen below its own baseline), by what: verdict coupling (a straggler slowed by "
    "its own work, synchronization amplification, runtime jitter, a fall with no fault found) "
    "or infrastructure (a health check failed: a throttled GPU, a PCIe link below its maximum, "
    "a NUMA mismatch, XID or ECC errors, a slow link, a contended fabric); hardware healthy "
    "(every check passed), unknown (some could not be made: no GPU telemetry) or unhealthy. "
    "Evidence: /v1/state.",
    ("job", "verdict", "hardware"),
    "verdict",
)
ARRIVAL_SKEW_SECONDS = MetricSpec(
    "syncscope_arrival_skew_seconds",
    "gauge",
    "Max minus min arrival lead across this node's ranks.",
    ("job",),
    "always",
    "seconds",
)
# Per-step pooling of the node's ranks (exporter/pooling.py): Prometheus takes the minimum over
# nodes of transfer / pooled steps as the job's transfer per step (the job-wide rules).
NODE_POOLED_STEPS_TOTAL = MetricSpec(
    "syncscope_node_pooled_steps_total",
    "counter",
    "Steps that every rank reporting to this exporter delivered, pooled step by step.",
    ("job",),
    "always",
)
NODE_TRANSFER_SECONDS_TOTAL = MetricSpec(
    "syncscope_node_transfer_seconds_total",
    "counter",
    "Sum over pooled steps of the smallest collective time of any rank here in that step "
    "(the transfer, plus what all ranks here wait for ranks elsewhere).",
    ("job",),
    "always",
    "seconds",
)
# The same minimum at sampled steps (exporter/pooling.py's rings): Prometheus takes the minimum
# over nodes per slot where every node holds the same step, the job's transfer in that step.
NODE_SAMPLED_STEP = MetricSpec(
    "syncscope_node_sampled_step",
    "gauge",
    "The step held in this ring slot (sampled every `stride` steps, slot = step / stride mod "
    "slots, alike on every exporter).",
    ("job", "stride", "slot"),
    "sampled",
)
NODE_SAMPLED_TRANSFER_SECONDS = MetricSpec(
    "syncscope_node_sampled_transfer_seconds",
    "gauge",
    "The smallest collective time of any rank here in the step this slot holds.",
    ("job", "stride", "slot"),
    "sampled",
    "seconds",
)
# The network link of each node's ranks (agent/link.py), for the slow-link rules.
NODE_LINK_CAPACITY_BYTES_PER_SECOND = MetricSpec(
    "syncscope_node_link_capacity_bytes_per_second",
    "gauge",
    "What the link the node's ranks communicate over is known to carry, each way: the least "
    "of its negotiated speed and a token-bucket shaping of it.",
    ("job", "node", "interface"),
    "link",
    "bytes",
)
NODE_LINK_BYTES_TOTAL = MetricSpec(
    "syncscope_node_link_bytes_total",
    "counter",
    "Bytes through that link, as its ranks last read the interface's counters.",
    ("job", "node", "interface", "direction"),
    "link",
    "bytes",
)
# The job's life on each node, over its ranks and their incarnations (exporter/store.py):
# what goodput and badput are made of. Once per node and job, not per rank (series budget).
# The badput categories the exporter counts; wire.EVENT_KINDS' names are among them, but for a
# compile's (its time stays in the step's phases).
LOST_PROGRESS = "lost_progress"
BADPUT_CATEGORIES = ("startup", "checkpoint_save", "checkpoint_load", LOST_PROGRESS)
NODE_BADPUT_SECONDS_TOTAL = MetricSpec(
    "syncscope_node_badput_seconds_total",
    "counter",
    "Rank-seconds the node's ranks lost, by category: startup (process start to the first "
    "step, less checkpoint loads before it), checkpoint_save and checkpoint_load (torch.save, "
    "torch.load, torch.distributed.checkpoint and agent.checkpoint() on the training thread), "
    "lost_progress (the productive time the steps a restart ran again took before; at the "
    "previous incarnation's mean productive step where it resumed at a step that was neither "
    "a checkpoint's nor an incarnation's first).",
    (*NODE, "category"),
    "always",
    "seconds",
)
NODE_PRODUCTIVE_SECONDS_TOTAL = MetricSpec(
    "syncscope_node_productive_seconds_total",
    "counter",
    "Rank-seconds of the node's ranks in productive step time: each step less its data wait, "
    "exposed communication, pacing and checkpoint time (lost progress not taken out).",
    NODE,
    "always",
    "seconds",
)
NODE_RESTARTS_TOTAL = MetricSpec(
    "syncscope_node_restarts_total",
    "counter",
    "Restarts of the node's ranks the exporter saw (a rank reporting as a new incarnation of "
    "itself), summed over its ranks: the scenario's 're-runs increase', per day in the trends.",
    NODE,
    "always",
)
GPU_HOUR_PRICE = MetricSpec(
    "syncscope_gpu_hour_price",
    "gauge",
    "The price of one GPU-hour on this node (the exporter's --price-per-gpu-hour, in the "
    "operator's currency), per job it serves: what the cost rules multiply GPU-hours by.",
    NODE,
    "price",
)
JOB_STARTED_TIMESTAMP_SECONDS = MetricSpec(
    "syncscope_job_started_timestamp_seconds",
    "gauge",
    "Unix time the job's earliest process seen on this node started (its first incarnation; "
    "for agents that do not say, their attach time or the exporter's first report of them).",
    NODE,
    "always",
    "seconds",
)
# When the job-wide rules may judge a job (recorded.WINDOW_FULL): once every node's latest rank
# started reporting steps a straggler window ago. One series a node, so that the gate reads no
# per-rank series.
RANKS_STARTED_TIMESTAMP_SECONDS = MetricSpec(
    "syncscope_ranks_started_timestamp_seconds",
    "gauge",
    "Unix time the latest of the job's ranks on this node started reporting steps: when the "
    "exporter received its current incarnation's first step (the time of the scrape while a "
    "rank has none yet).",
    NODE,
    "always",
    "seconds",
)
# The host's CPU packages (exporter/energy.py): shared by every rank of the node.
NODE_CPU_ENERGY_JOULES_TOTAL = MetricSpec(
    "syncscope_node_cpu_energy_joules_total",
    "counter",
    "Energy of each CPU package of the node since the exporter first read it (RAPL through "
    "Linux powercap), once per job with ranks reporting there.",
    (*NODE, "package"),
    "rapl",
    "joules",
)
# -- exporter self-metrics
# One duration for the whole scrape, each collector's in /v1/state (`collectors`): a gauge per
# collector cost 13 series a node (1.6 a rank) for what only debugging reads.
EXPORTER_COLLECT_DURATION_SECONDS = MetricSpec(
    "syncscope_exporter_collect_duration_seconds",
    "gauge",
    "Time the exporter took to build this scrape's series, every collector (each collector's "
    "time: /v1/state's `collectors`).",
    (),
    "always",
    "seconds",
)
EXPORTER_COLLECTOR_SUCCESS = MetricSpec(
    "syncscope_exporter_collector_success",
    "gauge",
    "1 if the collector succeeded this scrape.",
    ("collector",),
    "always",
)
EXPORTER_INGEST_RECORDS_TOTAL = MetricSpec(
    "syncscope_exporter_ingest_records_total",
    "counter",
    "Records accepted at ingest.",
    (),
    "always",
)
EXPORTER_INGEST_REJECTED_TOTAL = MetricSpec(
    "syncscope_exporter_ingest_rejected_total",
    "counter",
    "Requests or records refused at ingest.",
    ("reason",),
    "rejections",
)
EXPORTER_START_TIME_SECONDS = MetricSpec(
    "syncscope_exporter_start_time_seconds",
    "gauge",
    "Unix time the exporter started.",
    (),
    "always",
    "seconds",
)
EXPORTER_RANKS = MetricSpec(
    "syncscope_exporter_ranks", "gauge", "Ranks reporting (not stale).", ("job",), "always"
)
EXPORTER_JOB_WIDE_VIEW = MetricSpec(
    "syncscope_exporter_job_wide_view",
    "gauge",
    "1 while the exporter's diagnosis, page and baselines use Prometheus's job-wide view of "
    "the job (--prometheus-url), 0 while its view is node-local.",
    ("job",),
    "always",
)
# -- the exporter process; help as prometheus_client's ProcessCollector writes it
PROCESS_CPU_SECONDS_TOTAL = _process(
    "process_cpu_seconds_total",
    "counter",
    "Total user and system CPU time spent in seconds.",
    "seconds",
)
PROCESS_VIRTUAL_MEMORY_BYTES = _process(
    "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.", "bytes"
)
PROCESS_RESIDENT_MEMORY_BYTES = _process(
    "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", "bytes"
)
PROCESS_START_TIME_SECONDS = _process(
    "process_start_time_seconds",
    "gauge",
    "Start time of the process since unix epoch in seconds.",
    "seconds",
)
PROCESS_OPEN_FDS = _process("process_open_fds", "gauge", "Number of open file descriptors.")
PROCESS_MAX_FDS = _process("process_max_fds", "gauge", "Maximum number of open file descriptors.")
# -- from Prometheus itself
UP = MetricSpec("up", "gauge", "1 if Prometheus scraped the target, 0 if not.", (), "prometheus")
ALERTS = MetricSpec(
    "ALERTS",
    "gauge",
    "Alerts pending or firing, one series per alert (value 1).",
    ("alertname", "alertstate"),
    "prometheus",
)

SECTIONS = (
    Section("per rank: steps and phases", (STEPS_TOTAL, PHASE_SECONDS_TOTAL, PHASE_SAMPLING_EVERY)),
    Section(
        "per rank: collectives and arrival",
        (RANK_COLLECTIVE_SECONDS_TOTAL, ARRIVAL_LEAD_SECONDS, STEP_TIME_CV),
    ),
    Section(
        "per rank: liveness and transport",
        (RANK_LAST_REPORT_TIMESTAMP_SECONDS, AGENT_RECORDS_DROPPED_TOTAL),
    ),
    Section("per rank: work done", (RANK_SAMPLES_TOTAL, RANK_TOKENS_TOTAL)),
    Section(
        "per node: steps, collectives and world size, over the node's ranks",
        (
            STEP_DURATION_SECONDS,
            STEP_DURATION_RATIO,
            COLLECTIVE_CALLS_TOTAL,
            COLLECTIVE_SECONDS_TOTAL,
            COLLECTIVE_BYTES_TOTAL,
            COLLECTIVE_WAIT_SECONDS_TOTAL,
            WORLD_SIZE,
        ),
    ),
    Section(
        "per rank: pacing controller",
        (
            PACING_ACTIVE,
            PACING_DELAY_SECONDS_TOTAL,
            PACING_CURRENT_DELAY_SECONDS,
            PACING_THRESHOLD_SECONDS,
            PACING_ENGAGEMENTS_TOTAL,
        ),
    ),
    Section(
        "per rank: GPU topology and state",
        (
            GPU_INFO,
            GPU_LOCALITY_FAULT,
            GPU_PCIE_LINK_WIDTH,
            GPU_PCIE_LINK_GENERATION,
            GPU_NVLINK_ACTIVE_LINKS,
            GPU_SM_CLOCK_HERTZ,
            GPU_THROTTLE_REASONS,
            GPU_TEMPERATURE_CELSIUS,
            GPU_POWER_WATTS,
            GPU_ENERGY_JOULES_TOTAL,
            GPU_XID_ERRORS_TOTAL,
            GPU_LAST_XID,
            GPU_ECC_UNCORRECTED_ERRORS_TOTAL,
            GPU_ROW_REMAP_PENDING,
            GPU_ROW_REMAP_FAILURE,
        ),
    ),
    Section("per node: CPU package energy", (NODE_CPU_ENERGY_JOULES_TOTAL,)),
    Section(
        "per node: the job's life, goodput and badput across restarts",
        (
            NODE_BADPUT_SECONDS_TOTAL,
            NODE_PRODUCTIVE_SECONDS_TOTAL,
            JOB_STARTED_TIMESTAMP_SECONDS,
            RANKS_STARTED_TIMESTAMP_SECONDS,
            NODE_RESTARTS_TOTAL,
            GPU_HOUR_PRICE,
        ),
    ),
    Section(
        "per exporter: local diagnosis and per-step pooling",
        (
            DIAGNOSIS,
            STRAGGLER_CAUSE,
            VICTIM_WAIT_SECONDS,
            JOB_VERDICT,
            ARRIVAL_SKEW_SECONDS,
            NODE_POOLED_STEPS_TOTAL,
            NODE_TRANSFER_SECONDS_TOTAL,
            NODE_SAMPLED_STEP,
            NODE_SAMPLED_TRANSFER_SECONDS,
            NODE_LINK_CAPACITY_BYTES_PER_SECOND,
            NODE_LINK_BYTES_TOTAL,
        ),
    ),
    Section(
        "exporter self-metrics",
        (
            EXPORTER_COLLECT_DURATION_SECONDS,
            EXPORTER_COLLECTOR_SUCCESS,
            EXPORTER_INGEST_RECORDS_TOTAL,
            EXPORTER_INGEST_REJECTED_TOTAL,
            EXPORTER_START_TIME_SECONDS,
            EXPORTER_RANKS,
            EXPORTER_JOB_WIDE_VIEW,
        ),
    ),
    Section(
        "the exporter process (prometheus_client's ProcessCollector)",
        (
            PROCESS_CPU_SECONDS_TOTAL,
            PROCESS_VIRTUAL_MEMORY_BYTES,
            PROCESS_RESIDENT_MEMORY_BYTES,
            PROCESS_START_TIME_SECONDS,
            PROCESS_OPEN_FDS,
            PROCESS_MAX_FDS,
        ),
    ),
    Section("from Prometheus itself", (UP, ALERTS)),
)
CATALOG: tuple[MetricSpec, ...] = tuple(m for s in SECTIONS for m in s.metrics)

CONTRACT_HEADER = """\
# The metric families the syncscope exporter emits, generated from syncscope/catalog.py by
# `syncscope generate`: edit the catalog, not this file. Rules, dashboards and the exporter are
# built from the same catalog; tests/unit/test_catalog.py compares it with a real /metrics.
#
# One family per line: NAME TYPE LABELS CONDITION
#   TYPE       counter | gauge | histogram | info (a gauge whose value is 1)
#              counters are listed with their _total suffix; a histogram's family name
#              stands for its _bucket{le}, _sum and _count series
#   LABELS     comma-separated label names the exporter sets (not instance/job added by
#              Prometheus), "-" for none
#   CONDITION  always | gpu (only where the rank has a GPU) | gpu_fault (only where the rank's
#              GPU reports that fault: a non-zero XID code, a row remapping pending or failed)
#              | pacing (only where the agent
#              runs the pacing controller) | straggler (only while the exporter names one)
#              | sampled (once the job has pooled a step its rings sample: exporter/pooling.py)
#              | link (where the ranks report the interface they communicate over)
#              | rejections (no series before the exporter's first rejected record)
#              | process (prometheus_client's process collector; Linux only)
#              | prometheus (synthesised by Prometheus)
#              | work (where the rank's samples or tokens are known: set by the user, or
#                read from the model's inputs)
#              | rapl (where the exporter can read the host's RAPL package counters)
#              | verdict (while the exporter's diagnosis finds the job losing time)
#              | price (where the exporter is given --price-per-gpu-hour)
#              | phase_sampling (where the rank times its phases in 1 step of N > 1)
"""


def contract_text() -> str:
    """deploy/metrics-contract.txt: the header, then one aligned line per family by section."""
    lines = [CONTRACT_HEADER, "\n"]
    for section in SECTIONS:
        lines.append(f"# {section.title}\n")
        for m in section.metrics:
            labels = ",".join(m.labels) or "-"
            lines.append(f"{m.name:<46}  {m.type:<9}  {labels:<38}  {m.condition}\n")
    return "".join(lines)


def markdown_table() -> str:
    """The families the exporter emits as a Markdown table: metric, type, labels, help."""
    rows = ["| Metric | Type | Labels | Help |\n", "|---|---|---|---|\n"]
    for m in CATALOG:
        if m.condition == "prometheus":
            continue
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        help_ = m.help.replace("|", "\\|")  # a pipe would end the cell
        rows.append(f"| `{m.name}` | {m.type} | {labels} | {help_} |\n")
    return "".join(rows)
