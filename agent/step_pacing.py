"""Pacing at the step boundary: the step's waiting at DDP's sync in, the delay to sleep out.

The controller (agent/pacing.py) decides from waits; this piece says what a wait is on a rank.
DDP's exposed sync is waiting for the last peer plus the transfer, so the transfer baseline of
the local arrival estimate (agent/local_arrival.py, node-wide once the exporter has answered)
is subtracted first.

Pacing is safe where every wait is for the same peers: a delay at the step's start that stays
below a rank's wait only moves its idle time. Once a rank's collectives span two process groups
(tensor or pipeline parallel, HSDP, a sub-group of the data-parallel one), a rank that waits in
one group late in the step may be the one its partners in another group wait for early in the
step; delaying it would delay them, and perhaps the root. So pacing switches itself off for the
rest of the process when it sees a second group, and says so.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Protocol

from syncscope.agent.pacing import PacingController

log = logging.getLogger("syncscope.agent")


class TransferBaseline(Protocol):
    ddp_baseline_s: float  # 0.0 until known


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

    def pace(self, comm_ns: int, step_ns: int) -> int:
        """The step's exposed DDP sync and its duration (ns) -> the delay (ns) to insert."""
        controller = self.controller
        kill_file = self.kill_file
        if kill_file is not None and os.path.exists(kill_file):
            if controller.enabled:
                controller.disable()
                log.warning("syncscope: pacing switched off by %s", kill_file)
            return 0
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
        baseline = self.baseline.ddp_baseline_s
        if baseline <= 0.0 or not controller.enabled:
            return 0
        delay = controller.update(max(0.0, comm_ns / 1e9 - baseline), step_ns / 1e9)
        return int(delay * 1e9)
