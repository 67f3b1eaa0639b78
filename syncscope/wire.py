"""The wire schema of what an agent sends its node's exporter: one module both sides import.

Two versions, told apart by `schema_version`, both accepted by the exporter:

- **2** (what the agent sends): records as rows of integers, exactly the tuples the training
  thread queued, nanoseconds on the agent's monotonic clock plus one clock offset per batch. A
  step row has 11 fields, the last two the step's work (samples, tokens; -1: not known); rows
  of 9 fields, without them, as agents sent before work was counted, are still accepted.
  Rare events (`events`: startup, checkpoint saves and loads) come as rows of their own; a
  batch without them, as agents sent before there were events, is still accepted.
  The reporter serialises its queues without building a Python object per record, which is
  most of what a flush costs the training process (bench/bench_agent_overhead.py).
- **1**: records as objects in seconds, for people and other clients writing batches by hand.

The agent (stdlib only) never validates; the exporter validates each batch against the
dataclasses below through pydantic and turns either version into the same rows in seconds
(`step_rows`, `collective_rows`). The bounds are part of the schema so that NaN, infinities,
negative durations and absurd sizes are refused at the door rather than poisoning a counter.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

try:  # present wherever pydantic is (the exporter); the agent never evaluates these bounds
    from annotated_types import Ge, Le, MaxLen
except ImportError:  # pragma: no cover - agent-only installs

    def _unbounded(*_args: object, **_kwargs: object) -> None:
        return None

    Ge = Le = MaxLen = _unbounded  # type: ignore[assignment,misc]

SCHEMA_VERSION = 2  # what the agent sends; the exporter accepts 1 and 2
INGEST_PATH = "/v1/ingest"


class Phase(enum.IntEnum):
    """The phases of a step, in wire order; they add up to the step's wall time.

    The value is the phase's position in every per-step tuple (rows, `Phases`, the store's
    sums); the label is its name in metrics and JSON. agent.phases says where each boundary
    comes from.
    """

    DATA = 0
    FORWARD = 1
    BACKWARD = 2
    OPTIMIZER = 3
    COMM_EXPOSED = 4
    PACING = 5
    OTHER = 6

    @property
    def label(self) -> str:
        return self.name.lower()


PHASES = tuple(p.label for p in Phase)
# The phases in which a rank is held at synchronisation: blocked in collectives, and the delay
# pacing inserted at the step boundary, time a paced rank holds back for the rank it waits for
# and no longer waits in the collective. Every lead, skew, straggler and amplification counts
# both: exposed communication alone would shrink a victim's loss by its pacing delay.
BLOCKED = (Phase.COMM_EXPOSED, Phase.PACING)


def blocked_s(phases: Sequence[float]) -> float:
    """A step's time blocked (BLOCKED) from its phases in wire order."""
    return sum(phases[p] for p in BLOCKED)


# Collective ops as labelled in metrics. `ddp_grad_sync` is DDP's gradient synchronisation as
# seen from the default (hook-free) path: its duration is the *exposed* part only.
OPS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
    "all_to_all",
    "reduce",
    "gather",
    "scatter",
    "send",
    "recv",
    "ddp_grad_sync",
)
DDP_GRAD_SYNC = "ddp_grad_sync"
# Point-to-point ops: a pipeline's stages hand activations and gradients on with them.
P2P_OPS = frozenset({"send", "recv"})
# A topology entry "group.<label>" lists the global ranks of the rank's group of that label
# ("2,3"): how the exporter follows a wait to the rank waited for.
GROUP_FACT = "group."
# A group too large to list names its lowest global rank instead ("group_first.<label>" ->
# "0"): groups of one label are disjoint, so (label, lowest rank) is the group. The job-wide
# rules find each such group's least blocked member (recorded.GROUP_NEXT_HOP) by it.
GROUP_FIRST_FACT = "group_first."


def group_ranks(topology: Mapping[str, Any] | None, group: str) -> tuple[int, ...]:
    """The global ranks of the group labelled `group`, as a rank's topology lists them (its
    GROUP_FACT entry), or () where it does not."""
    text = (topology or {}).get(GROUP_FACT + group)
    if not isinstance(text, str):
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x)
    except ValueError:
        return ()


