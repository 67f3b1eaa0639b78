"""The backward / exposed-communication boundaries on real torch graphs (agent/phases.py).

Each test puts a known sleep where one boundary mechanism could get it wrong: before the first
parameter gradient, inside a reentrant checkpoint, in a branch that stops receiving gradients,
and under DDP's no_sync(). Those that every trigger mode serves run with the Python gradient
hooks, with the C++ ones, and with the Python ones behind the hooks in C (`trigger`). All on one
CPU process (a gloo group of one where DDP is needed).
"""

from __future__ import annotations

from collections import deque

import pytest

torch = pytest.importorskip("torch")

from syncscope.agent import native as native_library  # noqa: E402
from syncscope.agent.grad_triggers import LEARN_WINDOW, RELEARN_LIMIT, TRIGGERS  # noqa: E402
from syncscope.agent.phase_hooks import instrument  # noqa: E402
from syncscope.agent.phases import BACKWARD, COMM, FORWARD, ROW_WORK, PhaseClock  # noqa: E402

from syncscope.wire import DDP_GRAD_SYNC  # noqa: E402

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock

MS = 1_000_000
QUEUE = torch.autograd.Variable._execution_engine.queue_callback


class SleepInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ms):
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import time

        time.sleep(ctx.ms / 1e3)
        return grad, None


class Sleeper(torch.nn.Module):
    """No parameters; its backward sleeps."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x):
        return SleepInBackward.apply(x, self.ms)


class TriggerInPython:
    """The loaded library for the hooks in C, its C++ trigger refused: Python's gradient hooks
    behind them, as for a CUDA clock or a DTensor's parameters (their common calls in C)."""

    def __init__(self, built) -> None:
        self.built = built

    def __getattr__(self, name):
        return getattr(self.built, name)

    def trigger_ops(self, _torch):
        raise RuntimeError("the C++ trigger is refused here")


@pytest.fixture(params=["python", "c++", "python-in-c"])
def trigger(request):
    """What `instrument` is given for the backward's trigger: None (Python's gradient hooks and
    hooks), the loaded C++ library (which `scripts/setup` builds: its absence fails here), or
    the library with its C++ trigger refused (Python's gradient hooks, the hooks in C)."""
    if request.param == "python":
        return None
    built = native_library.load(torch)
    assert built is not None, "no C++ library for this torch: python -m syncscope.agent.native"
    return built if request.param == "c++" else TriggerInPython(built)


def cpp_trigger(trigger) -> bool:
    """Whether `trigger` (the fixture's) has the C++ trigger serve the backward."""
    return trigger is not None and not isinstance(trigger, TriggerInPython)


def clock_for(model, errors, ddp_group=None, ddp_model=None):
    clock = PhaseClock(
        deque(maxlen=1000), deque(maxlen=1000), QUEUE, ddp_group, 64.0, errors.append, ddp_model
    )
    return clock


def train(model, clock, steps, x, opt=None, before_backward=None, native=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = instrument(clock, model, opt, native)
    if isinstance(native, TriggerInPython):  # Python's gradient hooks, standing for them in C
        assert clock.triggers.native is None
        assert type(clock.triggers.on_grad).__name__ == "HotHook"
    try:
        for i in range(steps):
            opt.zero_grad()
            out = model(x)
            if before_backward is not None:
                out = before_backward(i, out)
            out.pow(2).mean().backward()
            opt.step()
    finally:
        hooks.remove()
    return list(clock.steps)


def test_backward_starts_before_the_first_parameter_gradient(trigger):
    # The sleeping layer is the model's last, like a language model's output projection whose
    # input-gradient kernels run before any parameter has a gradient.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Sleeper(8.0))
    errors: list = []
    clock = clock_for(model, errors)
    native = []  # whether the C++ trigger served each step

    def seen(_i, out):
        native.append(clock.triggers.native is not None)
        return out

    rows = train(model, clock, 5, torch.randn(4, 8), before_backward=seen, native=trigger)
    assert errors == []
    assert native == [cpp_trigger(trigger)] * 5
    for row in rows[1:]:
        assert row[3 + BACKWARD] >= 8 * MS
        assert sum(row[3:9]) <= row[2]  # the phases, not the work counts after them


def test_a_gradient_hook_called_outside_backward_starts_nothing():
    # Under a pipeline schedule FSDP2 reduces gradients after the backward passes
    # (PipelineStage.perform_reduce_grad) and calls the sharded parameters' hooks itself,
    # outside autograd. That must neither fail nor leave a backward open: every later
    # backward is still timed.
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Sleeper(8.0))
    errors: list = []
    clock = clock_for(model, errors)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = instrument(clock, model, opt)
    try:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            clock.grad_ready(model[0].weight)  # what FSDP2's deferred reduction does
            opt.step()
    finally:
        hooks.remove()
    assert errors == []
    assert not clock.bwd_pending
    rows = list(clock.steps)
    assert len(rows) == 5
    for row in rows[1:]:
        assert row[3 + BACKWARD] >= 8 * MS


