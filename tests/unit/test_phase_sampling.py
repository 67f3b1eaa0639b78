"""Phase sampling (`phase_every`, agent/phases.py): the phases of one step in N are timed, the same
steps on every rank; the steps between them count their total and work, report the last timed
step's phase shares, and on CUDA record one event. A real DDP loop in a gloo world of one for the
CPU clock; the fake stream of test_cuda_timing for the CUDA one."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

from syncscope.agent import attach  # noqa: E402
from syncscope.agent.phases import FORWARD, ROW_PHASES, ROW_WORK  # noqa: E402

from syncscope.wire import DDP_GRAD_SYNC, AgentInfo  # noqa: E402
from tests.unit.test_cuda_timing import Loop  # noqa: E402

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock

EVERY = 4
STEPS = 12
# Every EVERY-th step, and step 1: the first step's phases are start-up's, so the steps after
# it are timed until one gives the shares the quiet steps carry.
TIMED = [0, 1, *range(EVERY, STEPS, EVERY)]


def last_timed(step: int) -> int:
    return max(t for t in TIMED if t <= step)


class Sleepy(torch.nn.Module):
    """A forward of `ms` milliseconds (set per step by the loop)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 1)
        self.ms = 10.0

    def forward(self, x):
        time.sleep(self.ms / 1e3)
        return self.lin(x)


def run_ddp(phase_every: int, **settings) -> tuple[list[tuple], list[tuple], dict, dict]:
    """STEPS steps of a DDP job whose step 6's forward sleeps 40 ms instead of 10: its step
    rows, its collective records, the agent's stats, and who it says it is to the exporter."""
    module = Sleepy()
    model = torch.nn.parallel.DistributedDataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # No flush while the loop runs: the test reads the queues themselves.
    agent = attach(
        model=model,
        optimizer=opt,
        exporter=None,
        flush_interval_s=3600,
        phase_every=phase_every,
        **settings,
    )
    try:
        x = torch.randn(4, 8)
        for step in range(STEPS):
            module.ms = 40.0 if step == 6 else 10.0
            time.sleep(0.005)  # data
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        # as the reporter sends them: the quiet rows made whole, their estimated syncs added
        rows, colls = list(agent.queues.steps), list(agent.queues.collectives)
        colls += agent.clock.finish(rows)
        return rows, colls, dict(agent.stats), agent.identity
    finally:
        agent.close()


def shares(row: tuple) -> list[float]:
    return [ns / row[2] for ns in row[ROW_PHASES:ROW_WORK]]


def test_only_every_nth_step_is_timed_and_the_others_carry_its_shares(
    gloo_world_of_one, monkeypatch
):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    rows, colls, stats, identity = run_ddp(EVERY)
    assert stats["errors"] == 0
    # The exporter is told, so that it shows these phases as estimates (wire.AgentInfo).
    assert AgentInfo(**identity).phase_every == EVERY
    assert [r[0] for r in rows] == list(range(STEPS))
    by_step = {r[0]: r for r in rows}
    for r in rows:
        assert sum(r[ROW_PHASES:ROW_WORK]) <= r[2]  # phases never exceed the step
        assert r[ROW_WORK] == 4  # the batch is read in every step, timed or not
    for step in TIMED:  # measured: each phase holds its sleep
        phases = by_step[step][ROW_PHASES:ROW_WORK]
        assert phases[FORWARD] >= 10e6 and phases[0] >= 5e6, (step, phases)
    for step in set(range(STEPS)) - set(TIMED):
        timed = by_step[last_timed(step)]
        assert shares(by_step[step]) == pytest.approx(shares(timed), abs=1e-6), step
    # Step 6's slow forward is in its total, not in its (estimated) forward share; the next
    # timed step measures its own forward again.
    # (sleeps never end early: its 5 ms of data and 40 ms of forward are a floor under load;
    # a margin over step 5's total failed whenever the host delayed step 5 by 5 ms)
    assert by_step[6][2] >= 45e6, by_step[6]
    assert shares(by_step[6])[FORWARD] == pytest.approx(shares(by_step[4])[FORWARD], abs=1e-6)
    # DDP's sync: measured on the timed steps; on the quiet ones an estimate, the timed sync's
    # share of its step times the quiet step's total, so that waits and calls per step keep
    # their meaning. DDP's bucket all-reduce is never taken for a collective of its own in a
    # quiet step (the backward's depth is still kept).
    syncs = {c[4]: c[3] for c in colls if c[0] == DDP_GRAD_SYNC}
    assert sorted(syncs) == list(range(STEPS)), colls
    for step in set(range(STEPS)) - set(TIMED):
        timed = last_timed(step)
        share = syncs[timed] / by_step[timed][2]
        assert syncs[step] == int(share * by_step[step][2]), (step, syncs)
    assert not [c for c in colls if c[0] == "all_reduce"], colls


