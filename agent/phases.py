"""Training-thread phase clock: the boundaries its hooks report (phase_hooks.py), one tuple a step.

  data          previous step end (previous backward, optimizer step) -> forward pre-hook
  forward       entry -> return of the model's forward (wrapped on the instance); with forward
                hooks of its own (FSDP2's root, a user's): our first pre-hook -> our last hook
  backward      entry of torch.autograd.backward (wrapped; else the first parameter gradient)
                -> callback A, queued on the autograd engine by the first parameter gradient
  comm_exposed  A -> the wrapped backward's return, right after DDP's finalize waited for its
                buckets (another backward: callback B, which A queues), plus every wait for a
                collective the training thread is blocked in elsewhere, taken out of the phase
                it interrupted (collectives.Blocked)
  optimizer     optimizer step pre-hook -> post-hook
  pacing        the delay the pacing controller inserted at the step boundary
  other         the rest (loss, clipping, logging, checkpoint calls), so phases add up exactly
A step runs from one optimizer post-hook to the next (several optimizers: StepOfSeveral), or
is one `with agent.step()` block; micro-steps under gradient accumulation are summed, and a
DDP `no_sync()` micro-step emits no sync record. A step's work (samples, tokens) is what `agent.count` added, else the configured
numbers, else what its forwards' inputs show (agent/step_work.py). Step numbers start at
`attach(start_step=N)` or the optimizer's restored state (detect_start), so that they continue
across restarts. A split backward (zero-bubble schedules' torch.autograd.grad) is timed by
phase_hooks.timed_grad. Phase sampling (`phase_every` = N > 1): steps numbered a multiple of
N are timed, the same on every rank; the quiet steps between get the last timed step's shares
(estimate_phases); with a pacer, and for a process's first step, every step is timed.
On the training thread (or autograd's) this only reads the clock, adds and appends: no locks.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from syncscope.agent.grad_triggers import TRIGGERS, GradTriggers
from syncscope.agent.step_sink import (
    QUIET_ROW,
    ROW_PHASES,
    ROW_WORK,
    StepSink,
    estimate_phases,
    phase_shares,
)

from syncscope.wire import (
    DDP_GRAD_SYNC,
    EVENT_COMPILE,
    EVENT_STARTUP,
    NO_STEP,
    Phase,
)

__all__ = [
    "QUIET_ROW",
    "ROW_PHASES",
    "ROW_WORK",
    "BackwardPhases",
    "PhaseClock",
    "StepState",
    "estimate_phases",
    "phase_shares",
    "restored_step",
]

# Positions in the per-step accumulator, as plain ints: indexing a list with an IntEnum member
# costs an __index__ call on the hot path. `other` is not accumulated (see PhaseClock).
DATA = int(Phase.DATA)
FORWARD = int(Phase.FORWARD)
BACKWARD = int(Phase.BACKWARD)
OPTIMIZER = int(Phase.OPTIMIZER)
COMM = int(Phase.COMM_EXPOSED)
PACING = int(Phase.PACING)
ACC_LEN = PACING + 1  # the accumulator's length: DATA .. PACING
# The boundaries, as a subclass's `mark` hears of them (CudaPhaseClock records a CUDA event at
# each); on CPU `mark` is None and costs one attribute test per boundary.
STEP_START, FWD_PRE, FWD_POST, BWD_START, BWD_END, COMM_END, OPT_PRE, OPT_POST, STEP_END = range(9)
_now = time.perf_counter_ns


# The clock is one object in layers, each reading only its own state and the layers' below:
# StepSink (step_sink.py: the queues), StepState (the step's accumulator, where the clock
# stands, the step's waits), BackwardPhases (backward and DDP's exposed sync), PhaseClock
# (forward, the optimizer and the step's boundaries). One object, so that a hook's read of any
# of it stays one attribute lookup on the training thread.
class StepState(StepSink):
    """The current step: its per-phase nanoseconds (`acc`), its number, where the clock stands
    in it (the starts of the open phases), and its waits for collectives: the time the
    training thread was blocked (moved from the phase it interrupted to `comm`) and the step's
    first synchronising wait, which the pacer answers."""

    __slots__ = (
        "acc",
        "blocked",
        "blocked_seen",
        "first_at",
        "first_ddp_ns",
        "fwd_start",
        "idle_since",
        "mark",
        "on_error",
        "opt_closure",
        "opt_start",
        "pacer",
        "quiet",
        "step",
        "step_counter",
        "step_start",
        "sync_ns",
        "syncs",
    )

    def __init__(
        self,
        steps: deque,
        collectives: deque,
        ddp_group: str | None,
        ddp_bytes: float,
        on_error: Callable[[BaseException], None],
    ) -> None:
        super().__init__(steps, collectives, ddp_group, ddp_bytes)
        self.on_error = on_error
        self.acc = [0, 0, 0, 0, 0, 0]  # ns per phase, DATA .. PACING
        self.step = 0
        # The C++ collective kernel's copy of `step` (a ctypes integer), kept current here
        self.step_counter: Any = None
        t = _now()
        self.step_start = t
        self.idle_since = t
        self.fwd_start = 0
        self.opt_start = 0
        # A forward ran inside optimizer.step(closure) (Lightning's automatic optimization):
        # the closure's forward, backward and sync are theirs, the update after it the
        # optimizer's (from the closure's end).
        self.opt_closure = False
        # Phase sampling (module docstring): `quiet` while the current step's phases are not
        # timed.
        self.quiet = False
        # Called with each boundary's kind (FWD_PRE ... OPT_POST) right after the clock has
        # read it; STEP_END is the subclass's own (its end_step).
        self.mark: Callable[[int], None] | None = None
        # Set by the agent to its collective interceptor's Blocked: the training thread's time
        # blocked waiting for collectives (ns, only growing). Waiting is not compute: what
        # accrued since the last boundary moves from the phase that just ended to `comm`.
        self.blocked: Any = None
        self.blocked_seen = 0
        # DDP's exposed sync of this step when it was the step's first wait (ns), else -1; the
        # boundary that first saw a wait of this step (COMM_END: DDP's), else -1.
        self.first_ddp_ns = -1
        self.first_at = -1
        # Set by the agent when pacing is on (step_pacing.StepPacer.pace): called at each step
        # end with the step's exposed communication, its duration, its first synchronising
        # wait (ns; -1: none) and the boundary that saw it; returns the delay (ns) to insert
        # before the next iteration.
        self.pacer: Callable[..., int] | None = None
        # DDP's exposed sync recorded this step (ns) and how many.
        self.sync_ns = 0
        self.syncs = 0

    def start(self) -> None:
        """Nothing to start on CPU (CudaPhaseClock starts its resolver thread here)."""

    def stop(self, timeout: float = 0.5) -> None:
        """Nothing to finish on CPU (CudaPhaseClock resolves what the GPU has done)."""

    def take_blocked(self, boundary: int = STEP_END) -> int:
        """Time blocked in collectives since the last boundary (ns), now counted as exposed
        communication; the caller takes it out of the phase that just ended. `boundary` (the
        one the caller is at) is kept for the step's first wait: where in the step it was."""
        blocked = self.blocked
        if blocked is None:
            return 0
        ns = blocked.ns
        waited = ns - self.blocked_seen
        if waited:
            self.blocked_seen = ns
            self.acc[COMM] += waited
            if self.first_at < 0:
                self.first_at = boundary
        return waited

    def _forget_first_wait(self) -> None:
        """A new step: no wait of it seen yet, by DDP's sync or on the training thread."""
        self.first_ddp_ns = self.first_at = -1
        if self.blocked is not None:
            self.blocked.first_ns = -1

    def _pace(self, comm_ns: int, step_ns: int) -> int:
        """With a pacer: the delay (ns) to insert before the next step, its answer to this
        step's first synchronising wait: DDP's sync, or the first wait for a collective on the
        training thread, whichever came first, and the boundary that saw it (COMM_END: DDP's;
        STEP_END also for a wait inside a checkpoint). CudaPhaseClock answers from the GPU."""
        if self.first_ddp_ns >= 0:
            first, at = self.first_ddp_ns, COMM_END
        else:
            blocked = self.blocked
            first = blocked.first_ns if blocked is not None else -1
            at = self.first_at if self.first_at >= 0 else STEP_END
        return self.pacer(comm_ns, step_ns, first, at)  # type: ignore[misc]


