"""Hugging Face `transformers.Trainer`: `trainer.add_callback(SyncscopeCallback(trainer))`.

Give the callback the trainer when you can: `Trainer` hands callbacks the unwrapped model, and
only `trainer.model_wrapped` (a documented attribute) is the DistributedDataParallel wrapper
whose gradient sync gives the exposed communication and the arrival lead. Without it, phases
and step times are still measured, and the time blocked in the gradient sync lands in "other".

The optimizer's step hooks mark the steps (Trainer calls `optimizer.step()` once per real step,
after gradient accumulation); accelerate's `AcceleratedOptimizer` wrapper is looked through to
the torch optimizer inside it, which is where those hooks fire.

Work done: Trainer calls the model with keyword arguments only, so the agent reads each
forward's batch from the model's `main_input_name` (`input_ids` for text: samples and tokens,
padding included, as Trainer's own `num_input_tokens_seen` counts them; `pixel_values`,
`input_values`, ...: samples). Every micro-batch of gradient accumulation adds to its step;
evaluation runs without gradients and is not counted.
"""

from __future__ import annotations

from typing import Any

from syncscope.agent import RankAgent, attach

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:  # pragma: no cover - depends on what is installed
    _TrainerCallback = None  # type: ignore[assignment,misc]

__all__ = ["SyncscopeCallback"]


class SyncscopeCallback(_TrainerCallback or object):  # type: ignore[misc]
    """Attach syncscope when training begins; close it when training ends.

    trainer    the Trainer (recommended: lets syncscope see the DDP wrapper)
    exporter   http://host:port or unix:///path (default: $SYNCSCOPE_EXPORTER)
    **config   any `attach()` setting (job, pacing, detail, ...)
    """

    def __init__(self, trainer: Any = None, exporter: str | None = None, **config: Any) -> None:
        if _TrainerCallback is None:
            raise ImportError(
                "SyncscopeCallback needs transformers: pip install transformers accelerate "
                "(or syncscope[huggingface])"
            )
        self.trainer = trainer
        self.exporter = exporter
        self.config = config
        self.agent: RankAgent | None = None

    def on_train_begin(
        self,
        args: Any,
        state: Any,
        control: Any,
        model: Any = None,
        optimizer: Any = None,
        **_: Any,
    ) -> None:
        if self.agent is not None:
            return
        wrapped = getattr(self.trainer, "model_wrapped", None) if self.trainer is not None else None
        config = dict(self.config)
        main_input = getattr(model, "main_input_name", None)  # PreTrainedModel's, unwrapped
        if isinstance(main_input, str) and main_input:
            config.setdefault("batch_argument", main_input)
        self.agent = attach(
            model=wrapped if wrapped is not None else model,
            optimizer=optimizer,  # (attach() looks through accelerate's wrapper)
            exporter=self.exporter,
            **config,
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **_: Any) -> None:
        if self.agent is not None:
            self.agent.close()
            self.agent = None
