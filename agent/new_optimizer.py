"""The optimizer a loop builds in place of the one attach() was given (staged unfreezing, a reset
after a divergence, a restart from a checkpoint in the same process): the steps end at its step
from then on. Nothing is added to any step while the followed optimizer steps.

How it is found: the reporter's StoppedSteps look (attach_checks.py), seeing forwards go on with
no step for a while, calls `ask()`. The training thread then registers, at its next forward
(PhaseClock.at_forward), a global optimizer step post-hook (torch's public
`register_optimizer_step_post_hook`). The first optimizer to step whose parameter groups hold
a parameter of the model gets the clock's step hooks (Instrumented.step_with); the open step,
which spans the gap, is dropped (PhaseClock.restart_step), and the steps count on from its
number. The next forward removes the global hook. A step of the followed optimizer (it steps
again) removes it too. torch iterates its global hooks while it calls them: one registered or
removed from another thread, or from a hook, mid-iteration would raise into the loop's step,
hence the forward.
"""

from __future__ import annotations

import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from syncscope.agent.phase_hooks import Instrumented
    from syncscope.agent.phases import PhaseClock

log = logging.getLogger("syncscope.agent")


class NewOptimizer:
    """Follows the optimizer that trains the model (one optimizer ending each step): `ask()`
    from any thread once the followed one has stopped stepping; the rest runs on the training
    thread. `found` counts the optimizers followed since attach()."""

    def __init__(
        self, clock: PhaseClock, hooks: Instrumented, parts: list[Any], optimizer: Any
    ) -> None:
        self.clock, self.hooks, self.parts = clock, hooks, parts
        self.following = weakref.ref(optimizer)  # not kept alive here: its state is large
        self.handle: Any = None  # the global post-hook's, while registered
        self.asked = False  # a change asked of the next forward, not made yet
        self.params: set[int] = set()  # the model's parameters, while the hook is registered
        self.found = 0

    def ask(self) -> None:
        """The followed optimizer has stopped stepping while the model trains on: look at the
        optimizers that step from the next forward on. Any thread; once until it settles."""
        if self.asked or self.handle is not None or self.clock.manual_steps:
            return
        self.asked = True
        self.clock.at_forward = self._register

    def _register(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.asked = False
        if self.handle is None:
            self.params = {id(p) for part in self.parts for p in part.parameters()}
            self.handle = register_optimizer_step_post_hook(self._stepped)

    def _stepped(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Any optimizer's step has ended (torch's global post-hook, after its own hooks)."""
        try:
            if self.asked:  # settled: the hook goes at the next forward
                return
            before = self.following()
            if optimizer is before:  # it steps again: nothing to follow
                self._settled()
                return
            params = self.params
            if not any(id(p) in params for g in optimizer.param_groups for p in g["params"]):
                return  # another model's
            self.hooks.step_with(optimizer)
            self.following = weakref.ref(optimizer)
            self.clock.restart_step(time.perf_counter_ns())
            self.found += 1
            self._settled()
            log.warning(
                "syncscope: the optimizer the steps ended at (%s) stopped stepping; they now "
                "end at %s's, which trains the model. The step between, from the last step of "
                "the one to this step of the other, is not reported.",
                type(before).__name__ if before is not None else "gone",
                type(optimizer).__name__,
            )
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self.clock.on_error(exc)

    def _settled(self) -> None:
        self.asked = True
        self.clock.at_forward = self._remove

    def _remove(self) -> None:
        handle, self.handle = self.handle, None
        self.params = set()
        self.asked = False
        if handle is not None:
            handle.remove()

    def close(self) -> None:
        """Off for good (the agent's close(), on the training thread): the hook gone, nothing
        more asked."""
        self._remove()
        self.asked = True
        self.clock.at_forward = None
