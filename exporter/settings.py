"""Exporter settings: one typed object, built from the command line or by tests directly, and
the diagnosis's lines it carries (`Thresholds`: the thresholds file's, with --set applied)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from syncscope.catalog import STEP_WINDOW
from syncscope.thresholds import Thresholds as ThresholdsFile
from syncscope.thresholds import duration_seconds, load_config, required


@dataclass(frozen=True)
class Thresholds:
    """The rules' constants, from the thresholds file's "diagnosis" section (shared with the
    dashboards; the skew floor's default is Settings.skew_threshold_s, taken from there too).
    The exporter runs with Settings.thresholds (its --set overrides applied); DEFAULT_THRESHOLDS,
    the shipped file's, is the default for library callers and tests."""

    verdict_score: float  # a mode's verdict is its score reaching this
    skew_step_fraction: float  # skew must also exceed this fraction of the median step
    last_arrival_share: float  # ... and the rank must be last in this share of steps
    cause_share: float  # one signal must explain this share of the straggler's lateness
    idle_share_full: float  # sync_amplification scores 1 at this idle share of a step
    # The fabric verdicts share their lines with the Prometheus alerts (one definition): the
    # transfer per step over its own baseline at which contention is the verdict, and a
    # node's link capacity over the job's median below which it is the slow link.
    contention_inflation: float
    slow_link_ratio: float
    # The job-wide straggler's line, SyncscopeStraggler's (its lag over the mean step): the
    # job-wide view has no per-step count of last arrivals to tell a persistent straggler from
    # a lag that noise or a contended link lends one rank for a while, so it names only what
    # the alert's condition names, and the two agree.
    straggler_ratio: float
    # ... and only once it has held for the alert's for: and a whole straggler window (equal
    # as shipped, 5 min): a lead that the rules' windows lend the ranks of one node while a
    # change in the job's steps is inside them (each node's rates end at its own last scrape)
    # lasts less than a window; a straggler's holds
    straggler_hold_s: float
    spike_share_full: float  # runtime_jitter scores 1 at this share lost to spikes
    clock_ratio: float  # a throttling GPU's SM clock is below this × its peers' median
    # The decision verdict's trigger: throughput per GPU below this × the job's own baseline.
    throughput_ratio: float
    min_aligned_steps: int  # fewer steps reported by every rank: per-step rules abstain
    # The rules' windows where the exporter keeps its own baselines (the thresholds file's
    # "windows"): the node-local contention baseline and its recent transfer (the rate
    # window), the shortest block of a rank's throughput (the rate window), and how long its
    # best sustained throughput stays its baseline (the trend window).
    contention_baseline_s: float
    contention_recent_s: float
    throughput_block_s: float
    throughput_horizon_s: float
    window: int = STEP_WINDOW  # most recent steps compared
    # The node-local contention verdict's hold, SyncscopeFabricContention's for: a recent
    # transfer over its line for less than the alert waits is what a noisy machine's spread of
    # blocks can lend a clean run (median recent over a 10th-percentile baseline)
    contention_hold_s: float = 0.0
    # The node's coupling modes hold as their alerts do (exporter.diagnosis.HELD_MODES):
    # runtime_jitter for SyncscopeStepTimeCVHigh's for:, sync_amplification for
    # SyncscopeSyncAmplification's. Spikes that a busy machine lends a clean job for a minute
    # are not its coupling.
    jitter_hold_s: float = 0.0
    amplification_hold_s: float = 0.0

    @classmethod
    def from_config(cls, cfg: ThresholdsFile) -> Thresholds:
        section = cfg.diagnosis.model_dump()  # by field name: the same names as here
        alerts = cfg.alerts
        section["contention_inflation"] = required(
            alerts["SyncscopeFabricContention"].levels[0].threshold, "threshold"
        )
        section["slow_link_ratio"] = required(
            alerts["SyncscopeSlowLink"].levels[0].threshold, "threshold"
        )
        section["straggler_ratio"] = min(
            required(level.threshold, "threshold") for level in alerts["SyncscopeStraggler"].levels
        )
        windows = cfg.windows
        section["straggler_hold_s"] = max(
            duration_seconds(alerts["SyncscopeStraggler"].for_), duration_seconds(windows.straggler)
        )
        section["contention_hold_s"] = duration_seconds(alerts["SyncscopeFabricContention"].for_)
        section["jitter_hold_s"] = duration_seconds(alerts["SyncscopeStepTimeCVHigh"].for_)
        section["amplification_hold_s"] = duration_seconds(
            alerts["SyncscopeSyncAmplification"].for_
        )
        section["contention_baseline_s"] = duration_seconds(windows.contention_baseline)
        section["contention_recent_s"] = duration_seconds(windows.rate)
        section["throughput_block_s"] = duration_seconds(windows.rate)
        section["throughput_horizon_s"] = duration_seconds(windows.trend)
        names = [f.name for f in fields(cls) if f.name != "window"]
        return cls(**{name: section[name] for name in names})


DEFAULT_THRESHOLDS = Thresholds.from_config(load_config())


@dataclass
class Settings:
    host: str = "127.0.0.1"  # ingest and metrics; never wider unless asked
    port: int = 9464
    ingest_socket: str | None = None  # also accept ingest on this unix socket (mode 0660)
    token: str | None = None  # bearer token required for ingest over TCP
    # An extra listener serving GET /metrics and nothing else, for a Prometheus elsewhere.
    metrics_host: str | None = None  # default: host
    metrics_port: int | None = None  # default: no such listener
    step_window: int = STEP_WINDOW  # steps in the step-time CV window
    recent_steps: int = 300  # per-rank steps kept for /v1/state and the status page
    stale_after_s: float = 30.0  # a rank silent this long is marked stale
    expire_after_s: float = 600.0  # ... and forgotten after this long
    max_ranks: int = 4096
    max_jobs: int = 16
    max_series_per_rank: int = 64  # distinct (op, group) pairs per rank
    max_body_bytes: int = 8 * 1024 * 1024
    # Arrival skew below this never names a straggler (the thresholds file's skew_floor_s).
    skew_threshold_s: float = load_config().diagnosis.skew_floor_s
    # The diagnosis's and the verdict's lines (the store's diagnosis, the status page): the
    # thresholds file with the command line's --set overrides, the lines the rules were
    # rendered with, so that the exporter and the alerts judge a job alike.
    thresholds: Thresholds = DEFAULT_THRESHOLDS
    log_level: str = "warning"
    # Prometheus's HTTP API, to read the job-wide rules back (exporter/jobwide.py); without it
    # the exporter's view is node-local and it says so.
    prometheus_url: str | None = None
    prometheus_interval_s: float = 15.0
    # Linux powercap, where the host's CPU package energy (RAPL) is read at each snapshot
    # (exporter/energy.py); None or "": not read.
    powercap_root: str | None = "/sys/class/powercap"
    # Where the store's counters are kept across the exporter's restarts (exporter/state_file.py),
    # written every state_interval_s and at shutdown; None: not kept (the default: a path two
    # exporters shared would mix their counters).
    state_file: str | None = None
    state_interval_s: float = 5.0
    # The price of one GPU-hour on this node (one GPU a rank), for the cost rules; None: no
    # price, no cost series.
    price_per_gpu_hour: float | None = None
