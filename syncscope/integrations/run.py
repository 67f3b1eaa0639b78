"""Attach syncscope to a training script without editing it.

    torchrun --nproc-per-node 8 -m syncscope.integrations.run train.py --lr 0.1
    python -m syncscope.integrations.run train.py …          (one process)
    python -m syncscope.integrations.run -m my.trainer …     (a module instead of a script)

Settings come from the SYNCSCOPE_* variables `attach()` reads (SYNCSCOPE_EXPORTER, SYNCSCOPE_JOB,
SYNCSCOPE_PACING, …); SYNCSCOPE_DISABLE=1 runs the script untouched.

How it finds the model and the optimizers: two global hooks from torch's public API (gone at the
first forward after it attaches). One notes every module run forward with grad (not inside a
torch.compile trace); at each optimizer step the other takes the outermost of them with
trainable parameters and attaches once the optimizers stepped hold all of those (the first step
for one optimizer; a GAN's, or a pipeline's with one per stage, once each has stepped):
`attach(model=those, optimizer=those that hold their parameters)`, one or a list each. So
whatever wraps the model is found (DDP, FSDP2, tensor parallel...), and a step is every
optimizer's. Limits: the steps until then are not timed, MAX_STEPS_UNATTACHED at most (a
module run with grad that no optimizer trains); where no module owns a stepping optimizer's
parameters, it logs one warning and attaches with that optimizer only (no forward or backward).

A runner (as `python -m cProfile`), not an import hook (sitecustomize, a .pth file): it shows on
the job's command line, runs only in the processes it is put in front of, shadows nothing, and
removing it is deleting one argument.
"""

from __future__ import annotations

import contextlib
import logging
import os
import runpy
import sys
import warnings
from typing import Any, cast

from syncscope.agent import RankAgent, attach
from syncscope.agent.core import open_agents

log = logging.getLogger("syncscope.integrations.run")
# torch's warning at a compiled module's call while a global module hook exists (its start)
_COMPILE_HOOKS_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks"
USAGE = "usage: python -m syncscope.integrations.run (script.py | -m module) [args ...]"
# Optimizer steps the runner waits, at most, for the optimizers that have stepped to hold every
# trainable parameter of the modules run forward (a WGAN's critic steps five times to the
# generator's once; a module no optimizer trains would otherwise keep it waiting for ever).
MAX_STEPS_UNATTACHED = 16


class AutoAttach:
    """The two self-removing global hooks; `agent` is set once attached, `model` is what it was
    attached with (None: the optimizer only)."""

    def __init__(self, **config: Any) -> None:
        import torch
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.config = config
        self.agent: RankAgent | None = None
        self.model: Any = None
        self._grad = torch.is_grad_enabled
        self._compiling = torch.compiler.is_compiling
        self._ran: dict[int, Any] = {}  # id -> module, in the order they first ran forward
        self._stepped: dict[int, Any] = {}  # id -> optimizer, in the order they first stepped
        self._steps = 0  # optimizer steps seen
        self._done = False  # attached (or failed to): the hooks go at the next forward
        self._forward = register_module_forward_pre_hook(self._on_forward)
        self._step = register_optimizer_step_post_hook(self._on_step)
        # While any global module hook exists, every call of a torch.compile'd module warns
        # that the hooks fire once more for it (dynamo's OptimizedModule): this one only notes
        # the module, twice does no harm, and it goes at the first step. Not the user's
        # warning to read, so ignored until then (their own filters stay as they were).
        self._quiet: Any = None
        before = list(warnings.filters)
        warnings.filterwarnings("ignore", message=_COMPILE_HOOKS_WARNING, category=UserWarning)
        if warnings.filters[0] not in before:  # not one of theirs, to be left in place
            self._quiet = warnings.filters[0]

    def _on_forward(self, module: Any, _args: Any) -> None:
        if self._compiling():  # traced by torch.compile: the compiled module ran it eagerly
            return
        if self._done:
            self.remove()
            return
        try:
            if self._grad():
                self._ran.setdefault(id(module), module)
        except Exception:  # noqa: BLE001 - never into the training loop
            pass

    def _on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        """Not removed here: torch calls the global step post-hooks while iterating their
        dict, and a hook registered after this one would see it change (RuntimeError in the
        user's optimizer.step); the next forward pre-hook removes both (torch copies those)."""
        if self._done:
            return
        if open_agents():  # the script attached syncscope itself: its agent stands
            self._done = True
            log.info("syncscope: the script attached an agent itself; the runner leaves it")
            return
        try:
            self._stepped.setdefault(id(optimizer), optimizer)
            self._steps += 1
            stepped = list(self._stepped.values())
            if self._steps < MAX_STEPS_UNATTACHED and untrained(list(self._ran.values()), stepped):
                return  # another optimizer holds the rest of the model: wait for its step
            self._done = True
            ran, self._ran, self._stepped = list(self._ran.values()), {}, {}
            optimizers: Any = stepped[0]
            try:
                self.model, optimizers = find_model(ran, stepped)
            except Exception as exc:  # noqa: BLE001 - the optimizer's timing still stands
                log.warning("syncscope: no model found (%r), attached to the optimizer only", exc)
            self.agent = attach(model=self.model, optimizer=optimizers, **self.config)
        except Exception as exc:  # noqa: BLE001
            self._done = True
            log.warning("syncscope: auto-attach failed, training goes on without it: %r", exc)

    def remove(self) -> None:
        self._forward.remove()
        self._step.remove()
        if self._quiet is not None:
            with contextlib.suppress(ValueError):  # (gone with a catch_warnings block left)
                cast("list[Any]", warnings.filters).remove(self._quiet)
            self._quiet = None


