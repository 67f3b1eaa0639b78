"""PyTorch Lightning: `Trainer(callbacks=[SyncscopeCallback()])`.

Steps are marked from the batch hooks rather than from the optimizer, and the optimizer is not
handed to `attach()`: under Lightning's automatic optimization forward and backward run *inside*
`optimizer.step(closure)`, so the optimizer's step hooks would enclose the whole step. What the
agent measures: data (from the previous step's end to forward), forward and backward on the
module Lightning runs (the DistributedDataParallel wrapper under DDP, so the gradient sync's
exposed communication and the arrival lead come too), and the rest of the step as "other"
(optimizer update, zero_grad, logging). Under gradient accumulation a step ends where Lightning
steps the optimizer. Works with both `lightning` and the older `pytorch_lightning` package.

Work done: the module Lightning runs gets the whole batch (a tuple, a dict), which says nothing
to the agent's own reading of the model's inputs, so each batch Lightning hands the callback is
counted through `agent.count()`: its samples are the leading dimension every tensor in it agrees
on (none where they disagree), its tokens those of its token ids (`input_ids` in a mapping, else
its first tensor, when that is an integer tensor of two dimensions). Micro-batches of gradient
accumulation add up within their step. `samples_per_step=` / `tokens_per_step=` (or counting
yourself in `training_step`) win over that.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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

_TOKEN_DTYPES = ("torch.int64", "torch.int32")


def _tensors(batch: Any, depth: int = 0) -> Iterator[Any]:
    """The tensors in a batch: itself, or inside mappings, lists and tuples (4 levels deep)."""
    if hasattr(batch, "shape") and hasattr(batch, "dtype"):
        yield batch
    elif depth < 4 and isinstance(batch, (Mapping, list, tuple)):
        for item in batch.values() if isinstance(batch, Mapping) else batch:
            yield from _tensors(item, depth + 1)


def batch_work(batch: Any) -> tuple[int | None, int | None]:
    """(samples, tokens) in one batch, None where it does not say unambiguously."""
    tensors = [t for t in _tensors(batch) if len(t.shape) > 0]
    sizes = {int(t.shape[0]) for t in tensors}
    samples = sizes.pop() if len(sizes) == 1 else None
    ids: Any = batch.get("input_ids") if isinstance(batch, Mapping) else None
    ids = ids if ids is not None else (tensors[0] if tensors else None)
    is_ids = hasattr(ids, "shape") and len(ids.shape) == 2 and str(ids.dtype) in _TOKEN_DTYPES
    tokens = int(ids.shape[0]) * int(ids.shape[1]) if samples is not None and is_ids else None
    return samples, tokens


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
        # The user's own numbers, if any, are the agent's settings: then batches are not read.
        set_ = ("samples_per_step", "tokens_per_step")
        self._count = not any(config.get(k) is not None for k in set_)

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
        if self.agent is not None and self._count:
            try:
                samples, tokens = batch_work(batch)
            except Exception:  # noqa: BLE001 - an odd batch is no reason to stop training
                return
            self.agent.count(samples=samples, tokens=tokens)

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