def group_first(topology: Mapping[str, Any] | None, group: str) -> int | None:
    """The lowest global rank of the rank's group labelled `group`: from its members where the
    topology lists them, else its GROUP_FIRST_FACT entry; None where neither says."""
    ranks = group_ranks(topology, group)
    if ranks:
        return min(ranks)
    text = (topology or {}).get(GROUP_FIRST_FACT + group)
    return int(text) if isinstance(text, str) and text.isdigit() else None


def pipeline_stage(rank: int, group: str, topology: Mapping[str, Any] | None) -> int | None:
    """The pipeline stage of `rank`, whose point-to-point ops run in `group`: its position in
    that group (stage s of every pipeline is its pp group's s-th rank, as DeviceMesh and
    torch.distributed.pipelining lay pipelines out), or None where the group's ranks are not
    known."""
    ranks = group_ranks(topology, group)
    return ranks.index(rank) if rank in ranks else None


MAX_STEPS_PER_BATCH = 4096
MAX_COLLECTIVES_PER_BATCH = 16384
MAX_EVENTS_PER_BATCH = 1024
MAX_LABEL_LEN = 64
MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_TOPOLOGY_ENTRIES = 64
MAX_TOPOLOGY_TEXT = 256
MAX_SECONDS = 86_400.0  # a single step or collective longer than a day is garbage, not data
MAX_BYTES = float(1 << 50)  # 1 PiB per call
MAX_NANOS = int(MAX_SECONDS * 1e9)
MAX_UNIX_S = 1e11
# Samples or tokens one rank processes in one step: far above any real batch, far below what
# would make a counter's float lose single units within a job's life.
MAX_WORK = 1 << 40
# A step row's work count that is not known (the model's inputs did not say, nobody set it).
UNKNOWN_WORK = -1

Seconds = Annotated[float, Ge(0.0), Le(MAX_SECONDS)]
Count = Annotated[int, Ge(0), Le(1 << 62)]
Label = Annotated[str, MaxLen(MAX_LABEL_LEN)]
Nanos = Annotated[int, Ge(0), Le(MAX_NANOS)]
Work = Annotated[int, Ge(UNKNOWN_WORK), Le(MAX_WORK)]
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
    # When the training process started (the kernel's start time of the process, else the
    # agent's attach time); 0: not said (agents before goodput was measured).
    process_started_unix_s: Annotated[float, Ge(0.0), Le(1e11)] = 0.0
    # Phase sampling (agent/phases.py): the rank times the phases of one step in N and
    # reports the others' as that step's shares of their totals; 1: every step timed (and
    # agents before sampling, which do not say).
    phase_every: Annotated[int, Ge(1), Le(1 << 20)] = 1


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
    end_unix_s: Annotated[float, Ge(0.0), Le(MAX_UNIX_S)]
    phases: Phases = field(default_factory=Phases)
    # Work this rank did in the step; None: not known (no series rather than a guess).
    samples: Annotated[int, Ge(0), Le(MAX_WORK)] | None = None
    tokens: Annotated[int, Ge(0), Le(MAX_WORK)] | None = None


@dataclass
class CollectiveRecord:
    """One collective call as this rank saw it: entry to exit on this rank's clock."""

    op: Label
    group: Label
    bytes: Annotated[float, Ge(0.0), Le(MAX_BYTES)]
    duration_s: Seconds
    step: Count = 0