def outermost(ran: list[Any]) -> list[Any]:
    """Of the modules `ran` forward (in that order), those no other of them holds."""
    inside: set[int] = set()
    for module in ran:
        if id(module) not in inside:  # an outer one ran first: its subtree holds this one's
            inside.update(id(m) for m in module.modules() if m is not module)
    return [m for m in ran if id(m) not in inside]


def _trainable(modules: list[Any]) -> list[Any]:
    return [m for m in modules if any(p.requires_grad for p in m.parameters())]


def _params(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def untrained(ran: list[Any], optimizers: list[Any]) -> bool:
    """Whether the outermost trainable modules `ran` forward have a trainable parameter that
    none of `optimizers` holds, where one of them does hold some (a model none trains at all is
    not waited for)."""
    parts = _trainable(outermost(ran))
    wanted = {id(p) for m in parts for p in m.parameters() if p.requires_grad}
    held = set().union(*map(_params, optimizers))
    return bool(wanted & held) and not wanted <= held


def find_model(ran: list[Any], optimizers: list[Any]) -> tuple[Any, Any]:
    """What `attach(model=..., optimizer=...)` takes, from the modules `ran` forward (in that
    order) and the `optimizers` stepped (in that order) before it attaches: the outermost
    modules that own trainable parameters, one module or a list, and the optimizers holding
    some of their parameters, one or a list. Where none owns any optimizer's parameters: None
    (and one warning) and the first optimizer."""
    seen = outermost(ran)
    parts = _trainable(seen)
    owned = {id(p) for m in parts for p in m.parameters()}
    training = [o for o in optimizers if _params(o) & owned]
    if not training:
        more = f" and {len(seen) - 8} more" if len(seen) > 8 else ""
        log.warning(
            "syncscope: no model found, attached to the optimizer only (step and optimizer "
            "times; no forward or backward, a straggler's cause unknown): none of the "
            "modules run forward with grad before the first %s step owns its %d parameters "
            "(outermost seen: %s%s)",
            type(optimizers[0]).__name__,
            len(_params(optimizers[0])),
            ", ".join(type(m).__name__ for m in seen[:8]) or "no module",
            more,
        )
        return None, optimizers[0]
    wanted = set().union(*map(_params, training))
    if not wanted <= owned:
        log.info(
            "syncscope: %d of the optimizers' parameters are in no module run forward",
            len(wanted - owned),
        )
    names = ", ".join(type(o).__name__ for o in training)
    log.info(
        "syncscope: the model: %s; its optimizers: %s",
        ", ".join(type(m).__name__ for m in parts),
        names,
    )
    model = parts[0] if len(parts) == 1 else parts
    return model, training[0] if len(training) == 1 else training


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or (args[0] == "-m" and len(args) < 2):
        print(USAGE, file=sys.stderr)
        return 2
    hooks = None
    if os.environ.get("SYNCSCOPE_DISABLE", "").strip().lower() not in ("1", "true", "yes", "on"):
        try:
            hooks = AutoAttach()
        except Exception as exc:  # noqa: BLE001 - e.g. torch missing: run the script anyway
            log.warning("syncscope: not attached: %r", exc)
    try:
        if args[0] == "-m":
            sys.argv = args[1:]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = args
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    finally:
        if hooks is not None:
            hooks.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
