"""Exporter settings: one typed object, built from the command line or by tests directly."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from syncscope.catalog import STEP_WINDOW
from syncscope.thresholds import load_config

if TYPE_CHECKING:
    from syncscope.exporter.diagnosis import Thresholds


def _shipped_thresholds() -> Thresholds:
    """The shipped file's diagnosis lines; imported here, not at the top: the diagnosis module
    imports this one (a cycle at import time)."""
    from syncscope.exporter.diagnosis import DEFAULT_THRESHOLDS

    return DEFAULT_THRESHOLDS


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
    thresholds: Thresholds = field(default_factory=_shipped_thresholds)
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
