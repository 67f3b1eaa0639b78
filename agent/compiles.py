"""torch.compile's compilations and recompilations: each one that ends queues an event
(wire.EVENT_COMPILE) in the step it fell in, and the exporter counts the rank's settled steps
again from the next one, as after a checkpoint load: a recompiled step is not the job's pace,
and the diagnosis names nobody from it. Its time stays in the step's phases (not badput).

torch announces compilations in one place only, torch._dynamo.callback's `callback_handler`
(`register_start_callback` / `register_end_callback`, whose module documents them for this);
torch has no public interface for it. The agent registers there once the job has imported
torch._dynamo (a torch.compile does): at attach() and after the first step, in which a
torch.compile'd model compiles. It never imports torch._dynamo itself (over a second of a job's
start-up). Where the handler is missing or has changed, nothing is marked and the log says so
once. The handler calls the callbacks of the outermost compilation only, on whichever thread
compiles (a lazily compiled backward runs in autograd's).
"""

from __future__ import annotations

import importlib
import logging
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncscope.agent.phases import PhaseClock

log = logging.getLogger("syncscope.agent")
_now = time.perf_counter_ns
HANDLER = ("torch._dynamo.callback", "callback_handler")


class CompileWatch:
    """One agent's registration with torch's compile callbacks: `install()` (idempotent, does
    nothing until the job has imported torch._dynamo), `uninstall()`."""

    __slots__ = ("clock", "handler", "on_error", "started", "unavailable")

    def __init__(self, clock: PhaseClock, on_error: Callable[[BaseException], None]) -> None:
        self.clock = clock
        self.on_error = on_error
        self.handler: Any = None
        self.started = 0  # perf_counter ns at the open compilation's start (0: none seen)
        self.unavailable = False

    def install(self) -> None:
        if self.handler is not None or self.unavailable or "torch._dynamo" not in sys.modules:
            return
        module_name, attribute = HANDLER
        try:
            handler = getattr(importlib.import_module(module_name), attribute)
            handler.register_start_callback(self._start)
            handler.register_end_callback(self._end)
        except Exception as exc:  # noqa: BLE001 - a torch without it: nothing is marked
            self.unavailable = True
            log.info(
                "syncscope: this torch announces no compilations (%s.%s: %s); recompiled "
                "steps are not left out of the exporter's settled steps",
                module_name,
                attribute,
                exc,
            )
            return
        self.handler = handler

    def uninstall(self) -> None:
        handler, self.handler = self.handler, None
        if handler is None:
            return
        for remove, callback in (
            (handler.remove_start_callback, self._start),
            (handler.remove_end_callback, self._end),
        ):
            try:
                remove(callback)
            except Exception:  # noqa: BLE001, S112 - already gone (a torch.compiler.reset)
                continue

    def _start(self, _args: object) -> None:
        self.started = _now()

    def _end(self, _args: object) -> None:
        try:
            end, started = _now(), self.started
            self.started = 0
            self.clock.compile_done(end, end - started if started else 0)
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the job's compile
            self.on_error(exc)