def test_every_stage_of_a_pipeline_rank_is_timed_and_its_batch_read_once():
    # A rank of an interleaved pipeline holds two stage modules, each called on its own: both
    # forwards are the forward phase; the samples are the first stage's inputs only.
    class Stage(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)

        def forward(self, x):
            import time

            time.sleep(0.004)
            return self.linear(x)

    first, second = Stage(), Stage()
    errors: list = []
    clock = clock_for(first, errors)
    clock.work.count_inputs(torch, "input")
    opt = torch.optim.SGD([*first.parameters(), *second.parameters()], lr=0.01)
    hooks = instrument(clock, [first, second], opt)
    try:
        for _ in range(4):
            opt.zero_grad()
            for micro in torch.randn(8, 8).chunk(2):  # two micro-batches of 4
                second(first(micro)).pow(2).mean().backward()
            opt.step()
    finally:
        hooks.remove()
    assert errors == []
    assert first.__dict__.get("forward") is None and second.__dict__.get("forward") is None
    for row in list(clock.steps)[1:]:
        assert row[3 + FORWARD] >= 4 * 4 * MS  # 2 micro-batches x 2 stages x 4 ms
        assert row[3 + BACKWARD] > 0
        assert row[ROW_WORK] == 8  # the batch, once


def test_reentrant_checkpoint_backward_is_timed_to_the_outer_end(trigger):
    # Trigger parameters live inside the checkpointed tail (their gradients come first, in the
    # nested backward); the outer backward then runs the sleeping head. Callback A must run at
    # the end of the outer backward, so the head's sleep is backward time.
    head = torch.nn.Sequential(Sleeper(8.0), torch.nn.Linear(8, 8))
    tail = torch.nn.Linear(8, 1)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head, self.tail = head, tail

        def forward(self, x):
            h = self.head(x)
            return torch.utils.checkpoint.checkpoint(self.tail, h, use_reentrant=True)

    model = Model()
    errors: list = []
    clock = clock_for(model, errors)
    x = torch.randn(4, 8, requires_grad=True)  # reentrant checkpoint needs a grad path in
    native = []  # whether the C++ trigger served each step (a miss would end it)

    def seen(_i, out):
        native.append(clock.triggers.native is not None)
        return out

    rows = train(model, clock, 5, x, before_backward=seen, native=trigger)
    assert errors == []
    assert clock.bwd_depth == 0 and not clock.bwd_deferred
    assert native == [cpp_trigger(trigger)] * 5
    for row in rows[1:]:
        assert row[3 + BACKWARD] >= 8 * MS


def test_only_the_first_gradients_stay_hooked_and_a_missed_trigger_relearns():
    class TwoBranches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)
            self.use_b = True

        def forward(self, x):
            h = self.a(x)
            return SleepInBackward.apply(self.b(h) if self.use_b else h, 4.0)

    model = TwoBranches()
    errors: list = []
    clock = clock_for(model, errors)

    def switch(i, out):
        if i == 1:
            assert len(clock.triggers.hooks) == TRIGGERS  # learned on the first backward
            assert set(clock.triggers.hooks) <= {id(p) for p in model.b.parameters()}
        if i == 2:
            model.use_b = False  # branch b (the triggers) gets no gradient from step 3 on
        if i == 6:  # relearned on step 4's backward
            assert set(clock.triggers.hooks) <= {id(p) for p in model.a.parameters()}
        return out

    rows = train(model, clock, 7, torch.randn(4, 8), before_backward=switch)
    assert errors == []
    assert clock.triggers.misses == 1
    # The step where the trigger missed has no backward; the ones after it do again.
    assert rows[3][3 + BACKWARD] == 0
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[4:])
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[1:3])


