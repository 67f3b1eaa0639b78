"""Checkpoint time on the training thread: `torch.save`, `torch.load` and
`torch.distributed.checkpoint`'s `save`, `async_save` and `load`, wrapped while an agent is
attached, and `with agent.checkpoint():` around anything else that saves or loads.

Of an `async_save`, only the call is timed (staging the state, starting the writer); the write
in torch's thread and a later wait for its future are not: wrap those in `agent.checkpoint()`.

A call's time is badput (the exporter's `checkpoint_save` / `checkpoint_load` categories), not
data wait or forward: each outermost call on the thread that attached the agent becomes one
event (wire.EVENT_CHECKPOINT_SAVE / _LOAD), and the phase clock moves its time out of the phase
it interrupted into `other` (PhaseClock.checkpoint_done). A call nested in another timed call
counts once, as part of the outer one; calls from other threads pass through untimed.

The wrappers call the original with the caller's arguments and hand back exactly what it
returns or raises; our own bookkeeping catches everything, and uncalled they cost nothing. The
public functions are replaced on their modules, so a name bound before attach() (`from torch
import save`) is not seen. torch.distributed.checkpoint is wrapped only once the job has
imported it (importing it here would slow the job's start-up): at attach() and at the end of the
first step. `close()` puts the originals back unless something wrapped them again on top, in
which case ours stays and passes calls through.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from syncscope.wire import EVENT_CHECKPOINT_LOAD, EVENT_CHECKPOINT_SAVE

if TYPE_CHECKING:
    from syncscope.agent.phases import PhaseClock

_now = time.perf_counter_ns
_thread = threading.get_ident

SAVE = EVENT_CHECKPOINT_SAVE
LOAD = EVENT_CHECKPOINT_LOAD
KINDS = {"save": SAVE, "load": LOAD}
# (module, attribute, kind): the public functions a job saves and loads checkpoints with.
TARGETS = (
    ("torch", "save", SAVE),
    ("torch", "load", LOAD),
    ("torch.distributed.checkpoint", "save", SAVE),
    # The part of an asynchronous save the training thread pays: staging the state (a copy
    # off the device) and starting the writer. The write itself runs on torch's thread.
    ("torch.distributed.checkpoint", "async_save", SAVE),
    ("torch.distributed.checkpoint", "load", LOAD),
)


class CheckpointTimer:
    """One agent's account of its training thread's checkpoint calls.

    `enter()` at a call's start, `leave(entered, kind)` at its end (however it ends). Totals
    per kind are kept for the curious (`save_ns`, `load_ns`, `calls`); each timed call goes to
    the phase clock (`clock.checkpoint_done`), which queues its event.
    """

    __slots__ = ("blocked", "calls", "clock", "depth", "load_ns", "on_error", "save_ns", "thread")

    def __init__(
        self,
        clock: PhaseClock,
        on_error: Callable[[BaseException], None],
        thread: int | None = None,
    ) -> None:
        self.clock = clock
        self.on_error = on_error
        self.thread = _thread() if thread is None else thread  # the thread that attached
        self.depth = 0  # timed calls open on that thread (nested ones count once)
        self.save_ns = 0
        self.load_ns = 0
        self.calls = 0

    def enter(self) -> tuple[int, int] | None:
        """(start ns, collective wait ns so far) for a call on the training thread (start 0:
        nested in a timed call); None for a call on another thread (nothing to undo)."""
        if _thread() != self.thread:
            return None
        self.depth += 1
        blocked = self.clock.blocked
        return (_now() if self.depth == 1 else 0, blocked.ns if blocked is not None else 0)

    def leave(self, entered: tuple[int, int] | None, kind: str) -> None:
        """The end of a call `enter()` returned `entered` for. Never raises."""
        if entered is None:
            return
        try:
            self.depth = max(0, self.depth - 1)
            start, blocked_before = entered
            if not start:
                return
            end = _now()
            duration = end - start
            if kind == LOAD:
                self.load_ns += duration
            else:
                self.save_ns += duration
            self.calls += 1
            clock = self.clock
            blocked = clock.blocked
            waited = (blocked.ns - blocked_before) if blocked is not None else 0
            clock.checkpoint_done(kind, end, duration, waited)
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self.on_error(exc)


class CheckpointContext:
    """`with agent.checkpoint(kind):` times the block as one checkpoint save or load."""

    __slots__ = ("entered", "kind", "timer")

    def __init__(self, timer: CheckpointTimer, kind: str) -> None:
        self.timer = timer
        self.kind = kind
        self.entered: tuple[int, int] | None = None

    def __enter__(self) -> None:
        try:
            self.entered = self.timer.enter()
        except BaseException as exc:  # noqa: BLE001
            self.entered = None
            self.timer.on_error(exc)

    def __exit__(self, *_exc: object) -> None:
        self.timer.leave(self.entered, self.kind)
        self.entered = None


def checkpoint_kind(kind: str) -> str:
    """The event kind for `agent.checkpoint(kind)`: "save" or "load" (or the event's name)."""
    found = KINDS.get(kind, kind)
    if found not in (SAVE, LOAD):
        raise ValueError(f'checkpoint kind must be "save" or "load", not {kind!r}')
    return found


# -- the wrappers, shared by every agent in the process ----------------------------------------
class Timers:
    """The timers every wrapper reports to (one per attached agent)."""

    def __init__(self) -> None:
        self.timers: tuple[CheckpointTimer, ...] = ()


_registered = Timers()
# (module name, attribute) -> (module, the original, our wrapper) while our wrapper is in place
_wrapped: dict[tuple[str, str], tuple[Any, Any, Any]] = {}


def _enter_all(registered: Timers) -> list[tuple[CheckpointTimer, tuple[int, int]]]:
    out = []
    for timer in registered.timers:
        try:
            entered = timer.enter()
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            timer.on_error(exc)
            continue
        if entered is not None:
            out.append((timer, entered))
    return out


def timed(original: Callable[..., Any], kind: str, registered: Timers) -> Callable[..., Any]:
    """`original` (a save or load function) timed for every registered timer."""

    def checkpoint_call(*args: Any, **kwargs: Any) -> Any:
        if not registered.timers:
            return original(*args, **kwargs)
        entered = _enter_all(registered)
        if not entered:  # another thread's call
            return original(*args, **kwargs)
        try:
            return original(*args, **kwargs)
        finally:
            for timer, token in entered:
                timer.leave(token, kind)

    wrapper = functools.wraps(original)(checkpoint_call)
    wrapper.__syncscope_wrapped__ = True  # type: ignore[attr-defined]
    return wrapper


def wrap_available() -> None:
    """Wrap every target whose module is imported and not wrapped yet (idempotent)."""
    if not _registered.timers:
        return
    for module_name, attribute, kind in TARGETS:
        key = (module_name, attribute)
        module = sys.modules.get(module_name)
        if module is None or key in _wrapped:
            continue
        original = getattr(module, attribute, None)
        if original is None or getattr(original, "__syncscope_wrapped__", False):
            continue
        wrapper = timed(original, kind, _registered)
        setattr(module, attribute, wrapper)
        _wrapped[key] = (module, original, wrapper)


def install(timer: CheckpointTimer) -> None:
    """Report the training thread's checkpoint calls to `timer` from now on."""
    if timer not in _registered.timers:
        _registered.timers = (*_registered.timers, timer)
    wrap_available()


def uninstall(timer: CheckpointTimer) -> None:
    """Forget `timer`; with none left, put the originals back where ours are still on top."""
    _registered.timers = tuple(t for t in _registered.timers if t is not timer)
    if _registered.timers:
        return
    for key, (module, original, wrapper) in list(_wrapped.items()):
        if getattr(module, key[1], None) is wrapper:
            setattr(module, key[1], original)
        # else someone wrapped ours: it stays (passing calls through) under theirs
        del _wrapped[key]