class BackwardPhases(StepState):
    """Backward and DDP's exposed sync (see the module docstring): the hooks of
    phase_hooks.py, autograd's callbacks and the C++ trigger report here."""

    __slots__ = (
        "bwd_deferred",
        "bwd_depth",
        "bwd_end",
        "bwd_entry",
        "bwd_pending",
        "bwd_start",
        "ddp_model",
        "fwd_since_bwd",
        "grad_entry",
        "queue_callback",
        "sync_due",
        "triggers",
    )

    def __init__(
        self,
        steps: deque,
        collectives: deque,
        ddp_group: str | None,
        ddp_bytes: float,
        on_error: Callable[[BaseException], None],
        queue_callback: Callable[[Callable[[], None]], None] | None,
        ddp_model: Any,
    ) -> None:
        super().__init__(steps, collectives, ddp_group, ddp_bytes, on_error)
        self.queue_callback = queue_callback
        self.ddp_model = ddp_model  # its require_backward_grad_sync is False under no_sync()
        self.bwd_start = 0
        self.bwd_end = 0
        self.bwd_pending = False
        # DDP's sync is measured when the wrapped backward returns (set by callback A)
        self.sync_due = False
        # Backward bookkeeping (see the module docstring).
        self.bwd_depth = 0  # nesting of wrapped backward calls (reentrant checkpoint)
        self.bwd_entry = 0  # when the outermost wrapped backward was entered; 0 outside one
        self.bwd_deferred = False  # the trigger fired in a nested backward: queue A on return
        self.grad_entry = 0  # when a split backward's torch.autograd.grad was entered; 0: none
        self.fwd_since_bwd = False  # a forward ran and no trigger has fired since
        # The parameter gradients whose hooks start backward (phase_hooks.instrument sets
        # them to watch the model's).
        self.triggers = GradTriggers(self.grad_ready)

    def backward_exit(self) -> None:
        """What the torch.autograd.backward wrapper calls on return when its inline common case
        (the outermost backward, a trigger fired) does not apply."""
        try:
            depth = self.bwd_depth = self.bwd_depth - 1
            if depth == 1:
                self.triggers.resume()  # native mode: armed again for the outer backward
            if depth == 1 and self.bwd_deferred:
                # Back from a nested (reentrant checkpoint) backward into the outer one's
                # graph task: A queued now runs after the outer backward's autograd work.
                self.bwd_deferred = False
                self.queue_callback(self._backward_done)  # type: ignore[misc]
            elif depth <= 0:
                self.bwd_depth = 0
                self.bwd_entry = 0
                self.triggers.disarm()  # (native mode: no watched gradient may have come)
                if self.sync_due:
                    self.sync_due = False
                    self._gradients_reduced()
                if self.fwd_since_bwd and not self.triggers.output_hooks:
                    self.triggers.missed()  # grad_ready would have cleared fwd_since_bwd
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def grad_ready(self, param: Any) -> None:
        """Post-accumulate-grad hook: the first one in a backward starts the backward phase.

        A hook called while no backward runs starts nothing: a pipeline schedule reduces
        FSDP2's gradients after its backward passes (PipelineStage.perform_reduce_grad), and
        FSDP2 then calls the sharded parameters' hooks itself, outside autograd, where no
        callback can be queued. In a quiet step (phase sampling) it starts nothing either, nor
        inside a torch.autograd.grad that times itself (a split backward: timed_grad)."""
        try:  # (a try costs nothing until it catches: CPython 3.11's are zero-cost)
            triggers = self.triggers
            if (self.bwd_pending and triggers.learned is None) or self.quiet or self.grad_entry:
                return  # a later trigger of this backward (the common call), or not timed
            if not self.bwd_pending:
                if self.bwd_depth > 1:
                    self.bwd_deferred = True
                else:
                    try:
                        self.queue_callback(self._backward_done)  # type: ignore[misc]
                    except RuntimeError:  # "Final callbacks can only be installed during ..."
                        return
                self.bwd_pending = True
                self.fwd_since_bwd = False
                if self.bwd_entry:
                    self.bwd_start = self.bwd_entry
                else:  # a backward not run through torch.autograd.backward: it starts here
                    self.bwd_start = _now()
                    if self.mark is not None:
                        self.mark(BWD_START)
            learned = triggers.learned
            if learned is not None and len(learned) < TRIGGERS and param is not None:
                learned.append(param)
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def backward_returned(self) -> None:
        """The outermost backward returned, the C++ trigger armed at its entry (grad_triggers.py,
        native mode): grad_ready's and callback A's work, A at the moment the C++ callback ran,
        then B's. Waits for collectives in it count as before A: in a DDP backward only DDP's
        finalize runs after A, and it waits in C++, not through the training thread's Work.wait."""
        try:
            native = self.triggers.native
            done = native.bwd_done.value
            if done == self.bwd_end:  # no watched gradient came (missed: Python's hooks next)
                native.bwd_armed.value = 0
                self.backward_exit()
                return
            self.bwd_depth = 0
            self.fwd_since_bwd = False
            blocked = self.blocked
            waited = 0
            if blocked is not None and blocked.ns != self.blocked_seen:
                waited = self.take_blocked(BWD_END)
            ns = done - self.bwd_entry - waited
            if ns > 0:
                self.acc[BACKWARD] += ns
            self.bwd_entry = 0
            self.bwd_end = done
            if self.ddp_group is not None and getattr(
                self.ddp_model, "require_backward_grad_sync", True
            ):
                self._gradients_reduced()
            else:
                self.idle_since = done
                if self.opt_closure:  # the closure ends: the update after it is the optimizer's
                    self.opt_closure = False
                    self.opt_start = done
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _backward_done(self) -> None:
        # Callback A: all autograd work of this backward is done; DDP has not waited yet.
        try:
            t = _now()
            blocked = self.blocked
            waited = 0
            if blocked is not None and blocked.ns != self.blocked_seen:
                waited = self.take_blocked(BWD_END)
            ns = t - self.bwd_start - waited
            if ns > 0:
                self.acc[BACKWARD] += ns
            self.bwd_end = t
            triggers = self.triggers
            if triggers.learned is not None:  # (the first backward's: no call after it)
                triggers.learnt()
            if self.ddp_group is not None and getattr(
                self.ddp_model, "require_backward_grad_sync", True
            ):
                if self.bwd_depth == 1:
                    # Inside the wrapped torch.autograd.backward: it returns right after the
                    # engine's last callback (DDP's finalize, which waits for the buckets), so
                    # its return is B's moment without a second callback from C++.
                    self.sync_due = True
                else:
                    self.queue_callback(self._gradients_reduced)  # type: ignore[misc]
            else:
                self.bwd_pending = False
                self.idle_since = t
                if self.opt_closure:  # the closure ends: the update after it is the optimizer's
                    self.opt_closure = False
                    self.opt_start = t
            if self.mark is not None:
                self.mark(BWD_END)
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _gradients_reduced(self) -> None:
        # B (the wrapped backward's return, else callback B): DDP's finalize, queued between A
        # and B, has waited for every bucket.
        try:
            t = _now()
            exposed = t - self.bwd_end
            blocked = self.blocked
            if self.first_ddp_ns < 0 and (blocked is None or blocked.first_ns < 0):
                self.first_ddp_ns = exposed  # no wait of this step came before DDP's sync
                self.first_at = COMM_END
            waited = 0
            if blocked is not None and blocked.ns != self.blocked_seen:
                # DDP waits for its buckets in C++; a wait seen here too is in `exposed`
                waited = self.take_blocked(COMM_END)
            self.acc[COMM] += exposed - waited
            self.bwd_pending = False
            self.idle_since = t
            if self.opt_closure:  # the closure ends: the update after it is the optimizer's
                self.opt_closure = False
                self.opt_start = t
            coll = self.collectives
            if len(coll) < self.coll_max:
                # _sync_record's tuple, built here: one call fewer on every timed step
                coll.append((DDP_GRAD_SYNC, self.ddp_group, self.ddp_bytes, exposed, self.step))
            else:
                self.dropped += 1
            self.sync_ns += exposed
            self.syncs += 1
            if self.mark is not None:
                self.mark(COMM_END)
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)