def test_learning_hooks_only_the_last_parameters_and_widens_after_a_miss():
    # torch keeps a parameter's C++ post-accumulate-grad hook after its last Python hook is
    # removed (every backward calls it on an empty dict), so a parameter learning ever hooked
    # costs every step for good: learning must not touch the whole model.
    layers = 3 * LEARN_WINDOW  # 2 parameter tensors each: 6 windows
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    params = list(model.parameters())
    errors: list = []
    clock = clock_for(model, errors)
    skip_tail = {"on": False}

    def forward(x):
        # from step 3 on the last half of the model is not used: its triggers get no gradient
        last = layers // 2 if skip_tail["on"] else layers
        for layer in model[:last]:
            x = layer(x)
        return SleepInBackward.apply(x, 4.0)

    model.forward = forward  # type: ignore[method-assign]

    def ever_hooked() -> set[int]:
        return {i for i, p in enumerate(params) if p._post_accumulate_grad_hooks is not None}

    def switch(i, out):
        if i == 1:
            assert ever_hooked() == set(range(len(params) - LEARN_WINDOW, len(params)))
            assert len(clock.triggers.hooks) == TRIGGERS
            assert set(clock.triggers.hooks) <= {id(p) for p in params[-LEARN_WINDOW:]}
        if i == 2:
            skip_tail["on"] = True
        return out

    rows = train(model, clock, 12, torch.randn(2, 4), before_backward=switch)
    assert errors == []
    # Steps 3 and 4 missed: the unused half is 3 windows, so learning watched 2 windows, then
    # 4, which reach the used parameters; the first 2 windows were never hooked.
    assert clock.triggers.misses == 2
    assert [row[3 + BACKWARD] == 0 for row in rows[3:5]] == [True, True]
    hooked = ever_hooked()
    assert min(hooked) == len(params) - 4 * LEARN_WINDOW and max(hooked) == len(params) - 1
    assert set(clock.triggers.hooks) <= {id(p) for p in params[: len(params) // 2]}
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[5:])
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[1:3])


def test_gradients_that_bypass_accumulation_fall_back_to_the_output_hook(trigger):
    # FSDP-style: the parameter's gradient is assigned in backward, never accumulated, so no
    # post-accumulate-grad hook fires; after RELEARN_LIMIT misses the output hook takes over.
    class Assigned(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, owner):  # the parameter is not an input: no AccumulateGrad node
            ctx.save_for_backward(x)
            ctx.owner = owner
            return x @ owner.w.detach()

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            w = ctx.owner.w
            w.grad = x.t() @ grad
            return grad @ w.detach().t(), None

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(8, 8))

        def forward(self, x):
            return SleepInBackward.apply(Assigned.apply(x, self), 4.0)

    model = Model()
    errors: list = []
    clock = clock_for(model, errors)
    x = torch.randn(4, 8, requires_grad=True)
    rows = train(model, clock, RELEARN_LIMIT + 4, x, native=trigger)
    assert errors == []
    assert clock.triggers.output_hooks and clock.triggers.misses == RELEARN_LIMIT + 1
    assert clock.triggers.native is None
    assert all(row[3 + BACKWARD] == 0 for row in rows[: RELEARN_LIMIT + 1])
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[RELEARN_LIMIT + 2 :])