# What an event row's kind says (agent/checkpointing.py, agent/phases.py):
#   startup          process start to the first step's start, less checkpoint time before it
#   checkpoint_save  a checkpoint save on the training thread (torch.save, dcp.save, or
#   checkpoint_load  ... a load; `with agent.checkpoint(kind)`), one call counted once
#   compile          a torch.compile compilation or recompilation ended (agent/compiles.py):
#                    the exporter's settled steps count again after its step; not badput,
#                    and its time stays in the phase it fell in, not in `other`
# An event's step is the step it fell in (its time is part of that step's `other`), or
# NO_STEP: outside every step (before the first, or a startup). The exporter ignores kinds it
# does not know, so that a newer agent's events never cost its batch.
EVENT_STARTUP = "startup"
EVENT_CHECKPOINT_SAVE = "checkpoint_save"
EVENT_CHECKPOINT_LOAD = "checkpoint_load"
EVENT_COMPILE = "compile"
# The shared-memory ring sends a kind as its index here: new kinds go at the end.
EVENT_KINDS = (EVENT_STARTUP, EVENT_CHECKPOINT_SAVE, EVENT_CHECKPOINT_LOAD, EVENT_COMPILE)
NO_STEP = -1
EventStep = Annotated[int, Ge(NO_STEP), Le(1 << 62)]


@dataclass
class EventRecord:
    """One rare event of a rank (version 1): what kind, in which step, how long."""

    kind: Label
    duration_s: Seconds
    end_unix_s: Annotated[float, Ge(0.0), Le(MAX_UNIX_S)]
    step: EventStep = NO_STEP


@dataclass
class PacingState:
    """The pacing controller's state at the time of the batch (paper §5.3)."""

    enabled: bool = False
    active: bool = False
    current_delay_s: Seconds = 0.0
    threshold_s: Seconds = 0.0
    engagements: Count = 0
    total_delay_s: Annotated[float, Ge(0.0), Le(1e12)] = 0.0


# A step as a row (version 2): [step, end_ns (agent monotonic clock), duration_ns, data_ns,
# forward_ns, backward_ns, optimizer_ns, comm_exposed_ns, pacing_ns, samples, tokens], integer
# nanoseconds; `other` is what the phases leave of the duration; samples and tokens are the
# work this rank did in the step, UNKNOWN_WORK (-1) where not known. The 9-field row without
# them (agents before work was counted) is still accepted. Tried in that order: a current
# row validates at the cost of one row type, not of the union.
StepRowWithWork = tuple[Count, Count, Nanos, Nanos, Nanos, Nanos, Nanos, Nanos, Nanos, Work, Work]
StepRowWithoutWork = tuple[Count, Count, Nanos, Nanos, Nanos, Nanos, Nanos, Nanos, Nanos]


class _InOrder:
    """Pydantic's union_mode="left_to_right" for the union it annotates, without importing
    pydantic here (the agent imports this module; pydantic calls this where it validates)."""

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> Any:
        schema = handler(source)
        if schema.get("type") == "union":
            schema["mode"] = "left_to_right"
        return schema


StepRow = Annotated[StepRowWithWork | StepRowWithoutWork, _InOrder()]
# A collective as a row: [op, group, bytes, duration_ns, step].
CollectiveRow = tuple[Label, Label, Annotated[int, Ge(0), Le(int(MAX_BYTES))], Nanos, Count]
# An event as a row: [kind, step (NO_STEP: outside every step), end_ns (agent monotonic
# clock), duration_ns]; a startup's end is the first step's start.
EventRow = tuple[Label, EventStep, Count, Nanos]

# Rows in seconds, what the exporter's store folds in whichever version arrived:
# (step, duration_s, end_unix_s, (seconds per phase, in PHASES order), samples, tokens) and
# (op, group, bytes, duration_s, step); samples and tokens are UNKNOWN_WORK where not known.
StepSeconds = tuple[int, float, float, tuple[float, ...], int, int]
_NO_WORK = (UNKNOWN_WORK, UNKNOWN_WORK)
CollectiveSeconds = tuple[str, str, float, float, int]
# (kind, step, end_unix_s, duration_s)
EventSeconds = tuple[str, int, float, float]


class BadRows(ValueError):
    """Rows that pass the schema's bounds but make no sense together (e.g. a wrong clock)."""


@dataclass(kw_only=True)
class _Batch:
    """What every version of a batch carries besides its records."""

    agent: AgentInfo
    # Cumulative count of records this agent lost (queue overflow, failed sends).
    dropped_total: Count = 0
    pacing: PacingState | None = None
    # GPU topology and low-rate samples: free-form but bounded, see agent.topology.
    topology: Annotated[dict[Label, TopologyValue], MaxLen(MAX_TOPOLOGY_ENTRIES)] | None = None


