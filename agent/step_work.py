"""A step's work (samples, tokens): what `agent.count` added, else the configured numbers, else
what the step's forwards' inputs show."""

from __future__ import annotations

from typing import Any

from syncscope.wire import MAX_WORK, UNKNOWN_WORK

# `on_batches` is called at every LOOK_EVERY-th batch seen in one step (the forward wrapper's,
# in Python and in C): where no thread of the agent looks, forwards that go on with no step
# are what asks for the look (attach_checks.StoppedSteps, the shm transport's).
LOOK_EVERY = 16


class StepWork:
    """The current step's work as it is counted; `take()` at the step's end.

    The forward wrapper (phase_hooks.timed_forward) reads each batch inline, from `inputs`,
    into the `seen_*` fields: a method call there would cost every forward."""

    __slots__ = (
        "counted_samples",
        "counted_tokens",
        "inputs",
        "on_batches",
        "samples_per_step",
        "seen_batches",
        "seen_samples",
        "seen_tokens",
        "tokens_per_step",
        "unclear_samples",
        "unclear_tokens",
    )

    def __init__(self) -> None:
        # What the forward wrapper reads batches with (count_inputs); None: nothing is read.
        self.inputs: tuple[Any, frozenset[Any], str, Any] | None = None
        self.samples_per_step = UNKNOWN_WORK  # configured per step; UNKNOWN_WORK: not
        self.tokens_per_step = UNKNOWN_WORK
        self.counted_samples = UNKNOWN_WORK  # agent.count this step
        self.counted_tokens = UNKNOWN_WORK
        self.seen_batches = 0  # forwards this step whose batch was a tensor with a batch dim
        self.seen_samples = 0
        self.seen_tokens = 0
        self.unclear_samples = False  # a forward this step had no such batch
        self.unclear_tokens = False  # ... or one that was not a token tensor
        self.on_batches: Any = None  # a callable of no arguments, or None (LOOK_EVERY)

    def count_inputs(self, torch: Any, batch_argument: str) -> None:
        """Read each forward's batch size (and tokens) from the model's inputs from now on.

        From shapes alone (no tensor data, nothing dynamo could trace): the leading dimension of
        forward's first positional argument (else of the keyword `batch_argument`) is the batch,
        and an int32/int64 tensor of two dimensions holds tokens (batch x sequence). Only
        forwards with gradients enabled count (micro-batches add up). A batch that is not a
        tensor with a leading dimension makes the step's samples unknown (-1), and its tokens
        too unless every batch was a token tensor: no number rather than a guess."""
        self.inputs = (
            torch.Tensor,
            frozenset((torch.int64, torch.int32)),
            batch_argument,
            torch.is_grad_enabled,
        )

    def count(self, samples: int | None, tokens: int | None) -> None:
        """Add work to the current step (what `agent.count` calls); it replaces the step's
        configured and detected numbers. Negative numbers are ignored; sums stop at the wire's
        MAX_WORK (beyond it the exporter would refuse the whole batch)."""
        if samples is not None and samples >= 0:
            self.counted_samples = min(MAX_WORK, max(0, self.counted_samples) + int(samples))
        if tokens is not None and tokens >= 0:
            self.counted_tokens = min(MAX_WORK, max(0, self.counted_tokens) + int(tokens))

    def take(self) -> tuple[int, int]:
        """This step's (samples, tokens), UNKNOWN_WORK where not known; resets the counts."""
        samples, tokens = self.counted_samples, self.counted_tokens
        seen = self.seen_batches
        if samples < 0:
            samples = self.samples_per_step
            if samples < 0 and seen and not self.unclear_samples:
                samples = self.seen_samples
        else:
            self.counted_samples = UNKNOWN_WORK
        if tokens < 0:
            tokens = self.tokens_per_step
            if tokens < 0 and seen and not self.unclear_tokens:
                tokens = self.seen_tokens
        else:
            self.counted_tokens = UNKNOWN_WORK
        if seen or self.unclear_samples:  # forget_seen, inline: this runs every step
            self.seen_batches = self.seen_samples = self.seen_tokens = 0
            self.unclear_samples = self.unclear_tokens = False
        return samples, tokens

    def forget_seen(self) -> None:
        """Forget the batches the forward wrapper has seen since the last step ended."""
        self.seen_batches = self.seen_samples = self.seen_tokens = 0
        self.unclear_samples = self.unclear_tokens = False