def test_a_split_backward_by_autograd_grad_is_backward_time(trigger):
    # A zero-bubble pipeline schedule (ZB-V, DualPipeV) computes a micro-batch's input
    # gradients, then later its weight gradients, each by torch.autograd.grad and assigns the
    # weights' .grad itself: no parameter hook fires and no callback ends a backward. Both
    # calls are backward time; a gradient taken inside forward (a penalty) stays forward.
    class WithPenalty(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.sleeper, self.penalty = (
                torch.nn.Linear(8, 8),
                Sleeper(24.0),
                Sleeper(4.0),
            )

        def forward(self, x):
            probe = x.detach().requires_grad_()
            (g,) = torch.autograd.grad(self.penalty(probe).sum(), probe)  # forward time
            return self.sleeper(self.lin(x)) + g

    model = WithPenalty()
    errors: list = []
    clock = clock_for(model, errors)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = instrument(clock, model, opt, trigger)
    weights = list(model.parameters())
    try:
        for _ in range(5):
            opt.zero_grad()
            x = torch.randn(4, 8, requires_grad=True)
            loss = model(x).pow(2).mean()
            torch.autograd.grad(loss, [x], retain_graph=True)  # dI: through the 24 ms sleeper
            for w, g in zip(weights, torch.autograd.grad(loss, weights), strict=True):  # dW
                w.grad = g
            opt.step()
    finally:
        hooks.remove()
    assert errors == []
    rows = list(clock.steps)
    assert len(rows) == 5
    for row in rows[1:]:
        phases = row[3:9]
        # dI sleeps 24 ms and dW passes the sleeper again (the loss's graph is kept): ~48 ms
        assert phases[BACKWARD] >= 48 * MS, phases
        # The penalty's 4 ms, not dI's 24 too: the 20 ms between leave room for a loaded
        # machine's late wake-ups (10.1 ms once beside two other test workers).
        assert 4 * MS <= phases[FORWARD] < 24 * MS, phases
        assert sum(phases) <= row[2]


def test_uninstrument_puts_torch_and_the_model_back():
    original, original_grad = torch.autograd.backward, torch.autograd.grad
    model = torch.nn.Linear(4, 1)
    clock = clock_for(model, [])
    hooks = instrument(clock, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert torch.autograd.backward is not original and "forward" in model.__dict__
    assert torch.autograd.grad is not original_grad
    hooks.remove()
    hooks.remove()
    assert torch.autograd.backward is original and torch.autograd.grad is original_grad
    assert "forward" not in model.__dict__
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_no_sync_micro_steps_have_no_exposed_comm_and_no_sync_record(gloo_world_of_one, trigger):
    import contextlib

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    errors: list = []
    clock = clock_for(model, errors, ddp_group="default_pg", ddp_model=model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    hooks = instrument(clock, model, opt, trigger)
    x = torch.randn(4, 8)
    try:
        for _ in range(6):
            opt.zero_grad()
            for micro in range(4):  # gradient accumulation: only the last one synchronises
                ctx = model.no_sync() if micro < 3 else contextlib.nullcontext()
                with ctx:
                    model(x).pow(2).mean().backward()
            opt.step()
    finally:
        hooks.remove()
    assert errors == []
    syncs = [c for c in clock.collectives if c[0] == DDP_GRAD_SYNC]
    assert len(syncs) == 6  # one per step, not one per micro-step
    assert [c[4] for c in syncs] == list(range(6))
    assert all(row[3 + COMM] > 0 for row in clock.steps)


def test_the_cpp_trigger_times_a_ddp_backward_and_its_sync_like_python(gloo_world_of_one):
    # The same DDP model and the same sleeps, Python's hooks then the C++ trigger: backward holds
    # the sleep before the first gradient, the exposed sync is recorded once a step, and no
    # Python gradient hook is ever registered in C++ mode.
    built = native_library.load(torch)
    assert built is not None, "no C++ library for this torch: python -m syncscope.agent.native"
    rows = {}
    for mode, given in (("python", None), ("c++", built)):
        model = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(8, 8), Sleeper(6.0))
        )
        errors: list = []
        clock = clock_for(model, errors, ddp_group="default_pg", ddp_model=model)
        rows[mode] = train(model, clock, 6, torch.randn(4, 8), native=given)
        assert errors == []
        syncs = [c for c in clock.collectives if c[0] == DDP_GRAD_SYNC]
        assert [c[4] for c in syncs] == list(range(6)), mode
        if given is not None:
            assert clock.triggers.native is None  # removed with the other hooks
            assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    for mode, got in rows.items():
        for row in got[1:]:
            assert 6 * MS <= row[3 + BACKWARD] < row[2], (mode, row)
            assert row[3 + COMM] > 0, (mode, row)


def test_a_cpp_trigger_that_never_fires_hands_over_to_python_learning():
    # Native mode watches the last LEARN_WINDOW parameters; from step 3 on they get no gradient.
    # That backward's trigger misses, the Python hooks take over and learn as from the start
    # (windows of 8, 16, then 32, which reach the used half), and the steps after it are timed.
    built = native_library.load(torch)
    assert built is not None, "no C++ library for this torch: python -m syncscope.agent.native"
    layers = 3 * LEARN_WINDOW
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)])
    skip_tail = {"on": False}

    def forward(x):
        for layer in model[: layers // 2 if skip_tail["on"] else layers]:
            x = layer(x)
        return SleepInBackward.apply(x, 4.0)

    model.forward = forward  # type: ignore[method-assign]
    errors: list = []
    clock = clock_for(model, errors)

    def switch(i, out):
        if i == 1:
            assert clock.triggers.native is not None and not clock.triggers.hooks
        if i == 2:
            skip_tail["on"] = True
        return out

    rows = train(model, clock, 12, torch.randn(2, 4), before_backward=switch, native=built)
    assert errors == []
    assert clock.triggers.native is None and clock.triggers.misses == 3
    assert [row[3 + BACKWARD] == 0 for row in rows[2:6]] == [False, True, True, True]
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[6:])