@dataclass(kw_only=True)
class BatchV1(_Batch):
    """What an agent POSTs to the exporter's ingest endpoint, records as objects in seconds."""

    schema_version: Literal[1]
    steps: Annotated[list[StepRecord], MaxLen(MAX_STEPS_PER_BATCH)] = field(default_factory=list)
    collectives: Annotated[list[CollectiveRecord], MaxLen(MAX_COLLECTIVES_PER_BATCH)] = field(
        default_factory=list
    )
    events: Annotated[list[EventRecord], MaxLen(MAX_EVENTS_PER_BATCH)] = field(default_factory=list)

    def step_rows(self) -> list[StepSeconds]:
        out: list[StepSeconds] = []
        for s in self.steps:
            p = s.phases
            phases = (p.data, p.forward, p.backward, p.optimizer, p.comm_exposed, p.pacing, p.other)
            samples = UNKNOWN_WORK if s.samples is None else s.samples
            tokens = UNKNOWN_WORK if s.tokens is None else s.tokens
            out.append((s.step, s.duration_s, s.end_unix_s, phases, samples, tokens))
        return out

    def collective_rows(self) -> list[CollectiveSeconds]:
        return [(c.op, c.group, c.bytes, c.duration_s, c.step) for c in self.collectives]

    def event_rows(self) -> list[EventSeconds]:
        return [(e.kind, e.step, e.end_unix_s, e.duration_s) for e in self.events]


@dataclass(kw_only=True)
class BatchV2(_Batch):
    """The same as BatchV1 with records as rows of integers (StepRow, CollectiveRow)."""

    schema_version: Literal[2]
    # Unix time minus the agent's monotonic clock, in ns, taken when the batch was built.
    clock_offset_ns: Annotated[int, Ge(-(1 << 62)), Le(1 << 62)]
    steps: Annotated[list[StepRow], MaxLen(MAX_STEPS_PER_BATCH)] = field(default_factory=list)
    collectives: Annotated[list[CollectiveRow], MaxLen(MAX_COLLECTIVES_PER_BATCH)] = field(
        default_factory=list
    )
    events: Annotated[list[EventRow], MaxLen(MAX_EVENTS_PER_BATCH)] = field(default_factory=list)

    def step_rows(self) -> list[StepSeconds]:
        """Seconds and unix time; raises BadRows for an end time no clock offset explains."""
        offset = self.clock_offset_ns
        out: list[StepSeconds] = []
        for step, end, total, data, fwd, bwd, opt, comm, pacing, *work in self.steps:
            end_unix_s = (end + offset) / 1e9
            if not 0.0 <= end_unix_s <= MAX_UNIX_S:
                raise BadRows(f"step {step}: end_ns + clock_offset_ns is not a unix time")
            other = max(0, total - data - fwd - bwd - opt - comm - pacing)
            phases = (data / 1e9, fwd / 1e9, bwd / 1e9, opt / 1e9, comm / 1e9, pacing / 1e9)
            samples, tokens = work or _NO_WORK
            out.append((step, total / 1e9, end_unix_s, (*phases, other / 1e9), samples, tokens))
        return out

    def collective_rows(self) -> list[CollectiveSeconds]:
        return [(op, g, float(b), d / 1e9, step) for op, g, b, d, step in self.collectives]

    def event_rows(self) -> list[EventSeconds]:
        """Seconds and unix time; raises BadRows for an end time no clock offset explains."""
        offset = self.clock_offset_ns
        out: list[EventSeconds] = []
        for kind, step, end, duration in self.events:
            end_unix_s = (end + offset) / 1e9
            if not 0.0 <= end_unix_s <= MAX_UNIX_S:
                raise BadRows(f"event {kind}: end_ns + clock_offset_ns is not a unix time")
            out.append((kind, step, end_unix_s, duration / 1e9))
        return out


Batch = BatchV1 | BatchV2


def size_bucket(nbytes: float) -> int:
    """Power-of-two size class of a collective, so durations are compared like with like."""
    return 0 if nbytes < 1 else int(math.log2(nbytes))
