"""Training-thread phase clock: timestamps at phase boundaries, summed into one tuple per step.

  data          previous step end (or previous backward) -> forward pre-hook
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
A step runs from one optimizer post-hook to the next (or one `with agent.step()` block);
micro-steps under gradient accumulation are summed, and a DDP `no_sync()` micro-step emits no
sync record. A step's work (samples, tokens) is what `agent.count` added, else the configured
numbers, else what its forwards' inputs show (count_inputs). Step numbers start at
`attach(start_step=N)` or the optimizer's restored state (detect_start), so that they continue
across restarts. A split backward (zero-bubble schedules' torch.autograd.grad) is timed by
timed_grad. Phase sampling (`phase_every` = N > 1): only steps whose number is a multiple of N
are timed, the same on every rank; the quiet steps between get the last timed step's shares
(estimate_phases); with a pacer, and for a process's first step, every step is timed.
On the training thread (or autograd's) this only reads the clock, adds and appends: no locks.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from syncscope.wire import (
    DDP_GRAD_SYNC,
    EVENT_COMPILE,
    EVENT_STARTUP,
    MAX_WORK,
    NO_STEP,
    UNKNOWN_WORK,
    Phase,
)

# Positions in the per-step accumulator, as plain ints: indexing a list with an IntEnum member
# costs an __index__ call on the hot path. `other` is not accumulated (see PhaseClock).
DATA = int(Phase.DATA)
FORWARD = int(Phase.FORWARD)
BACKWARD = int(Phase.BACKWARD)
OPTIMIZER = int(Phase.OPTIMIZER)
COMM = int(Phase.COMM_EXPOSED)
PACING = int(Phase.PACING)
# A step row is (step, end_ns, total_ns, *accumulated phases, samples, tokens): where the
# phases start and where the work counts start (wire.StepRowWithWork).
ROW_PHASES = 3
ROW_WORK = 9
# The boundaries, as a subclass's `mark` hears of them (CudaPhaseClock records a CUDA event at
# each); on CPU `mark` is None and costs one attribute test per boundary.
STEP_START, FWD_PRE, FWD_POST, BWD_START, BWD_END, COMM_END, OPT_PRE, OPT_POST, STEP_END = range(9)
# Backward ends at the first parameter gradient's post-accumulate-grad hook, registered once
# and cheap when it fires, rather than a hook on the forward output registered every step
# (bench/bench_hook_costs.py). The first backward learns which parameters' gradients come
# first; then only TRIGGERS of them keep a hook. It watches the last LEARN_WINDOW trainable
# parameters only (gradients come roughly in reverse order of registration): a parameter keeps
# paying for a hook after the hook is removed (torch leaves its tensor's C++ hook in place and
# calls it, on an empty dict, every backward), so watching all of them once cost every step a
# call per parameter tensor for good (docs/evaluation.md). A backward after a forward
# in which none fires (conditional compute, or the window's parameters unused) learns again
# over twice the window; after RELEARN_LIMIT such misses (gradients assigned, as FSDP does, or
# another model's backward) the clock falls back to the forward output's hook: dearer, but it
# needs no parameter.
TRIGGERS = 2  # parameters whose gradients come first, hooked after learning
LEARN_WINDOW = 8  # the trainable parameters, counted from the last, the first learning watches
RELEARN_LIMIT = 16
_now = time.perf_counter_ns


class PhaseClock:
    """Accumulates per-phase nanoseconds for the current step and emits one tuple per step.

    Emitted tuple: (step, end_ns, total_ns, data, forward, backward, optimizer, comm, pacing,
    samples, tokens). `other` is derived later (total minus the rest) off the training thread.
    """

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
        self.steps = steps
        self.collectives = collectives
        self.queue_callback = queue_callback
        self.ddp_group = ddp_group  # None when the model does not synchronise gradients
        self.ddp_bytes = ddp_bytes
        self.ddp_model = ddp_model  # its require_backward_grad_sync is False under no_sync()
        self.on_error = on_error
        self.acc = [0, 0, 0, 0, 0, 0]  # ns per phase, DATA .. PACING
        self.step = 0
        # The C++ collective kernel's copy of `step` (a ctypes integer), kept current here
        self.step_counter: Any = None
        now = _now()
        self.step_start = now
        self.idle_since = now
        self.fwd_start = 0
        self.bwd_start = 0
        self.bwd_end = 0
        self.opt_start = 0
        # A forward ran inside optimizer.step(closure) (Lightning's automatic optimization):
        # the closure's forward, backward and sync are theirs, the update after it the
        # optimizer's (from the closure's end).
        self.opt_closure = False
        self.bwd_pending = False
        # DDP's sync is measured when the wrapped backward returns (set by callback A)
        self.sync_due = False
        self.manual_steps = False
        # Backward bookkeeping (see the module docstring).
        self.bwd_depth = 0  # nesting of wrapped backward calls (reentrant checkpoint)
        self.bwd_entry = 0  # when the outermost wrapped backward was entered; 0 outside one
        self.bwd_deferred = False  # the trigger fired in a nested backward: queue A on return
        self.grad_entry = 0  # when a split backward's torch.autograd.grad was entered; 0: none
        self.fwd_since_bwd = False  # a forward ran and no trigger has fired since
        self.misses = 0  # backwards after a forward of the model in which no trigger fired
        # Fallback when parameter hooks cannot see this model's gradients (they are assigned,
        # not accumulated, as FSDP does): a hook on the forward output, registered every step.
        self.output_hooks = False
        self._handles: list[Any] = []
        self._params: list[Any] = []
        self._grad_hooks: dict[int, Any] = {}
        self._learned: list[Any] | None = None  # parameters in the order their gradients came
        self._watched = 0  # how many of _params, from the last, learning has watched
        # Tail drop: a full queue refuses the new record and counts it. (Appending to a full
        # deque(maxlen) would evict the oldest instead, and "was it full?" checked before the
        # append races with the reporter's drain, so the count could be off.)
        self.dropped = 0
        self.steps_max = steps.maxlen or sys.maxsize
        self.coll_max = collectives.maxlen or sys.maxsize
        # Set by the agent when pacing is on (step_pacing.StepPacer.pace): called at each step
        # end with the step's exposed communication, its duration, its first synchronising
        # wait (ns; -1: none) and the boundary that saw it; returns the delay (ns) to insert
        # before the next iteration.
        self.pacer: Callable[..., int] | None = None
        # DDP's exposed sync of this step when it was the step's first wait (ns), else -1; the
        # boundary that first saw a wait of this step (COMM_END: DDP's), else -1.
        self.first_ddp_ns = -1
        self.first_at = -1
        # Set by the agent to its transport's step hook: called on the training thread with
        # the step count after every `after_every`-th step has ended, the same steps on every
        # rank (shm_ring.py pumps there; transport.py decides whether to wake its thread).
        self.after_step: Callable[[int], None] | None = None
        self.after_every = 1
        # Called with each boundary's kind (FWD_PRE ... OPT_POST) right after the clock has
        # read it; STEP_END is the subclass's own (its end_step).
        self.mark: Callable[[int], None] | None = None
        # Set by the agent to its collective interceptor's Blocked: the training thread's time
        # blocked waiting for collectives (ns, only growing). Waiting is not compute: what
        # accrued since the last boundary moves from the phase that just ended to `comm`.
        self.blocked: Any = None
        self.blocked_seen = 0
        # Work per step (the module docstring): counted by the user this step, configured per
        # step, seen in the model's inputs. -1: none of that. `inputs` is what the forward
        # wrapper reads them with (count_inputs), None while nothing is read.
        self.inputs: tuple[Any, frozenset[Any], str, Callable[[], bool]] | None = None
        self.samples_per_step = UNKNOWN_WORK
        self.tokens_per_step = UNKNOWN_WORK
        self.counted_samples = UNKNOWN_WORK
        self.counted_tokens = UNKNOWN_WORK
        self.seen_batches = 0  # forwards this step whose batch was a tensor with a batch dim
        self.seen_samples = 0
        self.seen_tokens = 0
        self.unclear_samples = False  # a forward this step had no such batch
        self.unclear_tokens = False  # ... or one that was not a token tensor
        # Events (startup, checkpoints: wire.EventRow), set by the agent to its events queue.
        self.events: deque | None = None
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
        # Phase sampling (module docstring): set by the agent; `quiet` while the current step's
        # phases are not timed, `shares` the last timed step's phases over its total.
        self.phase_every = 1
        self.quiet = False
        self.shares: list[float] | None = None
        # DDP's exposed sync recorded this step (ns) and how many; the last timed step's as a
        # share of its total (None: it had none), for the quiet steps' estimated records.
        self.sync_ns = 0
        self.syncs = 0
        self.sync_share: float | None = None

    # -- wiring -------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start on CPU (CudaPhaseClock starts its resolver thread here)."""

    def stop(self, timeout: float = 0.5) -> None:
        """Nothing to finish on CPU (CudaPhaseClock resolves what the GPU has done)."""

    def instrument(self, model: Any = None, optimizer: Any = None) -> None:
        """Hook `model` (forward, parameter gradients, torch.autograd.backward) and `optimizer`.

        `model`: a module, or a list of them (a pipeline rank's stages, each called apart):
        every one's forward is the forward phase; the batch is read from the first one's
        inputs only (the rank's first stage: later stages see the same samples again)."""
        handles = self._handles
        parts = parts_of(model)
        for i, part in enumerate(parts):
            hooks = ForwardHooks.of(self, part)
            timed = functools.partial(self.timed_forward, hooks=hooks)
            handles.append(wrap_forward(part, timed, count=i == 0))
            if hooks is not None:
                handles.append(hooks)
                hooks.follow()  # the module's hooks so far (FSDP2's): ours around them
        if parts and self.queue_callback is not None:
            # Every trainable parameter is hooked until the first backward shows which
            # gradients come first.
            self._params = [p for m in parts for p in m.parameters() if p.requires_grad]
            self._learn()
            install_backward(self)
        if optimizer is not None:
            handles.append(optimizer.register_step_pre_hook(self.optimizer_pre))
            handles.append(optimizer.register_step_post_hook(self.optimizer_post))
            self.steps_open = True

    def count_inputs(self, torch: Any, batch_argument: str) -> None:
        """Read each forward's batch size (and tokens) from the model's inputs from now on.

        From shapes alone (no tensor data, nothing dynamo could trace): the leading dimension of
        forward's first positional argument (else of the keyword `batch_argument`) is the batch,
        and an int32/int64 tensor of two dimensions holds tokens (batch x sequence). Only
        forwards with gradients enabled count (micro-batches add up). A batch that is not a
        tensor with a leading dimension makes the step's samples unknown (-1), and its tokens
        too unless every batch was a token tensor: no number rather than a guess."""
        self.inputs = (
            torch.Tensor,
            frozenset((torch.int64, torch.int32)),
            batch_argument,
            torch.is_grad_enabled,
        )

    def count(self, samples: int | None, tokens: int | None) -> None:
        """Add work to the current step (what `agent.count` calls); it replaces the step's
        configured and detected numbers. Negative numbers are ignored; sums stop at the wire's
        MAX_WORK (beyond it the exporter would refuse the whole batch)."""
        if samples is not None and samples >= 0:
            self.counted_samples = min(MAX_WORK, max(0, self.counted_samples) + int(samples))
        if tokens is not None and tokens >= 0:
            self.counted_tokens = min(MAX_WORK, max(0, self.counted_tokens) + int(tokens))

    def _work(self) -> tuple[int, int]:
        """This step's (samples, tokens), UNKNOWN_WORK where not known; resets the counts."""
        samples, tokens = self.counted_samples, self.counted_tokens
        seen = self.seen_batches
        if samples < 0:
            samples = self.samples_per_step
            if samples < 0 and seen and not self.unclear_samples:
                samples = self.seen_samples
        else:
            self.counted_samples = UNKNOWN_WORK
        if tokens < 0:
            tokens = self.tokens_per_step
            if tokens < 0 and seen and not self.unclear_tokens:
                tokens = self.seen_tokens
        else:
            self.counted_tokens = UNKNOWN_WORK
        if seen or self.unclear_samples:
            self._forget_seen()
        return samples, tokens

    def _forget_seen(self) -> None:
        """Forget the batches the forward wrapper has seen since the last step ended."""
        self.seen_batches = self.seen_samples = self.seen_tokens = 0
        self.unclear_samples = self.unclear_tokens = False

    def uninstrument(self) -> None:
        """Remove every hook `instrument` added. Safe to call twice."""
        uninstall_backward(self)
        for handle in self._handles:
            with contextlib.suppress(Exception):
                handle.remove()
        self._handles.clear()
        self._drop_grad_hooks()

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

    # -- forward ------------------------------------------------------------------------------
    def timed_forward(
        self, original: Callable[..., Any], count: bool = True, hooks: ForwardHooks | None = None
    ) -> Callable[..., Any]:
        """`original` (a model's forward) timed as the forward phase, in the one frame that
        calls it: every extra Python call on the hot path runs on caches the step's kernels
        have flushed, ~2-6 µs each on a 10 ms CPU step (bench_agent_overhead.py --sizes).
        `count`: read the batch from its inputs (count_inputs), else not. `hooks`: the module's
        ForwardHooks, which time the phase instead while the module has forward hooks (a dict
        test per call here while it has none)."""
        clock = self
        module = hooks.module if hooks is not None else None
        global_post = hooks.global_post if hooks is not None else None

        def forward(*args: Any, **kwargs: Any) -> Any:
            quiet = clock.quiet  # a step whose phases are not timed: only its batch is read
            own = not quiet  # this call times the phase (not quiet, no hook of ours does)
            try:
                if (
                    own
                    and module is not None
                    and (module._forward_pre_hooks or module._forward_hooks or global_post)
                ):
                    own = hooks.entered()  # type: ignore[union-attr]
                if own:
                    t = _now()
                    blocked = clock.blocked
                    waited = 0
                    if blocked is not None and blocked.ns != clock.blocked_seen:
                        waited = clock.take_blocked(FWD_PRE)
                    idle = clock.idle_since
                    if idle:
                        ns = t - idle - waited
                        if ns > 0:
                            clock.acc[DATA] += ns
                        clock.idle_since = 0
                    if clock.opt_start:  # inside optimizer.step(closure)
                        clock.opt_start = 0
                        clock.opt_closure = True
                    clock.fwd_start = t
                    if clock.mark is not None:
                        clock.mark(FWD_PRE)
                inputs = clock.inputs if count else None
                if inputs is not None and inputs[3]():  # shapes only: what the batch holds
                    x: Any = args[0] if args else kwargs.get(inputs[2])
                    shape = x.shape if isinstance(x, inputs[0]) else None
                    if shape:
                        clock.seen_batches += 1
                        clock.seen_samples += shape[0]
                        if len(shape) == 2 and x.dtype in inputs[1]:
                            clock.seen_tokens += shape[0] * shape[1]
                        else:
                            clock.unclear_tokens = True
                    else:
                        clock.unclear_samples = clock.unclear_tokens = True
            except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                clock.on_error(exc)
            out = _call_traced(original, *args, **kwargs)
            if not own:
                return out
            try:
                t = _now()
                start = clock.fwd_start
                if start:
                    blocked = clock.blocked
                    waited = 0
                    if blocked is not None and blocked.ns != clock.blocked_seen:
                        waited = clock.take_blocked(FWD_POST)
                    ns = t - start - waited
                    if ns > 0:
                        clock.acc[FORWARD] += ns
                    clock.fwd_start = 0
                clock.fwd_since_bwd = True
                if clock.output_hooks and not clock.bwd_pending:  # (rare: see _missed)
                    tensor = first_grad_tensor(out)
                    if tensor is not None:
                        tensor.register_hook(clock._output_reached)
                if clock.mark is not None:
                    clock.mark(FWD_POST)
            except BaseException as exc:  # noqa: BLE001
                clock.on_error(exc)
            return out

        return forward

    def forward_began(self) -> None:
        """The forward phase starts (ForwardHooks' pre-hook): what the forward wrapper does
        inline on entry when the module has no hooks."""
        t = _now()
        waited = self.take_blocked(FWD_PRE)
        idle = self.idle_since
        if idle:
            self.acc[DATA] += max(0, t - idle - waited)
            self.idle_since = 0
        if self.opt_start:  # inside optimizer.step(closure)
            self.opt_start = 0
            self.opt_closure = True
        self.fwd_start = t
        if self.mark is not None:
            self.mark(FWD_PRE)

    def forward_ended(self, out: Any) -> None:
        """The forward phase ends with output `out` (ForwardHooks' post-hook): what the forward
        wrapper does inline on return when the module has no hooks."""
        t = _now()
        if self.fwd_start:
            waited = self.take_blocked(FWD_POST)
            self.acc[FORWARD] += max(0, t - self.fwd_start - waited)
            self.fwd_start = 0
        self.fwd_since_bwd = True
        if self.output_hooks and not self.bwd_pending:
            tensor = first_grad_tensor(out)
            if tensor is not None:
                tensor.register_hook(self._output_reached)
        if self.mark is not None:
            self.mark(FWD_POST)

    # -- backward -----------------------------------------------------------------------------
    def _learn(self) -> None:
        """Watch the last LEARN_WINDOW parameters (twice as many as the last time, when learning
        again) for the first gradients of the next backward."""
        seen = set(self._grad_hooks)
        self._learned = []
        self._watched = max(LEARN_WINDOW, 2 * self._watched)
        for p in self._params[-self._watched :]:
            if id(p) not in seen and p.is_leaf:
                seen.add(id(p))
                self._grad_hooks[id(p)] = _grad_hook(p, self.grad_ready)

    def _drop_grad_hooks(self, keep: Iterable[Any] = ()) -> None:
        kept = {id(p) for p in keep}
        for key in [k for k in self._grad_hooks if k not in kept]:
            with contextlib.suppress(Exception):
                self._grad_hooks.pop(key).remove()

    def backward_exit(self) -> None:
        """What the torch.autograd.backward wrapper calls on return when its inline common case
        (the outermost backward, a trigger fired) does not apply."""
        try:
            depth = self.bwd_depth = self.bwd_depth - 1
            if depth == 1 and self.bwd_deferred:
                # Back from a nested (reentrant checkpoint) backward into the outer one's
                # graph task: A queued now runs after the outer backward's autograd work.
                self.bwd_deferred = False
                self.queue_callback(self._backward_done)  # type: ignore[misc]
            elif depth <= 0:
                self.bwd_depth = 0
                self.bwd_entry = 0
                if self.sync_due:
                    self.sync_due = False
                    self._gradients_reduced()
                if self.fwd_since_bwd and not self.output_hooks:
                    self._missed()  # grad_ready would have cleared fwd_since_bwd
        except BaseException as exc:  # noqa: BLE001
            self.on_error(exc)

    def _missed(self) -> None:
        # The model ran forward, then a backward in which no hooked parameter got a gradient:
        # conditional compute skipped the triggers (learn again), or no parameter hook can see
        # this model's gradients at all (fall back to hooking the output).
        self.misses += 1
        if self.misses <= RELEARN_LIMIT and self._params:
            self._learn()
        else:
            self.output_hooks = True
            self._drop_grad_hooks()
            self._learned = None

    def _output_reached(self, _grad: Any) -> None:
        self.grad_ready(None)

    def grad_ready(self, param: Any) -> None:
        """Post-accumulate-grad hook: the first one in a backward starts the backward phase.

        A hook called while no backward runs starts nothing: a pipeline schedule reduces
        FSDP2's gradients after its backward passes (PipelineStage.perform_reduce_grad), and
        FSDP2 then calls the sharded parameters' hooks itself, outside autograd, where no
        callback can be queued. In a quiet step (phase sampling) it starts nothing either, nor
        inside a torch.autograd.grad that times itself (a split backward: timed_grad)."""
        if (self.bwd_pending and self._learned is None) or self.quiet or self.grad_entry:
            return  # a later trigger of this backward (the common call), or not timed
        try:
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
            learned = self._learned
            if learned is not None and len(learned) < TRIGGERS and param is not None:
                learned.append(param)
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
            if self._learned is not None:
                # After autograd's work: no hook is removed while the engine may call it.
                self._drop_grad_hooks(keep=self._learned)
                self._learned = None
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

    def _event(self, kind: str, step: int, end: int, duration: int) -> None:
        events = self.events
        if events is None:
            return
        if len(events) < (events.maxlen or sys.maxsize):
            events.append((kind, step, end, max(0, duration)))
        else:
            self.dropped += 1

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
        optimizer, self.detect_start = self.detect_start, None
        if self.step == 0:
            self.step = restored_step(optimizer)
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
            self.mark(OPT_PRE)

    def optimizer_post(self, *_: Any) -> None:
        try:
            t = _now()
            if self.opt_start:
                blocked = self.blocked
                waited = 0
                if blocked is not None and blocked.ns != self.blocked_seen:
                    waited = self.take_blocked(OPT_POST)
                ns = t - self.opt_start - waited
                if ns > 0:
                    self.acc[OPTIMIZER] += ns
                self.opt_start = 0
            if self.manual_steps:  # the step ends later, at the `with agent.step()` exit
                if self.mark is not None:
                    self.mark(OPT_POST)
            else:
                self.end_step(t)  # a subclass's too (CudaPhaseClock), before the transport
                after = self.after_step
                if after is not None and self.step % self.after_every == 0:
                    after(self.step)
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
            self.steps_open = True
            # Forwards before the first marked step are no step's work (a user's count is).
            self._forget_seen()
            self._forget_first_wait()
            if self.blocked is not None:  # waits before the first step are no step's
                self.blocked_seen = self.blocked.ns
        elif self.idle_since == 0:
            self.idle_since = t

    def end_step(self, t: int) -> None:
        total = t - self.step_start
        if self.quiet:  # its phases from the last timed step's shares; its waits are not timed
            if self.blocked is not None:
                self.blocked_seen = self.blocked.ns
            self._queue_row(t, total, estimate_phases(self.shares, total))
            if self.sync_share is not None:
                self._estimated_sync(int(self.sync_share * total))
            # Nothing was added to `acc` (every hook returned at once) and there is no pacer.
            self._next_step(t)
            if not self.quiet:  # the next step is timed: no wait of it seen yet
                self._forget_first_wait()
            return
        blocked = self.blocked
        if blocked is not None and blocked.ns != self.blocked_seen:
            self.take_blocked(STEP_END)  # waits outside the timed phases (loss, clipping): `other`
        acc = self.acc
        if self.phase_every > 1:
            self.shares = phase_shares(acc, total)
            self.sync_share = self.sync_ns / total if self.syncs and total > 0 else None
        if self.syncs:
            self.sync_ns = self.syncs = 0
        self._queue_row(t, total, acc)
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

    def _queue_row(self, t: int, total: int, phases: list[int]) -> None:
        """The ending step's row: its end, total, `phases` and work (the work read either way)."""
        steps = self.steps
        if len(steps) < self.steps_max:
            samples, tokens = self._work()
            a, b, c, d, e, f = phases
            steps.append((self.step, t, total, a, b, c, d, e, f, samples, tokens))
        else:
            self._work()  # the dropped step's work must not count in the next one
            self.dropped += 1

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

    def _estimated_sync(self, ns: int) -> None:
        """A quiet step's DDP sync record: an estimate, where its timed step had a sync."""
        coll = self.collectives
        if len(coll) < self.coll_max:
            coll.append(self._sync_record(self.step, ns))
        else:
            self.dropped += 1

    def _sync_record(self, step: int, ns: int = 0) -> tuple:
        """DDP's sync in `step`, `ns` long, as the collectives queue holds it."""
        return (DDP_GRAD_SYNC, self.ddp_group, self.ddp_bytes, ns, step)

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


