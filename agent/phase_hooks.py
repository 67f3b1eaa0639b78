"""The hooks that tell a phase clock where a step is: its model's forward (wrapped on the
instance, or hooks of ours around the module's own), torch.autograd.backward and .grad (wrapped
once per process), the parameter-gradient triggers, and its optimizer's step hooks.

`instrument(clock, model, optimizer)` puts them on; the Instrumented it returns takes them off.
The clock (phases.PhaseClock) is the state machine they drive; nothing here keeps time itself.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

from syncscope.agent.cuda_timing import CudaPhaseClock, StreamOf
from syncscope.agent.nccl_trace import StepTimeline
from syncscope.agent.phases import (
    ACC_LEN,
    BACKWARD,
    BWD_END,
    BWD_START,
    COMM,
    COMM_END,
    DATA,
    FORWARD,
    FWD_POST,
    FWD_PRE,
    OPT_PRE,
    OPTIMIZER,
    STEP_END,
    PhaseClock,
)
from syncscope.agent.step_work import LOOK_EVERY

from syncscope.wire import DDP_GRAD_SYNC, UNKNOWN_WORK

_now = time.perf_counter_ns
# What the hooks in C (native.Native.hot_hook) are told of the clock: the positions of data,
# forward, backward, the optimizer and exposed communication in its accumulator, its length, the
# boundaries a subclass's `mark` is told of by them (forward's start and end, the optimizer's
# start, DDP's sync seen, a CudaPhaseClock's step end, callback A, the backward's entry), the
# work count that means "unknown", the batches a step between calls of StepWork.on_batches,
# DDP's sync record's kind, the method a CudaPhaseClock's `mark` is bound to, which they do in
# C, and the classes of its `stream_of` and `timeline` whose call and mark they do in C.
HOT_CONSTANTS = (
    *(DATA, FORWARD, BACKWARD, OPTIMIZER, COMM, ACC_LEN),
    *(FWD_PRE, FWD_POST, OPT_PRE, COMM_END, STEP_END, BWD_END, BWD_START),
    *(UNKNOWN_WORK, LOOK_EVERY, DDP_GRAD_SYNC),
    CudaPhaseClock._mark,
    StreamOf,
    StepTimeline,
)
# How much of a step's end the optimizer's post-hook in C does (csrc/hot_path.cpp's EndMode):
# none (a subclass's end_step and _quiet_end are called), a PhaseClock's common steps, or a
# CudaPhaseClock's quiet steps (their event through its `mark`, their row for its resolver).
OWN_END, INLINE_END, CUDA_QUIET_END = 0, 1, 2


class Instrumented:
    """What `instrument` put on for one clock; `remove()` takes it all off (safe twice)."""

    def __init__(self, clock: PhaseClock) -> None:
        self.clock = clock
        self.handles: list[Any] = []
        # The step pre- and post-hooks of the one optimizer that ends each step (hot_hooks'),
        # and their handles on it: step_with moves them to another.
        self.step_hooks: tuple[Any, Any] | None = None
        self.stepping: list[Any] = []

    def step_with(self, optimizer: Any) -> None:
        """The steps end at `optimizer`'s from now on, no longer at the one's before it (one
        optimizer ending each step; not with StepOfSeveral)."""
        if self.step_hooks is None:
            raise ValueError("the steps end at several optimizers' steps, not at one's")
        pre, post = self.step_hooks
        handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        self._off(self.stepping)
        self.stepping = handles

    def remove(self) -> None:
        uninstall_backward(self.clock)
        self._off(self.handles)
        self._off(self.stepping)
        self.clock.triggers.drop()

    @staticmethod
    def _off(handles: list[Any]) -> None:
        for handle in handles:
            with contextlib.suppress(Exception):
                handle.remove()
        handles.clear()


def instrument(
    clock: PhaseClock, model: Any = None, optimizer: Any = None, native: Any = None
) -> Instrumented:
    """Hook `model` (forward, parameter gradients, torch.autograd.backward) and `optimizer` for
    `clock`; the gradients in C++ where `native` (the loaded native.Native) is given (for a
    clock that marks its boundaries, CudaPhaseClock, the first calling its Python trigger), and
    with `native` the forward wrapper, the optimizer's hooks, the backward wrapper and the
    gradient trigger's Python hooks in C too (their common case: hot_native).

    `model`: a module, or a list of them (a pipeline rank's stages, each called apart): every
    one's forward is the forward phase; the batch is read from the first one's inputs only (the
    rank's first stage: later stages see the same samples again). `optimizer`: one, or a list
    of those stepped in one training step (StepOfSeveral)."""
    done = Instrumented(clock)
    handles = done.handles
    parts = parts_of(model)
    hot = hot_native(clock, native)
    for i, part in enumerate(parts):
        hooks = ForwardHooks.of(clock, part)
        timed = functools.partial(timed_forward, clock, hooks=hooks)
        in_c = None if hot is None else functools.partial(_hot_forward, hot, clock, hooks)
        handles.append(wrap_forward(part, timed, count=i == 0, hot=in_c))
        if hooks is not None:
            handles.append(hooks)
            if hot is not None:
                hooks.in_c(hot)
            hooks.follow()  # the module's hooks so far (FSDP2's): ours around them
    if parts and clock.queue_callback is not None:
        if hot is not None and type(clock).grad_ready is PhaseClock.grad_ready:
            # The trigger's Python hooks (a CudaPhaseClock's, a DTensor's parameters') in C, and
            # the callback A they queue
            callback_a = clock._backward_done
            if type(clock)._backward_done is PhaseClock._backward_done:
                callback_a = _in_c(hot, hot.HOT_DONE, clock, callback_a, clock)
            target = (clock, callback_a)
            clock.triggers.on_grad = _in_c(hot, hot.HOT_GRAD, target, clock.grad_ready, clock)
        # The last trainable parameters are watched until the first backward shows which
        # gradients come first (grad_triggers.py).
        clock.triggers.watch(
            (p for m in parts for p in m.parameters() if p.requires_grad),
            native,
            calls=clock.mark is not None,  # (its callback A records an event: Python's)
        )
        install_backward(clock, hot)
    optimizers = optimizers_of(optimizer)
    if len(optimizers) == 1:
        done.step_hooks = hot_hooks(clock, hot)
        done.step_with(optimizers[0])
    elif optimizers:
        several = StepOfSeveral(clock, optimizers)
        for each in optimizers:
            handles.append(each.register_step_pre_hook(clock.optimizer_pre))
            handles.append(each.register_step_post_hook(several.post))
    if optimizers:
        clock.steps_open = True
    return done


class StepOfSeveral:
    """The step post-hook of several optimizers stepped in one training step (a GAN's
    generator's and critic's, an actor's and a critic's): each optimizer's step is optimizer
    time, and the training step ends at the step that completes the set, every optimizer having
    stepped since the last end, whatever their order and however often one steps (a critic's
    five to the generator's one). Python's hooks: a few µs more a step than one optimizer's."""

    __slots__ = ("clock", "everyone", "left")

    def __init__(self, clock: PhaseClock, optimizers: list[Any]) -> None:
        self.clock = clock
        self.everyone = frozenset(map(id, optimizers))
        self.left = set(self.everyone)

    def post(self, optimizer: Any, *_: Any) -> None:
        left = self.left
        left.discard(id(optimizer))
        if left:
            self.clock.optimizer_within()
        else:
            left.update(self.everyone)
            self.clock.optimizer_post()


# PhaseClock's methods the hooks in C do themselves for a subclass too: one that has its own is
# refused. A subclass's end_step and _quiet_end are called (CudaPhaseClock's but in its quiet
# steps), its timed backward is its Python wrapper's, and its `mark` is told of every boundary
# the hooks see (CudaPhaseClock's own _mark is done in C).
_DONE_IN_C = ("optimizer_pre", "optimizer_post")


def hot_native(clock: PhaseClock, native: Any) -> Any:
    """`native` (the loaded native.Native) where `clock` can have its hooks in C
    (csrc/hot_path.cpp: a PhaseClock, or a subclass keeping _DONE_IN_C), else None. Each hook in C
    does what its Python counterpart does in its common case and calls it for all the rest."""
    if native is None or not isinstance(clock, PhaseClock):
        return None
    kind = type(clock)
    if any(getattr(kind, name) is not getattr(PhaseClock, name) for name in _DONE_IN_C):
        return None
    return native


def hot_hooks(clock: PhaseClock, hot: Any) -> tuple[Any, Any]:
    """The optimizer's step pre- and post-hooks for `clock`: in C with `hot` (hot_native's; the
    post-hook ends the step, the busiest hook there is), else the clock's own methods."""
    pre, post = clock.optimizer_pre, clock.optimizer_post
    if hot is None:
        return pre, post
    in_c = _in_c(hot, hot.HOT_PRE, clock, pre, clock)
    if in_c is pre:  # refused (the clock's slots): the post-hook would be too
        return pre, post
    # The clock's own step end, called where the hook does not end the step itself: always for
    # a subclass but in a CudaPhaseClock's quiet steps, else in uncommon steps.
    mode = {PhaseClock: INLINE_END, CudaPhaseClock: CUDA_QUIET_END}.get(type(clock), OWN_END)
    ends = (clock.end_step, clock._quiet_end, mode)
    return in_c, _in_c(hot, hot.HOT_POST, (clock, *ends), post, clock)


def _in_c(
    hot: Any, kind: int, target: Any, fallback: Any, clock: PhaseClock, like: Any = None
) -> Any:
    """The hook `kind` in C standing for `fallback` (hot.hot_hook), with `like`'s name and
    signature where given; `fallback` itself, the error told to `clock`, where it cannot be had."""
    try:
        made = hot.hot_hook(kind, target, fallback, HOT_CONSTANTS)
        return made if like is None else functools.update_wrapper(made, like)
    except Exception as exc:  # noqa: BLE001 - Python's hook serves
        clock.on_error(exc)
        return fallback


def _hot_forward(
    hot: Any,
    clock: PhaseClock,
    hooks: ForwardHooks | None,
    original: Any,
    wrapper: Any,
    count: bool,
) -> Any:
    """The forward wrapper in C standing for `wrapper` (timed_forward's), else `wrapper`: it
    calls `wrapper` in a quiet step and while the module has forward hooks (ForwardHooks)."""
    module = hooks.module if hooks is not None else None
    global_post = hooks.global_post if hooks is not None else None
    target = (clock, original, _call_traced, module, global_post, count, hooks)
    return _in_c(hot, hot.HOT_FORWARD, target, wrapper, clock, like=original)


def timed_forward(
    clock: PhaseClock,
    original: Callable[..., Any],
    count: bool = True,
    hooks: ForwardHooks | None = None,
) -> Callable[..., Any]:
    """`original` (a model's forward) timed as the forward phase, in the one frame that
    calls it: every extra Python call on the hot path runs on caches the step's kernels
    have flushed, ~2-6 µs each on a 10 ms CPU step (bench_agent_overhead.py --sizes).
    `count`: read the batch from its inputs (count_inputs), else not. `hooks`: the module's
    ForwardHooks, which time the phase instead while the module has forward hooks (a dict
    test per call here while it has none)."""
    work, triggers = clock.work, clock.triggers  # each the clock's for good
    module = hooks.module if hooks is not None else None
    global_post = hooks.global_post if hooks is not None else None

    def forward(*args: Any, **kwargs: Any) -> Any:
        if clock.at_forward is not None:  # asked from another thread (rare)
            clock.run_at_forward()
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
                if clock.opt_start:  # inside optimizer.step(closure): the clock's own split
                    clock._data_ends(t, waited)
                else:  # _data_ends' common case, inline (no extra call on the hot path)
                    idle = clock.idle_since
                    if idle:
                        ns = t - idle - waited
                        if ns > 0:
                            clock.acc[DATA] += ns
                        clock.idle_since = 0
                clock.fwd_start = t
                if clock.mark is not None:
                    clock.mark(FWD_PRE)
            inputs = work.inputs if count else None
            if inputs is not None and inputs[3]():  # shapes only: what the batch holds
                x: Any = args[0] if args else kwargs.get(inputs[2])
                shape = x.shape if isinstance(x, inputs[0]) else None
                if shape:
                    seen = work.seen_batches = work.seen_batches + 1
                    if not seen % LOOK_EVERY and work.on_batches is not None:
                        work.on_batches()
                    work.seen_samples += shape[0]
                    if len(shape) == 2 and x.dtype in inputs[1]:
                        work.seen_tokens += shape[0] * shape[1]
                    else:
                        work.unclear_tokens = True
                else:
                    work.unclear_samples = work.unclear_tokens = True
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
            if triggers.output_hooks and not clock.bwd_pending:  # rare: GradTriggers.missed
                triggers.hook_output(out)
            if clock.mark is not None:
                clock.mark(FWD_POST)
        except BaseException as exc:  # noqa: BLE001
            clock.on_error(exc)
        return out

    return forward


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

    def in_c(self, hot: Any) -> None:
        """Our pre- and post-hook in C (hot_native's `hot`), each calling the Python one in all
        but the common case; before the pair is registered. Like the forward wrapper in C, they
        are no Python frame torch.compile would trace."""
        target = (self.clock, self, self.global_post)
        self._pre_hook = _in_c(hot, hot.HOT_FWD_PRE, target, self._pre_hook, self.clock)
        self._post_hook = _in_c(hot, hot.HOT_FWD_POST, target, self._post_hook, self.clock)

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


def optimizers_of(optimizer: Any) -> list[Any]:
    """The optimizers of `optimizer` as attach() takes it: none, one, or a list or tuple; a
    wrapper holding a torch optimizer as `.optimizer` (accelerate's AcceleratedOptimizer, which
    never runs Optimizer.__init__, so cannot take step hooks) stands for the one inside, whose
    step is where the hooks fire: once a real step (accelerate skips it while accumulating)."""
    given = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    return [_innermost(o) for o in given if o is not None]


def _innermost(optimizer: Any) -> Any:
    inner = getattr(optimizer, "optimizer", None)
    while (
        inner is not None and inner is not optimizer and hasattr(inner, "register_step_post_hook")
    ):
        optimizer, inner = inner, getattr(inner, "optimizer", None)
    return optimizer


def wrap_forward(
    model: Any,
    timed: Callable[..., Callable[..., Any]],
    count: bool = True,
    hot: Callable[..., Any] | None = None,
) -> Any:
    """Time `model`'s forward by wrapping it on the instance (as accelerate does): its forward
    becomes `timed(original, count)` (timed_forward), or `hot(original, that, count)` (its
    counterpart in C, _hot_forward).

    Not register_forward_(pre_)hook: any module hook sends every call through nn.Module's slow
    path, several times the wrapper's cost per step (bench/bench_hook_costs.py measures both).
    Only a module that has forward hooks anyway (which nn.Module runs outside `forward`) is
    timed by hooks of ours around them (ForwardHooks).
    An exception in forward passes through untouched (the next forward restarts the phase).
    """
    had_own = "forward" in model.__dict__
    original = model.forward
    forward = _not_traced(functools.wraps(original)(timed(original, count)))
    if hot is not None:  # a C object: dynamo does not trace into it either
        forward = hot(original, forward, count)
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


# -- the torch.autograd.backward wrapper, shared by every clock in the process ----------------
class Clocks:
    """The clocks a backward wrapper tells that backward ran (one per attached agent)."""

    def __init__(self) -> None:
        self.clocks: tuple[PhaseClock, ...] = ()


_registered = Clocks()


def timed_backward(original: Callable[..., Any], registered: Clocks) -> Callable[..., Any]:
    """`original` (torch.autograd.backward) telling every registered clock when it was entered
    and when it returned, in its own frame (see timed_forward for why)."""

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
                    native = c.triggers.native
                    if native is not None:  # the C++ trigger (grad_triggers.py): armed
                        native.bwd_armed.value = 1
                    blocked = c.blocked
                    if blocked is not None and blocked.ns != c.blocked_seen:
                        c.take_blocked(BWD_START)  # waits before backward are not it
                    if c.mark is not None:
                        c.mark(BWD_START)  # on the caller's stream, before any backward kernel
                elif depth == 2:
                    c.triggers.pause()  # a reentrant checkpoint's backward, inside the outer
            except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                c.on_error(exc)
        try:
            return original(*args, **kwargs)
        finally:  # the backward's own error, if any, goes on once the clocks are told
            for c in clocks:
                try:
                    if c.quiet:  # nothing learnt or missed in a step whose phases are not timed
                        if c.bwd_depth > 0:
                            c.bwd_depth -= 1
                    elif c.bwd_depth == 1 and c.triggers.native and not c.triggers.native_calls:
                        c.backward_returned()  # (the C++ trigger's stamp)
                    elif c.bwd_depth == 1 and not c.fwd_since_bwd and not c.bwd_deferred:
                        c.bwd_depth = c.bwd_entry = 0  # the outermost backward; a trigger fired
                        c.triggers.disarm()  # (native mode: should no watched gradient have come)
                        if c.sync_due:  # callback B's work, at the engine's return
                            c.sync_due = False
                            c._gradients_reduced()
                    else:
                        c.backward_exit()
                except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
                    c.on_error(exc)

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


def install_backward(clock: PhaseClock, hot: Any = None) -> None:
    """Make torch.autograd.backward (what Tensor.backward calls) and torch.autograd.grad (a
    split backward's) tell `clock` they ran. With `hot` (hot_native's), the backward wrapper is
    in C (csrc/hot_path.cpp), which times a PhaseClock's backward triggered from C++ when it is
    the process's one clock and calls timed_backward's wrapper otherwise; the first clock
    installed decides for the process."""
    import torch.autograd

    if clock not in _registered.clocks:
        _registered.clocks = (*_registered.clocks, clock)
    for name, timed in _WRAPPERS.items():
        if name in _originals:
            continue  # already wrapped (perhaps under someone else's wrapper): never twice
        _originals[name] = original = getattr(torch.autograd, name)
        wrapper = functools.wraps(original)(timed(original, _registered))
        if name == "backward" and hot is not None:  # in C, standing for Python's
            target = (_registered, original, PhaseClock)
            wrapper = _in_c(hot, hot.HOT_BACKWARD, target, wrapper, clock, like=original)
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
