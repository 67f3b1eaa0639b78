"""Which gradients start the backward phase: a few parameters' post-accumulate-grad hooks.

Backward starts at the first parameter gradient's hook, registered once and cheap when it
fires, rather than a hook on the forward output registered every step
(bench/bench_hook_costs.py). The first backward learns which parameters' gradients come first;
then only TRIGGERS of them keep a hook. It watches the last LEARN_WINDOW trainable parameters
only (gradients come roughly in reverse order of registration): a parameter keeps paying for a
hook after the hook is removed (torch leaves its tensor's C++ hook in place and calls it, on an
empty dict, every backward), so watching all of them would cost every step a call per
parameter tensor for good. A backward after a forward in which none fires (conditional compute,
or the window's parameters unused) learns again over twice the window; after RELEARN_LIMIT such
misses (gradients assigned, as FSDP does, or another model's backward) the fallback is a hook
on the forward output: dearer, but it needs no parameter.

Native mode, where syncscope's C++ library is loaded (native.py) and the window's parameters
are plain tensors: C++ hooks on the window's parameters, no learning and no Python in the
backward at all (csrc/backward_trigger.cpp). The backward wrapper arms the trigger, the first
watched gradient queues the callback, and the wrapper reads when it ran (PhaseClock
.backward_returned). For a clock that marks its boundaries (CudaPhaseClock: a CUDA event at
callback A, which must be its own) the armed gradient calls `on_grad` instead (`calls`), which
queues callback A as a Python hook would: Python is entered once a timed backward, never in a
quiet step's. A backward in which none of them fires leaves native mode for the Python hooks
above, learning as from the start. The trigger's state is the process's one: one
GradTriggers at a time holds it, the last to watch (an earlier one goes over to Python's).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("syncscope.agent")

TRIGGERS = 1  # the parameter whose gradient comes first, hooked after learning (each more
# costs every backward a call into Python, ~3.4 k instructions, bench/bench_instructions.py)
LEARN_WINDOW = 8  # the trainable parameters, counted from the last, the first learning watches
RELEARN_LIMIT = 16
_native_owner: list[Any] = []  # the GradTriggers in native mode, if any (one per process)


class GradTriggers:
    """The gradient hooks that tell the phase clock a backward started (`on_grad(param)`;
    param None from the forward output's hook)."""

    __slots__ = (
        "hooks",
        "learned",
        "misses",
        "native",
        "native_calls",
        "native_hooks",
        "native_paused",
        "on_grad",
        "output_hooks",
        "params",
        "watched",
    )

    def __init__(self, on_grad: Callable[[Any], None]) -> None:
        self.on_grad = on_grad
        self.params: list[Any] = []  # the trainable parameters, in registration order
        self.hooks: dict[int, Any] = {}  # id(param) -> its hook's handle
        # While learning: the parameters in the order their gradients came (up to TRIGGERS);
        # None once learnt.
        self.learned: list[Any] | None = None
        self.watched = 0  # how many of `params`, from the last, learning has watched
        self.misses = 0  # backwards after a forward in which no trigger fired
        # The fallback (see the module docstring): a hook on the forward output, every step.
        self.output_hooks = False
        # Native mode: the loaded library (native.Native), else None; its hooks, as
        # (parameter, handle); whether a nested backward has disarmed the trigger (pause).
        self.native: Any = None
        self.native_hooks: list[tuple[Any, int]] = []
        self.native_paused = False
        self.native_calls = False  # native mode calling on_grad (see the module docstring)

    def watch(self, params: Iterable[Any], native: Any = None, calls: bool = False) -> None:
        """Trigger on the gradients of `params` (a model's trainable parameters): in native
        mode where `native` (the loaded native.Native) can hook them, else by learning which
        of them come first. `calls`: in native mode the armed gradient calls on_grad (a clock
        that marks), rather than stamping the time in C++."""
        self.params = list(params)
        if native is None or not self._watch_natively(native, calls):
            self.learn()

    def _watch_natively(self, native: Any, calls: bool) -> bool:
        import torch

        plain = (torch.Tensor, torch.nn.Parameter)  # a subclass (DTensor) dispatches elsewhere
        window = [p for p in self.params[-LEARN_WINDOW:] if p.is_leaf]
        if not window or any(type(p) not in plain for p in window):
            return False
        for earlier in list(_native_owner):  # the state is the process's one: theirs goes over
            earlier._drop_native()
            earlier.learn()
        self.native = native
        try:
            ops = native.trigger_ops(torch)
            for p in window:
                self.native_hooks.append((p, int(ops.watch_grad(p))))
            native.trigger_calls(self.on_grad if calls else None)
            self.native_calls = calls
        except Exception as exc:  # noqa: BLE001 - the Python hooks serve instead
            log.warning("syncscope: the C++ backward trigger is unavailable (%s); Python's", exc)
            self._drop_native()
            return False
        self.learned = None
        _native_owner.append(self)
        return True

    def _drop_native(self) -> None:
        """Leave native mode (none: nothing to do), removing the C++ hooks (each leaves an empty
        C++ slot, nothing that calls Python)."""
        native, hooks, calls = self.native, self.native_hooks, self.native_calls
        self.native, self.native_hooks, self.native_paused = None, [], False
        self.native_calls = False
        if self in _native_owner:
            _native_owner.remove(self)
        if calls:
            with contextlib.suppress(Exception):
                native.trigger_calls(None)  # its on_grad no longer held by the library
        if hooks:
            import torch

            ops = native.trigger_ops(torch)
            for param, handle in hooks:
                with contextlib.suppress(Exception):
                    ops.unwatch_grad(param, handle)

    def pause(self) -> None:
        """A nested backward (a reentrant checkpoint's) starts inside the armed one: its
        gradients must not queue the callback into its own graph task, which ends first."""
        native = self.native
        if native is not None and native.bwd_armed.value:
            native.bwd_armed.value = 0
            self.native_paused = True

    def disarm(self) -> None:
        """A timed backward is over: in native mode, armed no more should none of the watched
        gradients have come (with `native_calls` nothing else disarms it)."""
        native = self.native
        if native is not None:
            native.bwd_armed.value = 0

    def resume(self) -> None:
        """Back in the outer backward: armed again if the nested one disarmed it."""
        if self.native_paused:
            self.native_paused = False
            if self.native is not None:
                self.native.bwd_armed.value = 1

    def learn(self) -> None:
        """Watch the last LEARN_WINDOW parameters (twice as many as the last time, when learning
        again) for the first gradients of the next backward."""
        seen = set(self.hooks)
        self.learned = []
        self.watched = max(LEARN_WINDOW, 2 * self.watched)
        for p in self.params[-self.watched :]:
            if id(p) not in seen and p.is_leaf:
                seen.add(id(p))
                self.hooks[id(p)] = _grad_hook(p, self.on_grad)

    def learnt(self) -> None:
        """A backward's autograd work is done: keep the hooks of the gradients that came first
        (removed only now: never while the engine may call them)."""
        learned = self.learned
        if learned is not None:
            self.drop(keep=learned)
            self.learned = None

    def missed(self) -> None:
        """The model ran forward, then a backward in which no hooked parameter got a gradient:
        conditional compute skipped the triggers (learn again), or no parameter hook can see
        this model's gradients at all (fall back to hooking the output). In native mode: the
        Python hooks from now on, learning from the start."""
        self.misses += 1
        self._drop_native()
        if self.misses <= RELEARN_LIMIT and self.params:
            self.learn()
        else:
            self.output_hooks = True
            self.drop()
            self.learned = None

    def hook_output(self, out: Any) -> None:
        """The fallback: the first tensor of forward output `out` that will get a gradient."""
        tensor = first_grad_tensor(out)
        if tensor is not None:
            tensor.register_hook(self._output_reached)

    def _output_reached(self, _grad: Any) -> None:
        self.on_grad(None)

    def drop(self, keep: Iterable[Any] = ()) -> None:
        """Remove every parameter hook but the Python ones of `keep` (all C++ ones)."""
        self._drop_native()
        kept = {id(p) for p in keep}
        for key in [k for k in self.hooks if k not in kept]:
            with contextlib.suppress(Exception):
                self.hooks.pop(key).remove()


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
