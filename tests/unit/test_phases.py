"""Phase boundaries on a real single-process torch loop, with known sleeps in known phases."""

from __future__ import annotations

import json
import statistics
import time

import pytest

torch = pytest.importorskip("torch")

from syncscope.agent import attach  # noqa: E402

from tests.conftest import step_rows  # noqa: E402

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock


class Sleepy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)

    def forward(self, x):
        time.sleep(0.010)
        return self.lin(x)


def test_phases_match_injected_sleeps_and_add_up(tmp_path):
    record = tmp_path / "steps.jsonl"
    model = Sleepy()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = attach(model=model, optimizer=opt, record=str(record), exporter=None)
    x = torch.randn(4, 8)
    for _ in range(12):
        time.sleep(0.015)  # "data loading"
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        time.sleep(0.005)  # loss bookkeeping: lands in "other"
        loss.backward()
        opt.step()
    agent.close()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    rows = [line for line in lines if "event" not in line][1:]  # steps, not the startup
    assert len(rows) == 11
    for row in rows:
        p = row["phases"]
        assert sum(p.values()) == pytest.approx(row["step_s"], rel=0.01)
        # A sleep never ends early, so each phase holds at least its own sleep in every row...
        assert p["data"] >= 0.015 and p["forward"] >= 0.010 and p["other"] >= 0.005
        assert p["comm_exposed"] == 0.0  # not DDP: nothing to wait for
    # ...and no more than it, give or take the host's scheduling: a phase that took its
    # neighbour's sleep (data holding the forward's 10 ms) would be over these in most rows.
    assert statistics.median(row["phases"]["data"] for row in rows) < 0.024
    assert statistics.median(row["phases"]["forward"] for row in rows) < 0.014
    assert agent.stats["errors"] == 0


class SlowStep(torch.optim.Optimizer):
    """Plain SGD whose update takes 8 ms after the closure (its own step: a subclass calling
    super().step() would fire the step hooks twice once the parent's step is hooked too)."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            loss = closure() if closure is not None else None
        update(self)
        return loss


def update(opt: torch.optim.Optimizer) -> None:
    """SlowStep's update: plain SGD, then 8 ms."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                p.add_(p.grad, alpha=-group["lr"])
    time.sleep(0.008)


def test_a_closure_inside_the_optimizer_step_is_not_optimizer_time(tmp_path):
    """Lightning's automatic optimization runs forward and backward inside
    optimizer.step(closure): the closure's time is forward and backward, the update after it
    the optimizer's, and the phases still add up to the step (they held the closure twice)."""
    rows = closure_steps(tmp_path, SlowStep)
    for p in rows:
        assert p["data"] >= 0.015 and p["forward"] >= 0.010 and p["optimizer"] >= 0.008
    # the optimizer phase is the update (8 ms), not the closure's forward (10 ms) with it
    assert statistics.median(p["optimizer"] for p in rows) < 0.014


def closure_steps(tmp_path, kind, before=None, **config) -> list[dict[str, float]]:
    """The phases of 11 steps of a Sleepy model trained through `kind(params).step(closure)`
    after 15 ms of "data loading" each (then `before(agent)`), the agent attached with
    `config`: each step's phases add up to it, and no error was counted."""
    record = tmp_path / "steps.jsonl"
    model = Sleepy()
    opt = kind(model.parameters())
    agent = attach(model=model, optimizer=opt, record=str(record), exporter=None, **config)
    x = torch.randn(4, 8)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    for _ in range(12):
        time.sleep(0.015)
        if before is not None:
            before(agent)
        opt.step(closure)
    agent.close()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    rows = [line for line in lines if "event" not in line][1:]
    assert len(rows) == 11
    for row in rows:
        assert sum(row["phases"].values()) == pytest.approx(row["step_s"], rel=0.01)
    assert agent.stats["errors"] == 0
    return [row["phases"] for row in rows]


class TwoPassStep(torch.optim.Optimizer):
    """A SAM-like step: the closure, 12 ms of the optimizer's own work (SAM's perturbation, an
    L-BFGS's line search), the closure again, then SlowStep's 8 ms update."""

    def __init__(self, params) -> None:
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        with torch.enable_grad():
            closure()
        time.sleep(0.012)
        with torch.enable_grad():
            loss = closure()
        update(self)
        return loss