class ForwardHooks:
    """The forward phase of a module that has forward hooks, timed from a pre-hook of ours that
    runs first to a post-hook of ours that runs last (always_call): nn.Module.__call__ runs its
    hooks outside `forward` (FSDP2's root pre-forward, with its all-gathers; a user's hook), so
    the forward wrapper alone would leave their time in data (pre-hooks) or in `other`
    (post-hooks). A module without hooks keeps the wrapper alone: registering ours would send
    every call through nn.Module's slow path (wrap_forward).

    `follow()` at instrument time registers the pair when the module has hooks; hooks added
    later are seen by the forward wrapper (a dict test per call), which registers the pair for
    the next call (that call's pre-hooks, already run, stay data). While registered, the
    pre-hook keeps ours first and last when a hook was added around them since (up to
    MAX_MOVES times: another library that wants the same place wins), and removes the pair
    once only ours are left. Global forward pre-hooks (register_module_forward_pre_hook) run
    before any module's, ours too: their time on this module stays data. A direct
    `model.forward(x)` call runs no hooks: the wrapper times it.
    """

    MAX_MOVES = 8

    def __init__(self, clock: PhaseClock, module: Any, global_post: dict) -> None:
        self.clock = clock
        self.module: Any = module  # None once removed
        self.global_post = global_post  # torch's global forward hooks (run before the module's)
        self.handles: tuple[Any, ...] = ()
        self.started = False  # our pre-hook started the phase; our post-hook has not ended it
        self.moves = 0
        # What nn.Module calls: left out of torch.compile's tracing with all they call (the
        # clock's reads; nothing of the model's)
        self._pre_hook = _never_traced(self._pre)
        self._post_hook = _never_traced(self._post)

    @staticmethod
    def of(clock: PhaseClock, module: Any) -> ForwardHooks | None:
        """A module's ForwardHooks; None for an object with no nn.Module hooks to follow."""
        try:
            from torch.nn.modules import module as nn_module

            global_post = nn_module._global_forward_hooks
        except (ImportError, AttributeError):
            return None
        if not (
            isinstance(getattr(module, "_forward_pre_hooks", None), dict)
            and isinstance(getattr(module, "_forward_hooks", None), dict)
            and hasattr(module, "register_forward_pre_hook")
        ):
            return None
        return ForwardHooks(clock, module, global_post)

    def wanted(self) -> bool:
        module = self.module
        return module is not None and bool(
            module._forward_pre_hooks or module._forward_hooks or self.global_post
        )

    def follow(self) -> None:
        """Register the pair if the module has hooks (and it is not registered)."""
        if not self.handles and self.wanted():
            self._register()

    def entered(self) -> bool:
        """The forward wrapper was called while the module has hooks: whether it times this
        call itself (no pre-hook of ours started the phase); the pair is registered for the
        next call if it is not."""
        if self.started:
            return False
        module = self.module
        if module is not None and (
            not self.handles or self.handles[0].id not in module._forward_pre_hooks
        ):
            self._unregister()  # ours were cleared from under us, or never registered
            self._register()
        return True

    def remove(self) -> None:
        self._unregister()
        self.module = None

    def _register(self) -> None:
        module = self.module
        pre = module.register_forward_pre_hook(self._pre_hook, prepend=True)
        post = module.register_forward_hook(self._post_hook, always_call=True)
        self.handles = (pre, post)

    def _unregister(self) -> None:
        for handle in self.handles:
            with contextlib.suppress(Exception):
                handle.remove()
        self.handles = ()
        self.started = False

    def _pre(self, module: Any, _args: Any) -> None:
        clock = self.clock
        if not self.handles:  # removed while nn.Module was calling the hooks it had
            return
        try:
            pre_hooks, post_hooks = module._forward_pre_hooks, module._forward_hooks
            if len(pre_hooks) == 1 and len(post_hooks) == 1 and not self.global_post:
                self._unregister()  # only ours are left: the wrapper times this call and on
                return
            pre, post = self.handles
            if (
                next(iter(pre_hooks)) != pre.id or next(reversed(post_hooks)) != post.id
            ) and self.moves < self.MAX_MOVES:
                self.moves += 1  # a hook added around ours: ours first and last again
                self._unregister()
                self._register()
            if not clock.quiet:
                clock.forward_began()
                self.started = True
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            clock.on_error(exc)

    def _post(self, _module: Any, _args: Any, out: Any) -> None:
        if not self.started:
            return
        self.started = False
        try:
            self.clock.forward_ended(out)
        except BaseException as exc:  # noqa: BLE001
            self.clock.on_error(exc)


