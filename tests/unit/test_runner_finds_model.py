"""The no-code runner (`python -m syncscope.integrations.run`) finds what `attach()` takes,
whatever wraps it: a DDP module, an FSDP2 root, a pipeline rank's stages (one optimizer over
them, or torchtitan's one per stage), a plain module, a compiled one, a GAN's two models and
their optimizers; and where no module owns the optimizer's parameters it says so once and
attaches to the optimizer only. Each test runs a few steps of a
tiny loop in this process under `AutoAttach` and checks the module(s) it attached with, and
that their forward was timed (the forward phase of every measured step is over 0)."""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.nn.modules.module import _global_forward_pre_hooks  # noqa: E402

from syncscope.integrations.run import AutoAttach  # noqa: E402
from tests.conftest import step_rows  # noqa: E402

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock

STEPS = 4
FORWARD, OPTIMIZER = 4, 6  # a step row: (step, end, total, data, forward, backward, optimizer, ...)


class Block(torch.nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.002)  # a forward long enough to read on a busy machine
        return torch.relu(self.lin(x)) + x


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.fixture
def auto(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    monkeypatch.delenv("SYNCSCOPE_DISABLE", raising=False)
    hooks_before = len(_global_forward_pre_hooks)
    runner = AutoAttach(exporter=None)
    try:
        yield runner
    finally:
        runner.remove()
        if runner.agent is not None:
            runner.agent.close()
    assert len(_global_forward_pre_hooks) == hooks_before


def train(run: Any, optimizers: list[Any], runner: AutoAttach, no_grad: Any = None) -> list[tuple]:
    """STEPS steps of `run(batch)`, each after a forward of `no_grad` (default: `run`) under
    no_grad, as a validation pass or a distillation teacher: not the model to find. Every
    optimizer steps in turn, as torchtitan's container does. Returns the agent's step rows."""
    hooks = len(_global_forward_pre_hooks)
    for step in range(STEPS):
        with torch.no_grad():
            (no_grad or run)(torch.randn(4, 8))
        loss = torch.nn.functional.mse_loss(run(torch.randn(4, 8)), torch.zeros(4, 1))
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        if step == 0:  # attached at the first step; the runner's hooks go at the next forward
            assert runner.agent is not None
    assert runner.agent is not None and len(_global_forward_pre_hooks) == hooks - 1
    return step_rows(runner.agent)


def assert_forward_timed(rows: list[tuple]) -> None:
    assert len(rows) == STEPS - 1, rows  # the first step is not measured
    assert all(row[FORWARD] > 0 for row in rows), [row[FORWARD] for row in rows]


@pytest.mark.parametrize("teacher", [False, True], ids=["alone", "after-a-ddp-teacher"])
def test_ddp_module(gloo_world_of_one: None, auto: AutoAttach, teacher: bool) -> None:
    """The DDP student, not a DDP teacher that runs forward first in each step (under
    no_grad)."""
    ddp = torch.nn.parallel.DistributedDataParallel(Net())
    other = torch.nn.parallel.DistributedDataParallel(Net()) if teacher else None
    rows = train(ddp, [torch.optim.SGD(ddp.parameters(), lr=0.01)], auto, no_grad=other)
    assert auto.model is ddp
    assert_forward_timed(rows)


def test_fsdp2_root(gloo_world_of_one: None, auto: AutoAttach) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
    net = Net()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    rows = train(net, [torch.optim.SGD(net.parameters(), lr=0.01)], auto)
    # the root, not the first sharded block (also an FSDPModule, run inside it)
    assert auto.model is net and isinstance(net, FSDPModule)
    assert_forward_timed(rows)


UPDATE_S = 0.01  # SlowSGD's step: in the optimizer phase only if that optimizer is attached


class SlowSGD(torch.optim.Optimizer):
    """Plain SGD whose step takes UPDATE_S more (not a subclass of torch's SGD: the step hooks
    would run again around its step)."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        time.sleep(UPDATE_S)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


class Stages:
    """A pipeline rank's two stages, called one after the other (as a schedule calls each
    PipelineStage's submod): no module holds both."""

    def __init__(self) -> None:
        self.parts = [Net(depth=1), Block()]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts[1](self.parts[0](x).expand(-1, 8))[:, :1]


@pytest.mark.parametrize("per_stage", [False, True], ids=["one-optimizer", "one-per-stage"])
def test_pipeline_stages(auto: AutoAttach, per_stage: bool) -> None:
    stages = Stages()
    if per_stage:  # torchtitan's OptimizersContainer: the first stage's optimizer steps first
        # (the second's update slow: optimizer time where both are attached)
        optimizers = [torch.optim.SGD(stages.parts[0].parameters(), lr=0.01)]
        optimizers.append(SlowSGD(stages.parts[1].parameters(), lr=0.01))
    else:
        params = [p for part in stages.parts for p in part.parameters()]
        optimizers = [torch.optim.SGD(params, lr=0.01)]
    rows = train(stages, optimizers, auto)
    assert isinstance(auto.model, list) and len(auto.model) == 2
    assert all(a is b for a, b in zip(auto.model, stages.parts, strict=True))
    assert_forward_timed(rows)
    if per_stage:
        assert all(row[OPTIMIZER] >= UPDATE_S * 1e9 for row in rows), [r[OPTIMIZER] for r in rows]


@pytest.mark.parametrize("critic_steps", [1, 5])
def test_gan_both_models_and_both_optimizers(auto: AutoAttach, critic_steps: int) -> None:
    """A GAN's loop: the critic's optimizer steps first (`critic_steps` times, as a WGAN's) and
    the generator's after. The runner waits for the generator's step and attaches with both
    models and both optimizers: each row is one generator step, with the generator's slow
    update in its optimizer phase (attached to the critic's optimizer alone, a row would end at
    each critic step and the update would be `other`)."""
    gen, critic = Net(), Net()
    opt_g = SlowSGD(gen.parameters(), lr=0.01)
    opt_d = torch.optim.SGD(critic.parameters(), lr=0.01)
    hooks = len(_global_forward_pre_hooks)
    for _ in range(STEPS):
        for _ in range(critic_steps):
            fake = gen(torch.randn(4, 8))
            loss_d = critic(fake.expand(-1, 8).detach()).mean() - critic(torch.randn(4, 8)).mean()
            loss_d.backward()
            opt_d.step()
            opt_d.zero_grad()
        assert runner_waits(auto, hooks)
        loss_g = -critic(gen(torch.randn(4, 8)).expand(-1, 8)).mean()
        loss_g.backward()
        opt_g.step()
        opt_g.zero_grad()
        opt_d.zero_grad()
        assert auto.agent is not None
    assert auto.model == [gen, critic] and len(_global_forward_pre_hooks) == hooks - 1
    rows = step_rows(auto.agent)
    assert_forward_timed(rows)
    assert all(row[OPTIMIZER] >= UPDATE_S * 1e9 for row in rows), [r[OPTIMIZER] for r in rows]


def runner_waits(auto: AutoAttach, hooks: int) -> bool:
    """Before the first generator step, not attached yet; after it, attached."""
    return auto.agent is not None or len(_global_forward_pre_hooks) == hooks


def test_a_model_no_optimizer_trains_is_not_waited_for_ever(auto: AutoAttach) -> None:
    """A second module run forward with grad whose parameters no optimizer holds: the runner
    attaches after MAX_STEPS_UNATTACHED optimizer steps with the optimizer it has seen."""
    from syncscope.integrations.run import MAX_STEPS_UNATTACHED

    net, aside = Net(), Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(MAX_STEPS_UNATTACHED + STEPS):
        loss = net(torch.randn(4, 8)).mean() + aside(torch.randn(4, 8)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert (auto.agent is not None) == (step + 1 >= MAX_STEPS_UNATTACHED), step
    assert auto.model == [net, aside] and auto.agent is not None
    assert len(step_rows(auto.agent)) == STEPS


def test_plain_module(auto: AutoAttach) -> None:
    net = Net()
    rows = train(net, [torch.optim.SGD(net.parameters(), lr=0.01)], auto)
    assert auto.model is net
    assert_forward_timed(rows)


def test_compiled_module(auto: AutoAttach) -> None:
    """torch.compile traces the runner's global hook too: it must stay out of the trace (a hook
    that keeps modules made dynamo fail), and the compiled module is found. torch's warning
    about global hooks at a compiled module's call is not shown to the user while the runner's
    is there, and is again once it is gone."""
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    run = torch.compile(net, backend="eager")

    def evaluate() -> None:
        with torch.no_grad():
            run(torch.randn(4, 8))  # the warning's call site, before the first step and after

    with warnings.catch_warnings(record=True) as caught:
        evaluate()
        rows = train(run, [torch.optim.SGD(net.parameters(), lr=0.01)], auto)
        assert [str(w.message) for w in caught if "global hooks" in str(w.message)] == []
        # a global hook of the user's own, after the runner's went: torch's warning is theirs,
        # at a call site where it was ignored before
        handle = torch.nn.modules.module.register_module_forward_hook(lambda *_: None)
        try:
            evaluate()
        finally:
            handle.remove()
    assert [w for w in caught if "global hooks" in str(w.message)], [str(w.message) for w in caught]
    assert auto.model is run
    assert_forward_timed(rows)


def test_a_global_step_hook_of_the_users_own_sees_every_step(auto: AutoAttach) -> None:
    """torch calls the global optimizer step post-hooks while iterating their dict: the runner's
    must not leave it from there, or a hook registered after it (the user's, a profiler's)
    fails the user's optimizer.step (RuntimeError: OrderedDict mutated during iteration)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    stepped: list[int] = []
    handle = register_optimizer_step_post_hook(lambda *_: stepped.append(1))
    try:
        net = Net()
        rows = train(net, [torch.optim.SGD(net.parameters(), lr=0.01)], auto)
    finally:
        handle.remove()
    assert len(stepped) == STEPS and auto.model is net
    assert_forward_timed(rows)


def test_a_script_that_attaches_itself_keeps_its_agent(auto: AutoAttach) -> None:
    """A script with its own attach() under the runner: the runner attaches no second agent
    (both would report as the rank, its steps counted twice)."""
    from syncscope.agent import attach

    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    own = attach(model=net, optimizer=opt, exporter=None)
    try:
        for _ in range(STEPS):
            net(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        assert auto.agent is None
        assert len(step_rows(own)) == STEPS
    finally:
        own.close()


def test_no_module_owns_the_parameters(auto: AutoAttach, caplog: pytest.LogCaptureFixture) -> None:
    """A bare tensor trained through modules without parameters: the runner attaches to the
    optimizer only (steps still measured) and says so once, naming what it saw."""
    weight = torch.nn.Parameter(torch.randn(8, 1))
    act = torch.nn.Tanh()

    def run(x: torch.Tensor) -> torch.Tensor:
        return act(x) @ weight

    with caplog.at_level(logging.WARNING, logger="syncscope.integrations.run"):
        rows = train(run, [torch.optim.SGD([weight], lr=0.01)], auto)
    assert auto.model is None
    assert len(rows) == STEPS - 1 and all(row[FORWARD] == 0 for row in rows)
    warned = [r.getMessage() for r in caplog.records if r.name == "syncscope.integrations.run"]
    assert len(warned) == 1, warned
    assert "optimizer only" in warned[0] and "Tanh" in warned[0] and "SGD" in warned[0]


def test_the_page_says_which_ranks_time_no_model():
    """A rank attached to the optimizer only (the runner found no model) times no forward and
    no backward: the page names it once it has stepped a while, and no other rank."""
    from fastapi.testclient import TestClient
    from syncscope.exporter.app import create_app
    from syncscope.exporter.settings import Settings

    from tests.unit.test_warm_up import MS, Job

    def step(n: int, model: bool) -> list[int]:
        phases = (10, 20, 30, 10, 5, 0) if model else (10, 0, 0, 60, 5, 0)
        return [n, (5_000 + n) * 10**9, 75 * MS, *(ms * MS for ms in phases)]

    with TestClient(create_app(Settings())) as client:
        job = Job(client)
        job.start()
        job.post(0, [step(n, model=False) for n in range(5)])
        job.post(1, [step(n, model=True) for n in range(5)])
        assert "no forward or backward timed" not in client.get("/").text  # too early to say
        job.post(0, [step(n, model=False) for n in range(5, 20)])
        job.post(1, [step(n, model=True) for n in range(5, 20)])
        page = client.get("/").text
    assert page.count("no forward or backward timed") == 1
    assert "rank 0: no forward or backward timed" in page  # rank 0 alone, not "ranks 0–1"