@pytest.mark.parametrize("native", [True, False], ids=["hooks-in-c", "python"])
def test_the_optimizers_work_between_closures_is_optimizer_time(tmp_path, native):
    """optimizer.step(closure) running the closure twice: the 12 ms between the two closures is
    the optimizer's, not the second forward's data (it was: data held it, every step)."""
    rows = closure_steps(tmp_path, TwoPassStep, native_backward=native)
    for p in rows:
        assert p["data"] >= 0.015 and p["forward"] >= 0.020 and p["optimizer"] >= 0.020
    # data is the 15 ms before the step, not with the 12 ms between the closures (27 ms)
    assert statistics.median(p["data"] for p in rows) < 0.024


@pytest.mark.parametrize("native", [True, False], ids=["hooks-in-c", "python"])
def test_a_wait_before_a_closure_step_is_counted_once(tmp_path, native):
    """A collective waited for between steps (Lightning's logging reduction, as the training
    thread's blocked time): exposed communication, and out of data, whose span it fell in; the
    phases still add up to the step (the wait was in data and comm both, 5 % over the step on
    a loaded machine under Lightning)."""
    from syncscope.agent.collectives import Blocked

    def wait(agent) -> None:
        blocked = agent.clock.blocked
        if blocked is None:
            blocked = agent.clock.blocked = Blocked()
        time.sleep(0.008)
        blocked.ns += 8_000_000

    rows = closure_steps(tmp_path, TwoPassStep, before=wait, native_backward=native)
    for p in rows:
        assert p["comm_exposed"] >= 0.008 and p["data"] >= 0.015 and p["optimizer"] >= 0.020
    assert statistics.median(p["data"] for p in rows) < 0.024


@pytest.mark.parametrize("critic_first", [True, False])
def test_several_optimizers_end_a_step_once_each_has_stepped(tmp_path, critic_first):
    """A GAN's loop (a critic stepped twice, then the generator once), both optimizers given to
    attach() in either order: one step row per iteration, ending at the generator's step; every
    optimizer step is optimizer time, and the critic's steps are not the next forward's data
    (they were, as well, before: data held its two 8 ms updates again)."""
    record = tmp_path / "steps.jsonl"
    generator, critic = Sleepy(), Sleepy()
    opt_g, opt_c = SlowStep(generator.parameters()), SlowStep(critic.parameters())
    optimizers = (opt_c, opt_g) if critic_first else [opt_g, opt_c]
    agent = attach(
        model=[generator, critic], optimizer=optimizers, record=str(record), exporter=None
    )
    x = torch.randn(4, 8)
    for _ in range(10):
        time.sleep(0.015)  # "data loading"
        for _ in range(2):
            opt_c.zero_grad()
            critic(x).pow(2).mean().backward()
            opt_c.step()
        opt_g.zero_grad()
        generator(x).pow(2).mean().backward()
        opt_g.step()
    agent.close()
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    rows = [line for line in lines if "event" not in line][1:]  # the first is the startup's
    assert [row["step"] for row in rows] == list(range(1, 10))
    for row in rows:
        p = row["phases"]
        assert sum(p.values()) == pytest.approx(row["step_s"], rel=0.01)
        assert p["data"] >= 0.015 and p["forward"] >= 0.030 and p["optimizer"] >= 0.024, p
    assert statistics.median(row["phases"]["data"] for row in rows) < 0.023
    assert statistics.median(row["phases"]["optimizer"] for row in rows) < 0.032
    assert agent.stats["errors"] == 0


def test_manual_steps_and_a_hook_failure_never_reach_the_loop(tmp_path):
    record = tmp_path / "steps.jsonl"
    agent = attach(record=str(record), exporter=None)
    agent.clock.steps = None  # break the agent's internals on purpose
    for _ in range(3):
        with agent.step():
            time.sleep(0.002)
    assert agent.stats["errors"] == 3
    agent.close()


def test_unknown_setting_is_a_clear_error():
    with pytest.raises(TypeError, match="unknown settings: colour"):
        attach(colour="blue")


def test_disable_switch_returns_an_inert_agent(monkeypatch):
    monkeypatch.setenv("SYNCSCOPE_DISABLE", "1")
    agent = attach()
    with agent.step():
        pass
    agent.close()
    assert agent.stats["steps"] == 0


HOOK_S = 0.03  # a forward hook's sleep


def sleepy_hook(*_args) -> None:
    time.sleep(HOOK_S)