def test_with_pacing_every_step_is_timed(gloo_world_of_one, monkeypatch):
    """Pacing answers each step's first wait: a pacer turns sampling off."""
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    _rows, colls, stats, identity = run_ddp(EVERY, pacing=True)
    assert stats["errors"] == 0
    assert AgentInfo(**identity).phase_every == 1
    assert [c[4] for c in colls if c[0] == DDP_GRAD_SYNC] == list(range(STEPS))


def test_phase_every_is_checked():
    with pytest.raises(ValueError, match="phase_every must be 1 or more"):
        attach(phase_every=0)


def test_cuda_quiet_steps_record_one_event_and_carry_the_gpu_shares():
    """On the fake stream: a quiet step records only its end (every step's GPU time is still
    measured) and reports the last timed GPU step's shares of its own GPU total."""
    recorded: list[int] = []
    loop = Loop()
    loop.clock.phase_every = EVERY
    record = loop.clock.event_factory

    def counting_factory():
        event = record()
        inner = event.record

        def counted(stream=None):
            recorded.append(loop.clock.step)
            inner(stream)

        event.record = counted
        return event

    loop.clock.event_factory = counting_factory
    for step in range(STEPS):
        loop.step(backward=30.0 if step == 6 else 9.0)
    loop.stream.run_all()
    assert loop.clock.resolve() == STEPS and loop.errors == []
    per_step = [recorded.count(s) for s in range(STEPS)]
    # events are reused once resolved, so count records, not events created
    assert per_step == [7 if s in TIMED else 1 for s in range(STEPS)], per_step
    rows = {r[0]: r for r in loop.steps}
    assert rows[6][2] == pytest.approx(rows[5][2] + 21 * 1e6)  # the slow backward: its total
    for step in range(1, STEPS):
        assert sum(rows[step][ROW_PHASES:ROW_WORK]) <= rows[step][2]
        if step not in TIMED:
            timed = rows[last_timed(step)]
            assert shares(rows[step]) == pytest.approx(shares(timed), abs=1e-6), step
    # the GPU's own phases on timed steps: 5 ms forward of a 24.5 ms step
    assert rows[4][ROW_PHASES + FORWARD] == pytest.approx(5e6)
    # DDP's sync: the GPU's exposed 4 ms on timed steps; on quiet ones its share of the step
    # (4 / 24.5) times the quiet step's GPU total (step 0 is timed on the CPU: no start event)
    syncs = {c[4]: c[3] for c in loop.colls}
    assert sorted(syncs) == list(range(STEPS))
    for step in range(EVERY, STEPS):
        expected = 4e6 if step in TIMED else int(4 / 24.5 * rows[step][2])
        assert syncs[step] == pytest.approx(expected, abs=1), (step, syncs)


def test_cuda_quiet_steps_that_go_out_on_cpu_carry_the_cpu_estimate():
    """A quiet step the GPU never resolved (here: the clock stopped before any query) goes out
    with the CPU clock's estimate, its timed step's CPU shares of its own total, and a DDP
    sync of the timed step's share; the training thread left both to the resolver side."""
    loop = Loop()
    loop.clock.phase_every = EVERY
    for _ in range(STEPS):
        loop.step()
    assert len(loop.steps) == 0 and len(loop.colls) == 0  # all still pending
    loop.clock.stop(timeout=0)
    assert loop.errors == [] and loop.clock.cpu_steps == STEPS
    rows = {r[0]: r for r in loop.steps}
    assert sorted(rows) == list(range(STEPS))
    syncs = {c[4]: c[3] for c in loop.colls}
    assert sorted(syncs) == list(range(STEPS))
    for step in set(range(STEPS)) - set(TIMED):
        timed = rows[last_timed(step)]
        assert sum(shares(timed)) > 0
        # µs-long CPU steps: the integer phases round to within a few parts in 10^4
        assert shares(rows[step]) == pytest.approx(shares(timed), abs=1e-3), step
        assert syncs[step] == int(syncs[timed[0]] / timed[2] * rows[step][2]), step
