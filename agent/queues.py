"""The bounded queues between the training process's record producers and the reporter."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from syncscope.agent.phases import PhaseClock

EVENT_QUEUE_SIZE = 1024


class RecordQueues:
    """Step rows, collective rows and event rows on their way to the reporter, and the step
    they belong to.

    Filled by the phase clock (step rows, DDP's gradient sync, events), the collective patch and
    the Flight Recorder reader (collective rows); drained by the reporter. Every producer tail-drops
    into a full queue and counts it (phases.py says why). Producers that do not count steps
    themselves file their rows under `current_step()`.
    """

    __slots__ = ("clock", "collectives", "events", "steps")

    def __init__(self, queue_size: int) -> None:
        self.steps: deque[tuple] = deque(maxlen=queue_size)
        # A step usually has more than one collective: the patched calls besides DDP's sync.
        self.collectives: deque[tuple] = deque(maxlen=queue_size * 4)
        # Rare events (startup, checkpoint saves and loads: wire.EventRow), a few per flush.
        self.events: deque[tuple] = deque(maxlen=EVENT_QUEUE_SIZE)
        self.clock: PhaseClock | None = None  # counts the steps; set once it is built

    def current_step(self) -> int:
        """The step the training thread is in (0 before there is a clock)."""
        clock = self.clock
        return 0 if clock is None else clock.step