class _ForwardWrapper:
    """The handle of wrap_forward: `remove()` undoes it, unless someone wrapped on top of it."""

    def __init__(self, model: Any, wrapper: Any, had_own: bool, original: Any) -> None:
        self.model, self.wrapper, self.had_own, self.original = model, wrapper, had_own, original

    def remove(self) -> None:
        model = self.model
        if model is None or model.__dict__.get("forward") is not self.wrapper:
            return
        if self.had_own:
            model.__dict__["forward"] = self.original
        else:
            del model.__dict__["forward"]
        self.model = None


def parts_of(model: Any) -> list[Any]:
    """The modules of `model` as the clock takes it: none, one, or a list of them."""
    return model if isinstance(model, list) else [] if model is None else [model]


def wrap_forward(model: Any, timed: Callable[..., Callable[..., Any]], count: bool = True) -> Any:
    """Time `model`'s forward by wrapping it on the instance (as accelerate does): its forward
    becomes `timed(original, count)` (PhaseClock.timed_forward).

    Not register_forward_(pre_)hook: any module hook sends every call through nn.Module's slow
    path, several times the wrapper's cost per step (bench/bench_hook_costs.py measures both).
    Only a module that has forward hooks anyway (which nn.Module runs outside `forward`) is
    timed by hooks of ours around them (ForwardHooks).
    An exception in forward passes through untouched (the next forward restarts the phase).
    """
    had_own = "forward" in model.__dict__
    original = model.forward
    forward = _not_traced(functools.wraps(original)(timed(original, count)))
    model.__dict__["forward"] = forward
    return _ForwardWrapper(model, forward, had_own, original)


