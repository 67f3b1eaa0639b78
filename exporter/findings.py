"""What the diagnosis finds, as the store's snapshot carries it, and the readings of a rank's
topology that the diagnosis and the verdict share.

The result types (a job's `Diagnosis`, its modes, straggler, victims and `JobVerdict`) sit
below the store, whose `JobView` holds one; the rules that fill them (exporter.diagnosis,
exporter.verdict) sit above it and read its rank views. Nothing here imports another exporter
module.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from syncscope.catalog import CLOCK_EVENT_REASONS

# Field metadata for store.as_json (which declares the others): the key is left out of the JSON
# while the field is None (OMIT_IF_NONE), or always (NOT_IN_JSON).
OMIT_IF_NONE = {"json": "omit_if_none"}
NOT_IN_JSON = {"json": "omit"}

# The NVML clock-event ("throttle") reasons that mean the GPU is being slowed down.
THROTTLE_BITS = {r.bit: r.words for r in CLOCK_EVENT_REASONS if r.slows}


@dataclass(frozen=True)
class ModeVerdict:
    """One failure mode as assessed: how strongly the data shows it, and why."""

    score: float  # 0..1, rounded to 4 places
    verdict: bool  # the (unrounded) score reaches settings.Thresholds.verdict_score
    reason: str


@dataclass(frozen=True)
class Straggler:
    """The rank named as holding the job back, and what makes it late."""

    rank: int
    cause: str  # one of diagnosis.CAUSES
    cause_reason: str
    lateness_s: float  # the arrival skew it causes
    last_arrival_share: float | None  # None with too few steps reported by every rank


@dataclass(frozen=True)
class Victim:
    """A rank that waits for the straggler, perhaps through another rank: the group it loses
    most time in, and whom it waits for there (None: a rank this exporter does not see)."""

    rank: int
    group: str
    waits_for: int | None
    wait_s: float  # per step, in that group


@dataclass(frozen=True)
class JobVerdict:
    """Whether the time the job loses goes to its coupling or to its infrastructure, with the
    evidence (the seed scenario's decision rule: cost up "despite healthy hardware metrics" is a
    structural coupling problem). Health is claimed only from facts: `passed` lists the checks
    made, `unknown` those that could not be (no GPU telemetry, an idle GPU's link, one node's
    view of the links, a GPU whose NVML gives no ECC counts or XID events)."""

    verdict: str  # one of verdict.VERDICTS
    # one of verdict.HARDWARE: every check passed / none failed, some unknown / one failed
    hardware: str
    reason: str  # one line, as the page and the demo say it
    # coupling mode detected -> the share of step time it costs; verdict.THROUGHPUT_DROP -> the
    # share of the job's own baseline throughput per GPU it lost
    coupling: Mapping[str, float | None]
    faults: tuple[str, ...]  # what is not healthy, named: the rank, its GPU and node, the link
    passed: tuple[str, ...]  # the health checks that passed
    unknown: tuple[str, ...]  # the health checks that could not be made, and why


@dataclass(frozen=True)
class WarmUp:
    """A job whose ranks have not all delivered a settled window of steps yet (steps after
    their incarnation's first, compiling, step and after a checkpoint load): the diagnosis
    names no straggler and no mode fires until they have."""

    steps: int  # settled steps of the rank here with the fewest
    of: int  # the window each rank needs (Thresholds.window)

    @property
    def text(self) -> str:
        """'warming up (12 of 100 steps)', as the page and the reasons say it."""
        return f"warming up ({self.steps} of {self.of} steps)"


@dataclass(frozen=True)
class Diagnosis:
    """One job's diagnosis on this node (its JSON is the `diagnosis` of /v1/state)."""

    modes: Mapping[str, ModeVerdict]  # only the modes the data lets a rule assess
    straggler: Straggler | None
    skew_s: float | None
    steps_compared: int  # steps reported by every live rank that the per-step rules used
    error: str | None = field(default=None, metadata=OMIT_IF_NONE)  # a rule's failure
    victims: tuple[Victim, ...] = ()  # while a straggler is named: the ranks here that wait
    # The decision verdict; None while the job loses no time (or nothing reports).
    verdict: JobVerdict | None = field(default=None, metadata=OMIT_IF_NONE)
    # The line the skew was compared with to name a straggler (straggler_line)
    skew_line_s: float | None = field(default=None, metadata=OMIT_IF_NONE)
    # While a rank here has fewer settled steps than the window: no straggler, no verdict.
    warming_up: WarmUp | None = field(default=None, metadata=OMIT_IF_NONE)
    # Since when (unix s) each held mode has been over its line in consecutive diagnoses: the
    # next diagnosis of the job carries it on (exporter.diagnosis.hold_modes).
    over_since: Mapping[str, float] = field(default_factory=dict, metadata=NOT_IN_JSON)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def number(value: Any) -> float | None:
    """A finite number from a topology field (agents send numbers, or numbers as text)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        parsed = float(value)
    except (ValueError, OverflowError):
        return None
    return parsed if math.isfinite(parsed) else None


def rank_list(ranks: Sequence[int]) -> str:
    """'rank 3', 'ranks 0–2, 5'."""
    spans: list[list[int]] = []
    for n in sorted(set(ranks)):
        if spans and spans[-1][1] == n - 1:
            spans[-1][1] = n
        else:
            spans.append([n, n])
    text = ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in spans)
    return ("ranks " if len(set(ranks)) > 1 else "rank ") + text


def numa_mismatch(topology: Mapping[str, Any] | None) -> bool | None:
    """True: the process runs off its GPU's NUMA node; False: on it; None: not known."""
    value = (topology or {}).get("numa_mismatch")
    if isinstance(value, bool):
        return value
    read = number(value)
    return None if read is None else read == 1