def test_parameters_of_a_tensor_subclass_keep_the_python_hooks():
    # A subclass (DTensor's parameters) would take the C++ op to its own dispatch: Python's.
    class Tagged(torch.nn.Parameter):
        pass

    built = native_library.load(torch)
    assert built is not None, "no C++ library for this torch: python -m syncscope.agent.native"
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Sleeper(4.0))
    model[0].bias = Tagged(torch.zeros(8))
    errors: list = []
    clock = clock_for(model, errors)
    rows = train(model, clock, 4, torch.randn(4, 8), native=built)
    assert errors == []
    assert clock.triggers.native is None and clock.triggers.misses == 0
    assert all(row[3 + BACKWARD] >= 4 * MS for row in rows[1:])


def test_removed_cpp_hooks_no_longer_fire():
    built = native_library.load(torch)
    assert built is not None, "no C++ library for this torch: python -m syncscope.agent.native"
    model = torch.nn.Linear(4, 1)
    clock = clock_for(model, [])
    train(model, clock, 2, torch.randn(2, 4), native=built)  # removes the hooks at the end
    before = built.bwd_done.value
    built.bwd_armed.value = 1
    try:
        model(torch.randn(2, 4)).sum().backward()  # torch's own backward: nothing wrapped now
        assert built.bwd_armed.value == 1 and built.bwd_done.value == before
    finally:
        built.bwd_armed.value = 0


def test_one_clock_at_a_time_holds_the_cpp_trigger():
    # Its state is the process's one: two clocks on it would both read the other's backward.
    # The last to watch holds it; the earlier one learns in Python from then on.
    built = native_library.load(torch)
    assert built is not None, "no C++ library for this torch: python -m syncscope.agent.native"
    first, second = torch.nn.Linear(4, 1), torch.nn.Linear(4, 1)
    one, two = clock_for(first, []), clock_for(second, [])
    hooks = [instrument(one, first, None, built)]
    try:
        assert one.triggers.native is built and not one.triggers.hooks
        hooks.append(instrument(two, second, None, built))
        assert two.triggers.native is built
        assert one.triggers.native is None and one.triggers.hooks  # learning in Python
        first(torch.randn(2, 4)).sum().backward()  # the first model's backward, timed by one
        assert one.acc[BACKWARD] > 0 and two.acc[BACKWARD] == 0
    finally:
        for h in hooks:
            h.remove()
