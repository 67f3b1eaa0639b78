"""Where the phase clock's records go: the step rows, DDP sync records and events the reporter
drains, in the shapes syncscope.wire names, with what a full queue refused counted.

PhaseClock (phases.py) decides what a step's row holds; this is its sink. A quiet step's row
(phase sampling) is queued as the clock saw it and made whole here, off the training thread.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import Any

from syncscope.agent.step_work import StepWork

from syncscope.wire import DDP_GRAD_SYNC, Phase

PACING = int(Phase.PACING)
# A step row is (step, end_ns, total_ns, *accumulated phases, samples, tokens): where the
# phases start and where the work counts start (wire.StepRowWithWork).
ROW_PHASES = 3
ROW_WORK = 9
# A quiet step's row as the clock queues it (phase sampling): (step, end_ns, total_ns, the last
# timed step's phase shares, its DDP sync's share of its total or None, samples, tokens), made
# a full row by StepSink.finish before it leaves the process.
QUIET_ROW = 7


class StepSink:
    """The reporter's queues as the clock fills them: `steps` (one row a step), `collectives`
    (DDP's sync records among the interceptor's), `events` (startup, checkpoints, compiles:
    wire.EventRow; None until the agent sets its queue), and the step's `work` as it is counted.

    Tail drop: a full queue refuses the new record and counts it in `dropped`. (Appending to a
    full deque(maxlen) would evict the oldest instead, and "was it full?" checked before the
    append races with the reporter's drain, so the count could be off.)
    """

    __slots__ = (
        "coll_max",
        "collectives",
        "ddp_bytes",
        "ddp_group",
        "dropped",
        "events",
        "steps",
        "steps_max",
        "work",
    )

    def __init__(
        self, steps: deque, collectives: deque, ddp_group: str | None, ddp_bytes: float
    ) -> None:
        self.steps = steps
        self.collectives = collectives
        self.events: deque | None = None
        self.ddp_group = ddp_group  # None when the model does not synchronise gradients
        self.ddp_bytes = ddp_bytes
        self.dropped = 0
        self.steps_max = steps.maxlen or sys.maxsize
        self.coll_max = collectives.maxlen or sys.maxsize
        self.work = StepWork()

    def _event(self, kind: str, step: int, end: int, duration: int) -> None:
        events = self.events
        if events is None:
            return
        if len(events) < (events.maxlen or sys.maxsize):
            events.append((kind, step, end, max(0, duration)))
        else:
            self.dropped += 1

    def _queue_row(self, step: int, t: int, total: int, phases: list[int]) -> None:
        """Step `step`'s row: its end, total, `phases` and work (the work read either way)."""
        steps = self.steps
        if len(steps) < self.steps_max:
            samples, tokens = self.work.take()
            a, b, c, d, e, f = phases
            steps.append((step, t, total, a, b, c, d, e, f, samples, tokens))
        else:
            self.work.take()  # the dropped step's work must not count in the next one
            self.dropped += 1

    def _sync_record(self, step: int, ns: int = 0) -> tuple:
        """DDP's sync in `step`, `ns` long, as the collectives queue holds it."""
        return (DDP_GRAD_SYNC, self.ddp_group, self.ddp_bytes, ns, step)

    def finish(self, rows: Any) -> list[tuple]:
        """Make the quiet steps' rows among `rows` (drained: a list, or the deque the shm ring
        pumps from) whole, in place: their phases are their timed step's shares of their own
        totals (estimate_phases). Returns their DDP sync records, estimated alike (the timed
        sync's share of the step), for the caller to send with them. Off the training thread
        (the reporter's, before it sends), or at the shm ring's pump."""
        syncs: list[tuple] = []
        for i, row in enumerate(rows):
            if len(row) == QUIET_ROW:
                step, t, total, shares, sync_share, samples, tokens = row
                rows[i] = (step, t, total, *estimate_phases(shares, total), samples, tokens)
                if sync_share is not None:
                    syncs.append(self._sync_record(step, int(sync_share * total)))
        return syncs


def phase_shares(phases: list[int], total: int) -> list[float]:
    """A timed step's phases (DATA .. PACING) as shares of its total; pacing's share is 0 (a
    quiet step has no pacer)."""
    if total <= 0:
        return [0.0] * len(phases)
    shares = [max(0, ns) / total for ns in phases]
    shares[PACING] = 0.0
    return shares


def estimate_phases(shares: list[float] | None, total: int) -> list[int]:
    """A quiet step's phases: the last timed step's shares of its own total (they add up to at
    most the total; the rest is `other`, as on a timed step)."""
    if shares is None or total <= 0:
        return [0, 0, 0, 0, 0, 0]
    a, b, c, d, e, f = shares  # unrolled: a comprehension is a frame of its own, every step
    return [
        int(a * total),
        int(b * total),
        int(c * total),
        int(d * total),
        int(e * total),
        int(f * total),
    ]