def _not_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with its own frame left out of torch.compile's tracing, and what it calls traced as
    before: compiling a model the agent wraps captures the graphs it captures without the agent
    (dynamo cannot trace the clock's reads, and would otherwise run the whole model eagerly)."""
    import torch

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    if disable is None:
        return fn
    try:
        return disable(fn, recursive=False)
    except TypeError:  # a torch whose disable() has no `recursive`
        return fn


def _never_traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` and everything it calls left out of torch.compile's tracing (ForwardHooks' hooks,
    which call only the clock)."""
    import torch

    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else disable(fn)


def _call_traced(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """fn(*args, **kwargs) in a frame torch.compile starts tracing from, inlining `fn`: a
    model's own forward may be torch.nn code (Sequential, DDP) that dynamo never starts at."""
    return fn(*args, **kwargs)


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


def _grad_hook(param: Any, fn: Callable[[Any], None]) -> Any:
    register = getattr(param, "register_post_accumulate_grad_hook", None)
    if register is not None:
        return register(fn)
    return param.register_hook(lambda grad: fn(param))  # torch < 2.1: before accumulation


# -- the torch.autograd.backward wrapper, shared by every clock in the process ----------------
class Clocks:
    """The clocks a backward wrapper tells that backward ran (one per attached agent)."""

    def __init__(self) -> None:
        self.clocks: tuple[PhaseClock, ...] = ()


_registered = Clocks()


def timed_backward(original: Callable[..., Any], registered: Clocks) -> Callable[..., Any]:
    """`original` (torch.autograd.backward) telling every registered clock when it was entered
    and when it returned, in its own frame (see PhaseClock.timed_forward for why)."""

    def backward(*args: Any, **kwargs: Any) -> Any:
        clocks = registered.clocks
        t = _now()
        for c in clocks:
            try:
                # The depth also in quiet steps: the interceptor skips DDP's buckets while
                # a backward runs (agent/core.py).
                depth = c.bwd_depth = c.bwd_depth + 1
                if depth == 1 and not c.quiet:
                    c.bwd_entry = t
                    blocked = c.blocked
                    if blocked is not None and blocked.ns != c.blocked_seen:
                        c.take_blocked(BWD_START)  # waits before backward are not it
                    if c.mark is not None:
                        c.mark(BWD_START)  # on the caller's stream, before any backward kernel
            except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                c.on_error(exc)
        try:
            return original(*args, **kwargs)
        finally:
            for c in clocks:
                if c.quiet:  # nothing learnt or missed in a step whose phases are not timed
                    if c.bwd_depth > 0:
                        c.bwd_depth -= 1
                elif c.bwd_depth == 1 and not c.fwd_since_bwd and not c.bwd_deferred:
                    c.bwd_depth = c.bwd_entry = 0  # the outermost backward; a trigger fired
                    if c.sync_due:  # callback B's work, at the engine's return
                        c.sync_due = False
                        c._gradients_reduced()
                else:
                    c.backward_exit()

    return backward


def timed_grad(original: Callable[..., Any], registered: Clocks) -> Callable[..., Any]:
    """`original` (torch.autograd.grad) timed as backward by every registered clock for which
    it is a backward of its own: not in a quiet step, not inside a forward, a wrapped backward,
    a backward a parameter hook started, or another such call. Zero-bubble pipeline schedules
    compute input and weight gradients by torch.autograd.grad, which accumulates no gradient:
    no parameter hook fires and no callback ends it. Such a call is backward time from entry to
    return, less its waits in collectives; inside a forward or a backward it is that phase's."""

    def grad(*args: Any, **kwargs: Any) -> Any:
        t = _now()
        timing = []
        for c in registered.clocks:
            try:
                if c.quiet or c.fwd_start or c.bwd_depth or c.bwd_pending or c.grad_entry:
                    continue
                c.grad_entry = t
                c.take_blocked(BWD_START)  # waits before it (a recv of its output's gradient)
                if c.mark is not None:
                    c.mark(BWD_START)
                timing.append(c)
            except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                c.on_error(exc)
        try:
            return original(*args, **kwargs)
        finally:
            t = _now()
            for c in timing:
                try:
                    c.acc[BACKWARD] += max(0, t - c.grad_entry - c.take_blocked(BWD_END))
                    c.grad_entry = 0
                    c.idle_since = t
                    if c.mark is not None:
                        c.mark(BWD_END)
                except BaseException as exc:  # noqa: BLE001
                    c.on_error(exc)

    return grad


# torch.autograd's functions the clocks wrap, and how: the wrapped originals while ours are on.
_WRAPPERS = {"backward": timed_backward, "grad": timed_grad}
_originals: dict[str, Any] = {}


def install_backward(clock: PhaseClock) -> None:
    """Make torch.autograd.backward (what Tensor.backward calls) and torch.autograd.grad (a
    split backward's) tell `clock` they ran."""
    import torch.autograd

    if clock not in _registered.clocks:
        _registered.clocks = (*_registered.clocks, clock)
    for name, timed in _WRAPPERS.items():
        if name in _originals:
            continue  # already wrapped (perhaps under someone else's wrapper): never twice
        _originals[name] = original = getattr(torch.autograd, name)
        wrapper = functools.wraps(original)(timed(original, _registered))
        wrapper.__syncscope_wrapped__ = True  # type: ignore[attr-defined]
        # torch.compile leaves torch.autograd.grad's frame alone (trace_autograd_ops off): it
        # leaves ours alone too, so that a compiled function calling it captures the same.
        setattr(torch.autograd, name, _not_traced(wrapper) if name == "grad" else wrapper)


def uninstall_backward(clock: PhaseClock) -> None:
    """Forget `clock`; with no clock left, put torch's own functions back where ours are on top."""
    import torch.autograd

    _registered.clocks = tuple(c for c in _registered.clocks if c is not clock)
    if _registered.clocks:
        return
    for name in list(_originals):
        if getattr(getattr(torch.autograd, name), "__syncscope_wrapped__", False):
            setattr(torch.autograd, name, _originals.pop(name))
