"""Phase boundaries on a real single-process torch loop, with known sleeps in known phases."""

from __future__ import annotations

import json
import statistics
import time

import pytest

torch = pytest.importorskip("torch")

from syncscope.agent import attach  # noqa: E402


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
