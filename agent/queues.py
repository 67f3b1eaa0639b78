"""The two bounded queues between the training process's record producers and the reporter."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from syncscope.agent.phases import PhaseClock


class RecordQueues:
    """Step rows and collective rows on their way to the reporter, and the step they belong to.

    Filled by the phase clock (step rows, DDP's gradient sync), the collective patch and the
    Flight Recorder reader (collective rows); drained by the reporter. Every producer tail-drops
    into a full queue and counts it (phases.py says why). Producers that do not count steps
    themselves file their rows under `current_step()`.
    """

    __slots__ = ("clock", "collectives", "steps")

    def __init__(self, queue_size: int) -> None:
        self.steps: deque[tuple] = deque(maxlen=queue_size)
        # A step usually has more than one collective: the patched calls besides DDP's sync.
        self.collectives: deque[tuple] = deque(maxlen=queue_size * 4)
        self.clock: PhaseClock | None = None  # counts the steps; set once it is built

    def current_step(self) -> int:
        """The step the training thread is in (0 before there is a clock)."""
        clock = self.clock
        return 0 if clock is None else clock.step
