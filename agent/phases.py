"""Training-thread phase clock: timestamps at phase boundaries, summed into one tuple per step.

Where each boundary comes from (measured on gloo + DDP, see shared/FIELD-NOTES.md):
  data          previous step end (or previous backward) -> forward pre-hook
  forward       module forward pre-hook -> forward post-hook
  backward      a tensor hook on the forward output (fires when backward reaches it) ->
                callback A queued on the autograd engine (runs after all autograd work)
  comm_exposed  A -> callback B that A queues (runs after DDP has waited for its buckets)
  optimizer     optimizer step pre-hook -> post-hook
  pacing        the delay the pacing controller inserted at the step boundary
  other         the rest (loss, clipping, logging ...), so that phases add up exactly
A step runs from one optimizer post-hook to the next (or one `with agent.step()` block).
Micro-steps under gradient accumulation are summed. Everything here runs on the training
thread, so it only reads the clock, adds integers and appends a tuple: no locks, no I/O.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from syncscope.wire import DDP_GRAD_SYNC

DATA, FORWARD, BACKWARD, OPTIMIZER, COMM, PACING = range(6)
_now = time.perf_counter_ns


def first_grad_tensor(output: Any) -> Any:
    """The first tensor in a forward output that will receive a gradient, or None."""
    if getattr(output, "requires_grad", False) and hasattr(output, "register_hook"):
        return output
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            found = first_grad_tensor(item)
            if found is not None:
                return found
    return None


class PhaseClock:
    """Accumulates per-phase nanoseconds for the current step and emits one tuple per step.

    Emitted tuple: (step, end_ns, total_ns, data, forward, backward, optimizer, comm, pacing).
    `other` is derived later (total minus the rest) off the training thread.
    """

    def __init__(
        self,
        steps: deque,
        collectives: deque,
        queue_callback: Callable[[Callable[[], None]], None] | None,
        ddp_group: str | None,
        ddp_bytes: float,
        on_error: Callable[[BaseException], None],
    ) -> None:
        self.steps = steps
        self.collectives = collectives
        self.queue_callback = queue_callback
        self.ddp_group = ddp_group  # None when the model does not synchronise gradients
        self.ddp_bytes = ddp_bytes
        self.on_error = on_error
        self.acc = [0, 0, 0, 0, 0, 0]
        self.step = 0
        now = _now()
        self.step_start = now
        self.idle_since = now
        self.fwd_start = 0
        self.bwd_start = 0
        self.bwd_end = 0
        self.opt_start = 0
        self.bwd_pending = False
        self.manual_steps = False
        # Tail drop: a full queue refuses the new record and counts it. (Appending to a full
        # deque(maxlen) would evict the oldest instead, and "was it full?" checked before the
        # append races with the reporter's drain, so the count could be off.)
        self.dropped = 0
        self.steps_max = steps.maxlen or sys.maxsize
        self.coll_max = collectives.maxlen or sys.maxsize
        # Set by the agent when pacing is on: called at each step end with the step's exposed
        # wait (ns); returns the delay (ns) to insert before the next iteration.
        self.pacer: Callable[[int, int], int] | None = None

    # -- module hooks -------------------------------------------------------------------------
    def forward_pre(self, _module: Any, _args: Any) -> None:
        try:
            t = _now()
            if self.idle_since:
                self.acc[DATA] += t - self.idle_since
                self.idle_since = 0
            self.fwd_start = t
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self.on_error(exc)

    def forward_post(self, _module: Any, _args: Any, output: Any) -> None:
        try:
            t = _now()
            if self.fwd_start:
                self.acc[FORWARD] += t - self.fwd_start
                self.fwd_start = 0
            if self.queue_callback is not None and not self.bwd_pending:
                tensor = first_grad_tensor(output)
                if tensor is not None:
                    tensor.register_hook(self._backward_reached_output)
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _backward_reached_output(self, _grad: Any) -> None:
        try:
            if self.bwd_pending:
                return
            self.bwd_pending = True
            self.bwd_start = _now()
            self.queue_callback(self._backward_done)  # type: ignore[misc]
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _backward_done(self) -> None:
        # Callback A: all autograd work of this backward is done; DDP has not waited yet.
        try:
            t = _now()
            self.acc[BACKWARD] += t - self.bwd_start
            self.bwd_end = t
            if self.ddp_group is not None:
                self.queue_callback(self._gradients_reduced)  # type: ignore[misc]
            else:
                self.bwd_pending = False
                self.idle_since = t
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _gradients_reduced(self) -> None:
        # Callback B: DDP's finalize (queued between A and B) has waited for every bucket.
        try:
            t = _now()
            exposed = t - self.bwd_end
            self.acc[COMM] += exposed
            self.bwd_pending = False
            self.idle_since = t
            coll = self.collectives
            if len(coll) < self.coll_max:
                coll.append((DDP_GRAD_SYNC, self.ddp_group, self.ddp_bytes, exposed, self.step))
            else:
                self.dropped += 1
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    # -- optimizer hooks ----------------------------------------------------------------------
    def optimizer_pre(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        self.opt_start = _now()

    def optimizer_post(self, _opt: Any, _args: Any, _kwargs: Any) -> None:
        try:
            t = _now()
            if self.opt_start:
                self.acc[OPTIMIZER] += t - self.opt_start
                self.opt_start = 0
            if not self.manual_steps:
                self.end_step(t)
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    # -- step boundaries ----------------------------------------------------------------------
    def begin_manual_step(self) -> None:
        t = _now()
        if not self.manual_steps:
            self.manual_steps = True
            self.acc = [0, 0, 0, 0, 0, 0]
            self.step_start = t
            self.idle_since = t
        elif self.idle_since == 0:
            self.idle_since = t

    def end_step(self, t: int) -> None:
        acc = self.acc
        steps = self.steps
        total = t - self.step_start
        if len(steps) < self.steps_max:
            steps.append((self.step, t, total, *acc))
        else:
            self.dropped += 1
        self.step += 1
        self.acc = [0, 0, 0, 0, 0, 0]
        self.step_start = t
        self.idle_since = t
        pacer = self.pacer
        if pacer is not None:
            delay = pacer(acc[COMM], total)
            if delay > 0:
                time.sleep(delay / 1e9)
                after = _now()
                self.acc[PACING] = after - t
                self.idle_since = after
