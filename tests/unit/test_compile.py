"""Attaching syncscope never changes what torch.compile captures: the same graphs, of the same
nodes, with and without the agent, attached before or after compiling; phases still measured,
and each step's samples still read from the model's inputs."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from syncscope.agent import attach  # noqa: E402

from tests.conftest import step_rows  # noqa: E402


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) + x


class Net(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(width) for _ in range(depth))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Penalised(Net):
    """A gradient penalty in forward: torch.autograd.grad inside the compiled function (dynamo
    breaks the graph there; the agent's wrapper of torch.autograd.grad must not move that)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probe = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(self.head(probe).sum(), probe, create_graph=True)
        return super().forward(x) + g.pow(2).sum()


def sequential() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def captured(make, when: str | None, per_block: bool, steps: int = 3) -> tuple[list, list, list]:
    """(node count of every graph dynamo handed the backend, forward ns per step, samples per
    step)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    graphs: list[int] = []

    def counting(gm, _inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None) if when == "before" else None
    if per_block:  # the torchtitan way: each block compiled, the root left eager
        for block in model.blocks:
            block.compile(backend=counting)
        run = model
    else:
        run = torch.compile(model, backend=counting)
    if when == "after":
        agent = attach(model=run, optimizer=opt, exporter=None)
    try:
        for _ in range(steps):
            run(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        forward = [row[4] for row in step_rows(agent)] if agent is not None else []
        samples = [row[9] for row in step_rows(agent)] if agent is not None else []
    finally:
        if agent is not None:
            agent.close()
    return graphs, forward, samples


@pytest.mark.parametrize(
    "make,per_block",
    [(Net, False), (sequential, False), (Net, True), (Penalised, False)],
    ids=["whole-model", "torch.nn-container", "per-block", "autograd.grad-in-forward"],
)
@pytest.mark.parametrize("when", ["before", "after"])
def test_the_same_graphs_are_captured_with_the_agent(make, per_block, when, monkeypatch):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    without, _, _ = captured(make, None, per_block)
    assert without, "the counting backend saw no graph even without the agent"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_agent, forward, samples = captured(make, when, per_block)
    assert with_agent == without
    assert len(forward) == 3 and all(ns > 0 for ns in forward), forward
    assert samples == [4, 4, 4]
    # nor does dynamo meet the agent's clock reads (it warns, and breaks the graph there)
    assert not [w for w in caught if "perf_counter" in str(w.message)], caught


@pytest.mark.parametrize("when", ["before", "after"])
def test_per_block_compile_under_fsdp2_captures_the_same_graphs(
    gloo_world_of_one, when, monkeypatch
):
    """torchtitan's layout: fully_shard on every block and the root, each block compiled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))

    def sharded() -> torch.nn.Module:
        net = Net()
        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        return net

    without, _, _ = captured(sharded, None, per_block=True)
    assert without
    with_agent, forward, samples = captured(sharded, when, per_block=True)
    assert with_agent == without
    assert len(forward) == 3 and all(ns > 0 for ns in forward), forward
    assert samples == [4, 4, 4]
