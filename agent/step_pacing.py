"""Pacing at the step boundary: the step's first synchronising wait in, the delay to sleep out.

The controller (agent/pacing.py) decides from waits; this piece says what a wait is on a rank.

A delay inserted at the step's start is safe as long as it stays below the rank's wait at the
step's first synchronising point: the rank still arrives there before the last peer, that
collective completes when it would have, and from then on the rank's step is what it would have
been. Nobody else can have waited for the rank before that point, so nobody else moves: not in
the same group, not in another (tensor- or pipeline-parallel partners, HSDP's two dimensions).
Later waits in the step are no licence: a rank that waits at the data-parallel sync may be the
one its tensor-parallel partner waited for in forward, and delaying it would delay the partner,
and perhaps the root. So on the CPU clock the controller is fed the step's first wait, which
is DDP's exposed sync when no wait for a collective came before it, else the first wait the
training thread was blocked in (collectives.Blocked.first_ns). Each less its transfer: DDP's
baseline, or the baseline of the collective that most steps complete first (local_arrival.py,
node-wide once the exporter has answered), so what is left is waiting for the last peer.

A step whose first wait came at another point than usual (a logging all-reduce every N steps,
a stop flag's broadcast) says nothing about the usual one's slack: only steps whose first wait
came at the boundary most recent steps saw it at (phases.py's boundaries) are fed.

CUDA's clock knows only each GPU step's exposed communication, not which wait came first: there
pacing stays DDP's, and switches itself off for the rest of the process when the rank's
collectives span a second process group, and says so.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Protocol

from syncscope.agent.pacing import PacingController
from syncscope.agent.phases import COMM_END

# Steps over which the usual boundary of a step's first wait is taken.
USUAL_OF = 32

log = logging.getLogger("syncscope.agent")


class TransferBaseline(Protocol):
    ddp_baseline_s: float  # 0.0 until known
    first_baseline_s: float  # the transfer of the collective steps wait for first; 0.0 until known


class StepPacer:
    """`pace` is the phase clock's `pacer`: called at every step end on the training thread.

    Until a baseline is known (the first flush) nothing is fed, so start-up transients cannot
    engage the controller. The kill file, checked every step (one stat, ~1 µs, only with pacing
    on), switches pacing off for the rest of the process's life.
    """

    def __init__(
        self,
        controller: PacingController,
        baseline: TransferBaseline,
        kill_file: str | None = None,
        group_count: Callable[[], int] | None = None,
    ) -> None:
        self.controller = controller
        self.baseline = baseline
        self.kill_file = kill_file
        self.group_count = group_count  # distinct process groups this rank's collectives use
        self._first_at: deque[int] = deque(maxlen=USUAL_OF)  # boundaries of recent first waits
        self._first_at_counts: dict[int, int] = {}

    def pace(self, comm_ns: int, step_ns: int, first_ns: int | None = None, at: int = -1) -> int:
        """The step's exposed communication and duration (ns), and on the CPU clock its first
        synchronising wait (`first_ns`, -1: the step had none) and the boundary that saw it
        (`at`; COMM_END: DDP's sync) -> the delay (ns) to insert."""
        controller = self.controller
        kill_file = self.kill_file
        if kill_file is not None and os.path.exists(kill_file):
            if controller.enabled:
                controller.disable()
                log.warning("syncscope: pacing switched off by %s", kill_file)
            return 0
        if first_ns is None:  # the GPU's steps: only their exposed communication is known
            group_count = self.group_count
            if group_count is not None and group_count() > 1:
                if controller.enabled:
                    controller.disable()
                    log.warning(
                        "syncscope: pacing switched off: this rank's collectives use %d process "
                        "groups, and a delay here could hold up a peer in another group",
                        group_count(),
                    )
                return 0
            wait_ns, baseline = comm_ns, self.baseline.ddp_baseline_s
        elif first_ns < 0 or not self._usual(at):  # no wait, or not the usual one: not fed
            return self._held()
        else:
            wait_ns = first_ns
            ddp = at == COMM_END
            baseline = self.baseline.ddp_baseline_s if ddp else self.baseline.first_baseline_s
        if baseline <= 0.0 or not controller.enabled:
            return 0
        delay = controller.update(max(0.0, wait_ns / 1e9 - baseline), step_ns / 1e9)
        return int(delay * 1e9)

    def _usual(self, at: int) -> bool:
        """Note where this step's first wait came; True if that is where most recent ones did."""
        recent, counts = self._first_at, self._first_at_counts
        if len(recent) == recent.maxlen:
            counts[recent[0]] -= 1
        recent.append(at)
        counts[at] = counts.get(at, 0) + 1
        return counts[at] * 2 > len(recent)

    def _held(self) -> int:
        """A step not fed keeps the delay decided before it (the controller assumes the delay
        it returned last is the one applied)."""
        controller = self.controller
        return int(controller.current_delay_s * 1e9) if controller.enabled else 0