def run_with_hook(register, when: str, steps: int, after: int = 0, **settings) -> tuple:
    """A model with `register(model)` as its hook (before or after attach): `steps` steps, then
    the hook removed and `after` steps more; every step timed unless `settings` say otherwise.
    (rows, the agent's errors, the model's forward pre-hooks and hooks left after the last
    step)."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = register(model) if when == "before" else None
    settings = {"phase_every": 1, **settings}
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600, **settings)
    try:
        if handle is None:
            handle = register(model)
        x = torch.randn(4, 8)
        for i in range(steps + after):
            if i == steps:
                handle.remove()
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        left = (len(model._forward_pre_hooks), len(model._forward_hooks))
        return step_rows(agent), agent.stats["errors"], left
    finally:
        agent.close()
    handle.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks  # ours went at close


def phases_of(row: tuple) -> dict[str, int]:
    _step, _end, total, data, fwd, bwd, optim, comm, pacing, _samples, _tokens = row
    return {"data": data, "forward": fwd, "other": total - data - fwd - bwd - optim - comm - pacing}


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize(
    "register",
    [
        lambda m: m.register_forward_pre_hook(sleepy_hook),
        lambda m: m.register_forward_hook(sleepy_hook),
        lambda m: m.register_forward_pre_hook(sleepy_hook, prepend=True, with_kwargs=True),
    ],
    ids=["pre-hook", "post-hook", "prepended-pre-hook"],
)
def test_the_models_forward_hooks_are_forward_time(register, when, monkeypatch):
    """nn.Module runs a model's forward hooks outside its forward (FSDP2's root pre-forward
    is one): their time is forward, not data loading (pre-hooks) nor `other` (post-hooks).
    A hook registered after attach counts from the step after its first call (that call's
    pre-hooks had run before anything saw them); one prepended later (FSDP2's way) too. Once
    the hook is removed, ours go: the model is back on nn.Module's fast path."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    rows, errors, left = run_with_hook(register, when, steps=6, after=2)
    assert errors == 0
    hooked, unhooked = [phases_of(r) for r in rows[2:6]], [phases_of(r) for r in rows[6:]]
    for p in hooked:  # a sleep never ends early
        assert p["forward"] >= HOOK_S * 1e9, rows
    assert statistics.median(p["data"] for p in hooked) < HOOK_S / 2 * 1e9, rows
    assert statistics.median(p["other"] for p in hooked) < HOOK_S / 2 * 1e9, rows
    assert left == (0, 0)
    assert all(p["forward"] < HOOK_S * 1e9 for p in unhooked), rows


def test_hooked_forwards_keep_phase_sampling(monkeypatch):
    """With phase_every: the timed steps have the pre-hook's time in forward, the quiet ones
    carry their shares."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    rows, errors, _left = run_with_hook(
        lambda m: m.register_forward_pre_hook(sleepy_hook), "before", steps=8, phase_every=2
    )
    assert errors == 0 and [r[0] for r in rows] == list(range(8))
    for step in (2, 4, 6):
        timed, quiet = rows[step], rows[step + 1]
        assert phases_of(timed)["forward"] >= HOOK_S * 1e9, rows
        assert phases_of(timed)["data"] < phases_of(timed)["forward"], rows
        shares = [ns / timed[2] for ns in timed[3:9]]
        assert [ns / quiet[2] for ns in quiet[3:9]] == pytest.approx(shares, abs=1e-6), rows


def test_hooks_added_around_ours_after_attach_are_forward_time(monkeypatch):
    """The model had a hook at attach (ours went around it); later a pre-hook is prepended
    (FSDP2's fully_shard after attach) and a hook appended: ours move to stay first and last."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)

    def register(model: torch.nn.Module) -> object:
        if model._forward_pre_hooks:  # after attach: around ours
            model.register_forward_pre_hook(sleepy_hook, prepend=True)
            return model.register_forward_hook(sleepy_hook)
        return model.register_forward_pre_hook(lambda *_: None)

    model = torch.nn.Linear(8, 1)
    register(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
    try:
        register(model)
        for _ in range(5):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        rows = [phases_of(r) for r in step_rows(agent)[1:]]
        assert agent.stats["errors"] == 0
    finally:
        agent.close()
    for p in rows:
        assert p["forward"] >= 2 * HOOK_S * 1e9, rows
    assert statistics.median(p["data"] for p in rows) < HOOK_S / 2 * 1e9, rows
    assert statistics.median(p["other"] for p in rows) < HOOK_S / 2 * 1e9, rows