class PhaseClock(BackwardPhases):
    """Accumulates per-phase nanoseconds for the current step and emits one tuple per step.

    Emitted tuple: (step, end_ns, total_ns, data, forward, backward, optimizer, comm, pacing,
    samples, tokens). `other` is derived later (total minus the rest) off the training thread.
    """

    __slots__ = (
        "after_at",
        "after_every",
        "after_step",
        "at_forward",
        "detect_start",
        "first_step",
        "manual_steps",
        "on_first_step",
        "outside_ns",
        "phase_every",
        "process_started_ns",
        "shares",
        "steps_open",
        "sync_share",
    )

    def __init__(
        self,
        steps: deque,
        collectives: deque,
        queue_callback: Callable[[Callable[[], None]], None] | None,
        ddp_group: str | None,
        ddp_bytes: float,
        on_error: Callable[[BaseException], None],
        ddp_model: Any = None,
    ) -> None:
        super().__init__(
            steps, collectives, ddp_group, ddp_bytes, on_error, queue_callback, ddp_model
        )
        self.manual_steps = False
        # Set by the agent to its transport's step hook: called on the training thread with
        # the step count after every `after_every`-th step has ended, the same steps on every
        # rank (shm_ring.py pumps there; transport.py decides whether to wake its thread).
        self.after_step: Callable[[int], int | None] | None = None
        self.after_every = 1
        # It returns the step-end time (perf_counter ns) before which it has nothing to do,
        # so that it is not called before then (transport.Reporter.at_step: its next tick).
        self.after_at = 0
        # Steps are open from instrument(optimizer) on (a step runs from one post-hook to the
        # next, the first from here), else from the first `with agent.step()`: a checkpoint
        # before that is in no step, and not part of the startup either.
        self.steps_open = False
        self.outside_ns = 0  # checkpoint time in no step before the first step
        self.first_step = True  # the first step's end queues the startup event
        # When the process started, on this clock (perf_counter ns); None: not known.
        self.process_started_ns: int | None = None
        # The optimizer whose restored state says the first step's number (Adam's "step"),
        # read once at the first optimizer step; None: the number was given, or no optimizer.
        self.detect_start: Any = None
        self.on_first_step: Callable[[], None] | None = None  # the agent's, after the first step
        # Phase sampling (module docstring): set by the agent; `shares` the last timed step's
        # phases over its total, `sync_share` its DDP sync's (None: it had none), for the
        # quiet steps' estimated records.
        self.phase_every = 1
        self.shares: list[float] | None = None
        self.sync_share: float | None = None
        # Set from another thread to what the training thread is to run at its next forward,
        # before the forward's own work (run_at_forward): a change to torch's global hooks,
        # which the training thread may be iterating anywhere else (NewOptimizer).
        self.at_forward: Callable[[], None] | None = None

    # -- forward ------------------------------------------------------------------------------
    def forward_began(self) -> None:
        """The forward phase starts (ForwardHooks' pre-hook): what the forward wrapper does
        inline on entry when the module has no hooks."""
        t = _now()
        waited = self.take_blocked(FWD_PRE)
        self._data_ends(t, waited)
        self.fwd_start = t
        if self.mark is not None:
            self.mark(FWD_PRE)

    def _data_ends(self, t: int, waited: int) -> None:
        """A forward starts at `t` (`waited` blocked since the clock last looked): data ends.
        Inside optimizer.step(closure) (an L-BFGS's, a SAM's; Lightning's) data ended at the
        step's start, and the time since (the update before the closure runs again) is the
        optimizer's."""
        idle, opt_start = self.idle_since, self.opt_start
        acc = self.acc
        if opt_start:
            # The waits since the clock last looked are not known to fall in either part: as
            # data's first (a collective before the step), the rest the optimizer's.
            data = opt_start - idle if idle and idle < opt_start else 0
            acc[DATA] += max(0, data - waited)
            acc[OPTIMIZER] += max(0, t - opt_start - max(0, waited - data))
            self.opt_start = 0
            self.opt_closure = True
        elif idle:
            acc[DATA] += max(0, t - idle - waited)
        self.idle_since = 0

    def run_at_forward(self) -> None:
        """At a forward, on the training thread: what `at_forward` asked for, once."""
        asked, self.at_forward = self.at_forward, None
        if asked is not None:
            try:
                asked()
            except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                self.on_error(exc)

    def forward_ended(self, out: Any) -> None:
        """The forward phase ends with output `out` (ForwardHooks' post-hook): what the forward
        wrapper does inline on return when the module has no hooks."""
        t = _now()
        if self.fwd_start:
            waited = self.take_blocked(FWD_POST)
            self.acc[FORWARD] += max(0, t - self.fwd_start - waited)
            self.fwd_start = 0
        self.fwd_since_bwd = True
        if self.triggers.output_hooks and not self.bwd_pending:
            self.triggers.hook_output(out)
        if self.mark is not None:
            self.mark(FWD_POST)

    # -- checkpoints and the step count ---------------------------------------------------------
    def checkpoint_done(self, kind: str, end: int, duration: int, waited: int) -> None:
        """A checkpoint call on the training thread ended at `end` after `duration` ns, `waited`
        of them blocked in collectives: one event queued, and the start of the phase it
        interrupted (and the blocked total) moves later by the call, so the step's total keeps
        the time in `other`. Moving a start costs nothing at the boundaries, unlike a second
        total read at each."""
        if self.fwd_start:
            self.fwd_start += duration
        elif self.idle_since:
            self.idle_since += duration
        elif self.opt_start:
            self.opt_start += duration
        if waited > 0:
            self.blocked_seen += waited  # the call's own waits are checkpoint time, not comm
        if self.steps_open:
            step = self.step
        else:
            step = NO_STEP
            self.outside_ns += duration
        self._event(kind, step, end, duration)

    def compile_done(self, end: int, duration: int) -> None:
        """A torch.compile compilation ended at `end` after `duration` ns, on any thread
        (agent/compiles.py): one event, in the step it fell in."""
        self._event(EVENT_COMPILE, self.step if self.steps_open else NO_STEP, end, duration)

    def _first_step_done(self, start: int) -> None:
        """The first step has ended; it started at `start`: queue the startup event."""
        self.first_step = False
        self.detect_start = None
        started = self.process_started_ns
        if started is not None:
            startup = start - started - self.outside_ns
            self._event(EVENT_STARTUP, NO_STEP, start, startup)
        if self.on_first_step is not None:
            self.on_first_step()

    def _detect_start_step(self) -> None:
        optimizers, self.detect_start = self.detect_start, None
        if self.step == 0:  # several optimizers: the one that has stepped least (a GAN's
            # generator, stepped once to its critic's five) steps once a training step
            self.step = min(map(restored_step, optimizers), default=0)
            if self.step_counter is not None:
                self.step_counter.value = self.step

    # -- optimizer hooks ----------------------------------------------------------------------
    def optimizer_pre(self, *_: Any) -> None:
        if self.quiet:  # never the first step, where detect_start is read
            return
        self.opt_start = _now()
        if self.detect_start is not None:
            try:
                self._detect_start_step()
            except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                self.on_error(exc)
        if self.mark is not None:
            try:
                self.mark(OPT_PRE)
            except BaseException as exc:  # noqa: BLE001
                self.on_error(exc)

    def optimizer_post(self, *_: Any) -> None:
        try:
            t = _now()
            if self.quiet and not self.manual_steps:  # the common call when sampling
                self._quiet_end(t, t - self.step_start)
            else:
                if self.manual_steps:  # the step ends later, at the `with agent.step()` exit
                    self._optimizer_stepped(t)
                    return
                if self.opt_start:
                    self._optimizer_time(t)
                self.end_step(t)  # a subclass's too (CudaPhaseClock), before the transport
            after = self.after_step
            if after is not None and t >= self.after_at and self.step % self.after_every == 0:
                self.after_at = after(self.step) or 0
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def optimizer_within(self, *_: Any) -> None:
        """The post-hook of an optimizer whose step does not end the training step (another
        optimizer's does: StepOfSeveral)."""
        try:
            self._optimizer_stepped(_now())
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _optimizer_stepped(self, t: int) -> None:
        """An optimizer's step ended at `t` within the training step: its time, and a forward
        after it starts its data phase here (a GAN's generator's, after its critic's step)."""
        if self.opt_start:
            self._optimizer_time(t)
            self.idle_since = t
        if self.mark is not None:
            self.mark(OPT_POST)

    def _optimizer_time(self, t: int) -> None:
        blocked = self.blocked
        waited = 0
        if blocked is not None and blocked.ns != self.blocked_seen:
            waited = self.take_blocked(OPT_POST)
        ns = t - self.opt_start - waited
        if ns > 0:
            self.acc[OPTIMIZER] += ns
        self.opt_start = 0

    # -- step boundaries ----------------------------------------------------------------------
    def begin_manual_step(self) -> None:
        t = _now()
        if not self.manual_steps:
            self.manual_steps = True
            self.steps_open = True
            # Forwards before the first marked step are no step's work (a user's count is),
            # nor are its waits.
            self.restart_step(t)
        elif self.idle_since == 0:
            self.idle_since = t

    def restart_step(self, t: int) -> None:
        """The open step is dropped, its phases, work and waits unreported, and the next one
        starts at `t` with the same number (its data phase from `t`)."""
        self.acc = [0, 0, 0, 0, 0, 0]
        self.fwd_start = self.opt_start = 0
        self.opt_closure = False
        self.sync_ns = self.syncs = 0
        self.step_start = self.idle_since = t
        self.work.forget_seen()
        self._forget_first_wait()
        if self.blocked is not None:
            self.blocked_seen = self.blocked.ns

    def end_step(self, t: int) -> None:
        total = t - self.step_start
        if self.quiet:
            self._quiet_end(t, total)
            return
        blocked = self.blocked
        if blocked is not None and blocked.ns != self.blocked_seen:
            self.take_blocked(STEP_END)  # waits outside the timed phases (loss, clipping): `other`
        acc = self.acc
        if self.phase_every > 1 and not self.first_step:  # the first step's are start-up's
            self.shares = phase_shares(acc, total)
            self.sync_share = self.sync_ns / total if self.syncs and total > 0 else None
        if self.syncs:
            self.sync_ns = self.syncs = 0
        self._queue_row(self.step, t, total, acc)
        self._next_step(t)
        self.acc = [0, 0, 0, 0, 0, 0]
        if self.first_step:
            self._first_step_done(t - total)
        delay = self._pace(acc[COMM], total) if self.pacer is not None else 0
        # A new step: no wait of it seen yet (_forget_first_wait, inline)
        self.first_ddp_ns = self.first_at = -1
        if blocked is not None:
            blocked.first_ns = -1
        if delay > 0:
            time.sleep(delay / 1e9)
            after = _now()
            self.acc[PACING] = after - t
            self.idle_since = after

    def _quiet_end(self, t: int, total: int) -> None:
        """A quiet step ends: its row queued as it is (QUIET_ROW: the last timed step's shares
        and sync share in place of phases, which `finish` estimates off the training thread),
        and the next step, in one frame: nothing was added to `acc` (every hook returned at
        once), its waits are not timed, and there is no pacer (a pacer times every step)."""
        blocked = self.blocked
        if blocked is not None:
            self.blocked_seen = blocked.ns
        step = self.step
        steps = self.steps
        samples, tokens = self.work.take()  # the dropped step's work must not count either
        if len(steps) < self.steps_max:
            steps.append((step, t, total, self.shares, self.sync_share, samples, tokens))
        else:  # with the sync record `finish` would have made for it
            self.dropped += 1 if self.sync_share is None else 2
        step += 1  # _next_step, inline: a quiet step's successor is timed only at a multiple
        self.step = step
        if self.step_counter is not None:
            self.step_counter.value = step
        if step % self.phase_every == 0:
            self.quiet = False
            self._forget_first_wait()  # the next step is timed: no wait of it seen yet
        self.step_start = self.idle_since = t

    def _next_step(self, t: int) -> None:
        """The next step starts at `t`: its number, and whether its phases are timed."""
        step = self.step = self.step + 1
        if self.step_counter is not None:
            self.step_counter.value = step
        every = self.phase_every
        if every > 1:
            self.quiet = step % every != 0 and self.pacer is None and self.shares is not None
        else:
            self.quiet = False
        self.step_start = t
        self.idle_since = t


def restored_step(optimizer: Any) -> int:
    """The steps an optimizer's restored state says it has taken (the `step` an Adam-family
    optimizer keeps per parameter), 0 where it says none: no state yet, no `step` in it, or a
    step held where reading it could synchronise a device or a process group (only plain
    numbers and one-element CPU tensors are read)."""
    state = getattr(optimizer, "state", None)
    if not state:
        return 0
    for per_param in state.values():
        if not isinstance(per_param, dict):
            continue
        value: Any = per_param.get("step")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return max(0, int(value))
        torch = sys.modules.get("torch")
        if (
            torch is not None
            and type(value) is torch.Tensor
            and value.device.type == "cpu"
            and value.numel() == 1
        ):
            return max(0, int(value.item()))
        return 0
    return 0
