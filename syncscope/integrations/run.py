"""Attach syncscope to a training script without editing it.

    torchrun --nproc-per-node 8 -m syncscope.integrations.run train.py --lr 0.1
    python -m syncscope.integrations.run train.py …          (one process)
    python -m syncscope.integrations.run -m my.trainer …     (a module instead of a script)

Settings come from the SYNCSCOPE_* variables `attach()` reads (SYNCSCOPE_EXPORTER, SYNCSCOPE_JOB,
SYNCSCOPE_PACING, …); SYNCSCOPE_DISABLE=1 runs the script untouched.

How it finds the model and the optimizer, with two global hooks from torch's public API, each
removed as soon as it has served: a module forward pre-hook remembers the first
DistributedDataParallel module that runs forward; an optimizer step post-hook, at the first
optimizer step, calls `attach(model=that module, optimizer=that optimizer)`. From the second step
on only `attach()`'s own hooks run. The first step is not measured; with several optimizers, the
first one to step marks the steps; a model that is not wrapped in DDP gets step and optimizer
timing only.

Why a runner and not an import hook (a sitecustomize module or a .pth file switched on by an
environment variable): this is visible on the command line, so whoever reads the job spec sees
syncscope is there; it runs only in the processes it is put in front of, not in every Python
process of the environment (pip, the exporter, tooling); it shadows nothing (a sitecustomize on
PYTHONPATH hides the distribution's own); and removing it is deleting one argument. It is the
same pattern as `python -m cProfile` or `coverage run`.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
from typing import Any

from syncscope.agent import RankAgent, attach

log = logging.getLogger("syncscope.integrations.run")
USAGE = "usage: python -m syncscope.integrations.run (script.py | -m module) [args ...]"


class AutoAttach:
    """The two self-removing global hooks; `agent` is set once attached."""

    def __init__(self, **config: Any) -> None:
        from torch.nn.modules.module import register_module_forward_pre_hook
        from torch.nn.parallel import DistributedDataParallel
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.config = config
        self.agent: RankAgent | None = None
        self.model: Any = None
        self._ddp = DistributedDataParallel
        self._forward = register_module_forward_pre_hook(self._on_forward)
        self._step = register_optimizer_step_post_hook(self._on_step)

    def _on_forward(self, module: Any, _args: Any) -> None:
        try:
            if isinstance(module, self._ddp):
                self.model = module
                self._forward.remove()
        except Exception:  # noqa: BLE001 - never into the training loop
            pass

    def _on_step(self, optimizer: Any, _args: Any, _kwargs: Any) -> None:
        try:
            self._step.remove()
            self._forward.remove()
            self.agent = attach(model=self.model, optimizer=optimizer, **self.config)
        except Exception as exc:  # noqa: BLE001
            log.warning("syncscope: auto-attach failed, training goes on without it: %r", exc)

    def remove(self) -> None:
        self._forward.remove()
        self._step.remove()


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
