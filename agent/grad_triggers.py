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
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

TRIGGERS = 1  # the parameter whose gradient comes first, hooked after learning (each more
# costs every backward a call into Python, ~3.4 k instructions, bench/bench_instructions.py)
LEARN_WINDOW = 8  # the trainable parameters, counted from the last, the first learning watches
RELEARN_LIMIT = 16


class GradTriggers:
    """The gradient hooks that tell the phase clock a backward started (`on_grad(param)`;
    param None from the forward output's hook)."""

    __slots__ = ("hooks", "learned", "misses", "on_grad", "output_hooks", "params", "watched")

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

    def watch(self, params: Iterable[Any]) -> None:
        """Learn which of `params` (a model's trainable parameters) get their gradients first."""
        self.params = list(params)
        self.learn()

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
        this model's gradients at all (fall back to hooking the output)."""
        self.misses += 1
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
        """Remove every parameter hook but those of `keep`."""
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
