"""The wire schema of what an agent sends its node's exporter: one module both sides import.

The agent (stdlib only) builds plain dicts with these field names and never validates; the
exporter validates each batch against the dataclasses below through pydantic. The bounds are
part of the schema so that NaN, infinities, negative durations and absurd sizes are refused at
the door rather than poisoning a counter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated

try:  # present wherever pydantic is (the exporter); the agent never evaluates these bounds
    from annotated_types import Ge, Le, MaxLen
except ImportError:  # pragma: no cover - agent-only installs

    def _unbounded(*_args: object, **_kwargs: object) -> None:
        return None

    Ge = Le = MaxLen = _unbounded  # type: ignore[assignment,misc]

SCHEMA_VERSION = 1
INGEST_PATH = "/v1/ingest"

# Phases add up to the step's wall time (see agent.phases for where each boundary comes from).
PHASES = ("data", "forward", "backward", "optimizer", "comm_exposed", "pacing", "other")
# Collective ops as labelled in metrics. `ddp_grad_sync` is DDP's gradient synchronisation as
# seen from the default (hook-free) path: its duration is the *exposed* part only.
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "ddp_grad_sync",
)
DDP_GRAD_SYNC = "ddp_grad_sync"

MAX_STEPS_PER_BATCH = 4096
MAX_COLLECTIVES_PER_BATCH = 16384
MAX_LABEL_LEN = 64
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_TOPOLOGY_ENTRIES = 64
MAX_TOPOLOGY_TEXT = 256
MAX_SECONDS = 86_400.0  # a single step or collective longer than a day is garbage, not data
MAX_BYTES = float(1 << 50)  # 1 PiB per call

Seconds = Annotated[float, Ge(0.0), Le(MAX_SECONDS)]
Count = Annotated[int, Ge(0), Le(1 << 62)]
Label = Annotated[str, MaxLen(MAX_LABEL_LEN)]
# Topology values are free-form but bounded: short text, finite numbers (JSON's 1e999 parses
# to inf, which would poison every later JSON answer), and at most MAX_TOPOLOGY_ENTRIES keys.
TopologyValue = (
    Annotated[str, MaxLen(MAX_TOPOLOGY_TEXT)]
    | Annotated[float, Ge(-1e18), Le(1e18)]
    | Annotated[int, Ge(-(1 << 62)), Le(1 << 62)]
    | None
)


@dataclass
class AgentInfo:
    """Who is reporting: identity of one rank's agent (one incarnation of one process)."""

    job: Label
    rank: Annotated[int, Ge(0), Le(1 << 20)]
    local_rank: Annotated[int, Ge(0), Le(1 << 12)]
    world_size: Annotated[int, Ge(1), Le(1 << 20)]
    incarnation: Label
    hostname: Label = ""
    pid: Annotated[int, Ge(0)] = 0
    started_unix_s: Annotated[float, Ge(0.0), Le(1e11)] = 0.0


@dataclass
class Phases:
    """Seconds spent in each phase of one step; they add up to the step's duration."""

    data: Seconds = 0.0
    forward: Seconds = 0.0
    backward: Seconds = 0.0
    optimizer: Seconds = 0.0
    comm_exposed: Seconds = 0.0
    pacing: Seconds = 0.0
    other: Seconds = 0.0


@dataclass
class StepRecord:
    """One training step (optimizer end to optimizer end, or one `with agent.step()` block)."""

    step: Count
    duration_s: Seconds
    end_unix_s: Annotated[float, Ge(0.0), Le(1e11)]
    phases: Phases = field(default_factory=Phases)


@dataclass
class CollectiveRecord:
    """One collective call as this rank saw it: entry to exit on this rank's clock."""

    op: Label
    group: Label
    bytes: Annotated[float, Ge(0.0), Le(MAX_BYTES)]
    duration_s: Seconds
    step: Count = 0


@dataclass
class PacingState:
    """The pacing controller's state at the time of the batch (paper §5.3)."""

    enabled: bool = False
    active: bool = False
    current_delay_s: Seconds = 0.0
    threshold_s: Seconds = 0.0
    engagements: Count = 0
    total_delay_s: Annotated[float, Ge(0.0), Le(1e12)] = 0.0


@dataclass
class Batch:
    """What one agent POSTs to the exporter's ingest endpoint."""

    schema_version: Annotated[int, Ge(1), Le(SCHEMA_VERSION)]
    agent: AgentInfo
    # Cumulative count of records this agent lost (queue overflow, failed sends).
    dropped_total: Count = 0
    steps: Annotated[list[StepRecord], MaxLen(MAX_STEPS_PER_BATCH)] = field(default_factory=list)
    collectives: Annotated[list[CollectiveRecord], MaxLen(MAX_COLLECTIVES_PER_BATCH)] = field(
        default_factory=list
    )
    pacing: PacingState | None = None
    # GPU topology and low-rate samples: free-form but bounded, see agent.topology.
    topology: Annotated[dict[Label, TopologyValue], MaxLen(MAX_TOPOLOGY_ENTRIES)] | None = None


def size_bucket(nbytes: float) -> int:
    """Power-of-two size class of a collective, so durations are compared like with like."""
    return 0 if nbytes < 1 else int(math.log2(nbytes))
