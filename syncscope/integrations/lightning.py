"""PyTorch Lightning: `Trainer(callbacks=[SyncscopeCallback()])`.

Steps are marked from the batch hooks rather than from the optimizer, and the optimizer is not
handed to `attach()`: under Lightning's automatic optimization forward and backward run *inside*
`optimizer.step(closure)`, so the optimizer's step hooks would enclose the whole step. What the
agent measures: data (from the previous step's end to forward), forward and backward on the
module Lightning runs (the DistributedDataParallel wrapper under DDP, so the gradient sync's
exposed communication and the arrival lead come too), and the rest of the step as "other"
(optimizer update, zero_grad, logging). Under gradient accumulation a step ends where Lightning
steps the optimizer. Works with both `lightning` and the older `pytorch_lightning` package.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from syncscope.agent import RankAgent, attach

try:
    from lightning.pytorch.callbacks import Callback as _Callback
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from pytorch_lightning.callbacks import Callback as _Callback  # type: ignore[no-redef,assignment]
    except ImportError:
        _Callback = None  # type: ignore[assignment,misc]

__all__ = ["SyncscopeCallback"]


class SyncscopeCallback(_Callback or object):  # type: ignore[misc]
    """Attach syncscope when fitting starts; close it when fitting ends.

    exporter   http://host:port or unix:///path (default: $SYNCSCOPE_EXPORTER)
    **config   any `attach()` setting (job, pacing, detail, ...)
    """

    def __init__(self, exporter: str | None = None, **config: Any) -> None:
        if _Callback is None:
            raise ImportError(
                "SyncscopeCallback needs PyTorch Lightning: pip install lightning "
                "(or syncscope[lightning])"
            )
        super().__init__()
        self.exporter = exporter
        self.config = config
        self.agent: RankAgent | None = None
        self._step: AbstractContextManager[None] | None = None

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        # After the strategy's setup: under DDP, strategy.model is the DDP wrapper.
        model = getattr(trainer.strategy, "model", None) or pl_module
        self.agent = attach(model=model, exporter=self.exporter, **self.config)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        if self.agent is not None and self._step is None:
            self._step = self.agent.step()
            self._step.__enter__()

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._step is None:
            return
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        last = batch_idx + 1 == getattr(trainer, "num_training_batches", None)
        if (batch_idx + 1) % accumulate == 0 or last:
            step, self._step = self._step, None
            step.__exit__(None, None, None)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self._close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._close()

    def _close(self) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
        self._step = None
