"""How attach() composes the agent: shared queues, the local estimate only when read, and one
interface (`RankAgent`) whether the agent runs or not."""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")

import torch.distributed as dist  # noqa: E402
from syncscope.agent import Agent, RankAgent, attach  # noqa: E402
from syncscope.agent.core import InertAgent  # noqa: E402

# What integrations and users may touch: RankAgent's members.
MEMBERS = {n for n in vars(RankAgent) if not n.startswith("_")} | set(RankAgent.__annotations__)


@pytest.fixture
def agents():
    made: list = []

    def make(**config) -> Agent:
        agent = attach(exporter=None, **config)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def test_producers_and_reporter_share_one_pair_of_queues(agents):
    agent = agents()
    q = agent.queues
    assert agent.clock.steps is q.steps and agent.clock.collectives is q.collectives
    assert agent.reporter.steps is q.steps and agent.reporter.collectives is q.collectives
    assert q.collectives.maxlen == 4 * q.steps.maxlen == 4 * agent.config.queue_size
    assert agent.patch is not None and agent.patch.sink is q.collectives
    assert agent.clock.blocked is agent.patch.blocked
    for _ in range(3):
        with agent.step():
            pass
    assert q.current_step() == agent.clock.step == 3
    assert [s[0] for s in q.steps] == [0, 1, 2]


def test_no_local_estimate_unless_pacing_or_the_record_file_reads_it(agents, tmp_path):
    plain = agents()
    assert plain.arrival is None and plain.record is None and plain.pacer is None
    assert plain.reporter.on_drained is None and plain.reporter.on_reply is None
    assert plain.clock.pacer is None and plain.reporter.pacing_state is None

    recorded = agents(record=str(tmp_path / "r{rank}.jsonl"))
    assert recorded.arrival is not None and recorded.arrival.record is recorded.record
    assert recorded.reporter.on_drained == recorded.arrival.drained
    assert recorded.reporter.on_reply == recorded.arrival.merge_reply
    assert recorded.pacer is None and recorded.clock.pacer is None
    assert recorded.record.path == str(tmp_path / "r0.jsonl")

    paced = agents(pacing=True)
    assert paced.arrival is not None and paced.record is None
    assert paced.reporter.on_drained == paced.arrival.drained
    step_pacer = paced.clock.pacer.__self__
    assert step_pacer.controller is paced.pacer and step_pacer.baseline is paced.arrival
    assert paced.reporter.pacing_state == paced.pacer.state


def test_the_inert_agent_has_the_same_interface(monkeypatch, agents):
    live = agents()
    monkeypatch.setenv("SYNCSCOPE_DISABLE", "1")
    inert = attach()
    assert isinstance(inert, InertAgent)
    assert {
        "step",
        "count",
        "checkpoint",
        "close",
        "errors",
        "last_error",
        "dropped_total",
        "stats",
    } == MEMBERS
    for name in MEMBERS:
        assert hasattr(live, name) and hasattr(inert, name), name
    assert inert.stats.keys() == live.stats.keys()
    with inert.step():
        inert.count(samples=4, tokens=16)
    with inert.checkpoint("load"):
        pass
    inert.close()
    inert.close()
    assert (inert.errors, inert.last_error, inert.dropped_total) == (0, None, 0)
    assert live.dropped_total == live.reporter.dropped_total == 0


def test_a_failed_attach_leaves_the_process_as_it_was(tmp_path):
    before = dist.Work.wait
    agent = attach(exporter=None, record=str(tmp_path / "missing" / "dir" / "r.jsonl"))
    assert isinstance(agent, InertAgent)
    assert dist.Work.wait is before  # the interceptor was never installed
    with agent.step():
        time.sleep(0)


def test_a_closed_agent_holds_neither_the_model_nor_its_parameters(gloo_world_of_one):
    import gc
    import weakref

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    alive = weakref.ref(model), weakref.ref(model.module.weight), weakref.ref(opt)
    agent.close()
    del model, opt, agent
    gc.collect()
    # the exit hook kept a closed agent, its clock the DDP model (its process group, gloo's
    # threads) and parameters, until the interpreter exited
    assert [ref() for ref in alive] == [None, None, None]


@pytest.mark.parametrize("native_backward", [True, False])
def test_a_cpu_job_triggers_its_backward_from_cpp_unless_told_not_to(
    gloo_world_of_one, native_backward
):
    """attach() on CPU gives the clock the C++ library (which `scripts/setup` builds) for the
    backward's trigger; `native_backward=False` keeps Python's gradient hooks. Either way every
    step has a backward and DDP's exposed sync."""
    from syncscope.agent.phases import BACKWARD, COMM, ROW_PHASES

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(
        model=model,
        optimizer=opt,
        exporter=None,
        flush_interval_s=3600,
        native_backward=native_backward,
    )
    try:
        for _ in range(4):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        triggers = agent.clock.triggers  # type: ignore[attr-defined]
        assert (triggers.native is not None) == native_backward
        assert bool(triggers.hooks) != native_backward  # Python's hooks only without it
        rows = list(agent.clock.steps)  # type: ignore[attr-defined]
        assert len(rows) == 4
        for row in rows:
            assert row[ROW_PHASES + BACKWARD] > 0 and row[ROW_PHASES + COMM] > 0, row
    finally:
        agent.close()


def gan() -> tuple:
    """A GAN's generator and critic, each DDP on the default group, and their optimizers."""
    ddp = torch.nn.parallel.DistributedDataParallel
    generator, critic = ddp(torch.nn.Linear(8, 8)), ddp(torch.nn.Linear(8, 1))
    opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
    opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
    return generator, critic, opt_g, opt_c


def gan_steps(n, generator, critic, opt_g, opt_c, after_step=lambda: None) -> None:
    """`n` GAN steps: the critic's on the generator's output, then the generator's through it."""
    for _ in range(n):
        fake = generator(torch.randn(4, 8))
        opt_c.zero_grad()
        critic(fake.detach()).mean().backward()
        opt_c.step()
        opt_g.zero_grad()
        (-critic(fake).mean()).backward()
        opt_g.step()
        after_step()


@pytest.mark.parametrize("phase_every", [1, 4])
def test_a_gans_two_ddp_models_are_one_sync_and_its_two_optimizers_one_step(
    gloo_world_of_one, phase_every
):
    """attach(model=[generator, critic], optimizer=[...]), both DDP on one group: DDP's sync is
    timed at each backward (the critic's own loss, the generator's through both), with both
    models' bytes; their buckets are not counted again as all-reduces; the sync is due unless
    both are under no_sync(); one step row per iteration, timed or sampled."""
    from syncscope.agent.phases import COMM, ROW_PHASES

    from syncscope.wire import DDP_GRAD_SYNC

    generator, critic, opt_g, opt_c = gan()
    agent = attach(
        model=[generator, critic],
        optimizer=[opt_g, opt_c],
        exporter=None,
        flush_interval_s=3600,
        phase_every=phase_every,
    )
    try:
        gan_steps(8, generator, critic, opt_g, opt_c)
        clock = agent.clock  # type: ignore[attr-defined]
        synced = clock.ddp_model
        with generator.no_sync():
            assert synced.require_backward_grad_sync
            with critic.no_sync():
                assert not synced.require_backward_grad_sync
        assert synced.require_backward_grad_sync
        rows = list(clock.steps)
        assert [row[0] for row in rows] == list(range(8))
        agent.patch.poll()  # type: ignore[attr-defined]
        ops = [c[0] for c in agent.queues.collectives]  # type: ignore[attr-defined]
        assert "all_reduce" not in ops, ops
        syncs = [c for c in agent.queues.collectives if c[0] == DDP_GRAD_SYNC]  # type: ignore[attr-defined]
        assert {c[2] for c in syncs} == {4.0 * (8 * 8 + 8 + 8 + 1)}
        if phase_every == 1:
            assert len(syncs) == 2 * len(rows)
            assert all(row[ROW_PHASES + COMM] > 0 for row in rows), rows
        assert agent.errors == 0
    finally:
        agent.close()


def _looks_at(agent, t):
    """The agent's StoppedSteps look on the clock `t` ([seconds]), with its floors (3 s to ask,
    30 s to tell) off: it asks after 3 steps' time, tells after 10."""
    look = agent.stopped_steps  # type: ignore[attr-defined]
    look.now, look.floor_s, look.ask_s = lambda: t[0], 0.0, 0.0

    def at(seconds):
        t[0] = seconds
        look()

    return at


def _train(model, x, optimizer, steps, between=None):
    for _ in range(steps):
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
        if between is not None:
            between()


@pytest.mark.parametrize("in_c", [True, False], ids=["hooks-in-c", "hooks-in-python"])
def test_a_new_optimizer_that_trains_the_model_is_followed(caplog, in_c):
    """The loop replaces its optimizer (staged unfreezing): once the reporter's look sees the
    forwards go on with no step, the steps end at the new optimizer's. The step between (the
    new one's first step and the forwards before it, 0.3 s slept in it) is in no row, the steps
    count on from its number, another model's optimizer is not followed, and the global hook
    that found it is gone at the next forward."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(
        model=model, optimizer=opt, exporter=None, flush_interval_s=3600, native_backward=in_c
    )
    x = torch.randn(4, 8)
    follower = agent.new_optimizer  # type: ignore[attr-defined]
    assert agent.clock.work.on_batches is None  # type: ignore[attr-defined] # the reporter looks
    other = torch.nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    at = _looks_at(agent, [0.0])
    try:
        with caplog.at_level("WARNING", logger="syncscope.agent"):
            at(0)
            _train(model, x, opt, 1)
            at(1)  # the first change seen: it may hold the start-up
            _train(model, x, opt, 4)
            at(2)  # 0.25 s a step
            new = torch.optim.AdamW(model.parameters())
            _train(model, x, new, 2)
            at(2.5)  # 0.5 s, under the line (0.75 s)
            assert follower.handle is None and agent.clock.at_forward is None  # type: ignore[attr-defined]
            _train(model, x, new, 2)
            at(3)  # 1 s: asked (and 2.5 s to the warning)
            _train(other, torch.randn(1, 2), other_opt, 1)
            time.sleep(0.3)
            _train(model, x, new, 4, between=lambda: _train(other, torch.randn(1, 2), other_opt, 1))
        rows = list(agent.clock.steps)  # type: ignore[attr-defined]
        assert [row[0] for row in rows] == list(range(8)), rows
        assert max(row[2] for row in rows[5:]) < 0.2e9, rows[5:]
        assert follower.found == 1 and follower.following() is new
        assert follower.handle is None  # removed at the forward after the step that found it
        told = [r.getMessage() for r in caplog.records]
        assert len(told) == 1 and "(SGD)" in told[0] and "AdamW's" in told[0], told
        assert agent.errors == 0, agent.last_error  # type: ignore[attr-defined]
    finally:
        agent.close()


def test_an_optimizer_built_before_any_step_is_followed_after_the_ask_floor(caplog):
    """The loop builds its optimizer anew right after attach() (a checkpoint's load): the one
    given never steps, so no step's time is ever known. The look asks once the forwards have
    gone on for 3 s with no step (not before), and the steps end at the new one's from 0."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
    x = torch.randn(4, 8)
    follower = agent.new_optimizer  # type: ignore[attr-defined]
    look = agent.stopped_steps  # type: ignore[attr-defined]
    t = [0.0]
    look.now = lambda: t[0]

    def at(seconds):
        t[0] = seconds
        look()

    try:
        with caplog.at_level("WARNING", logger="syncscope.agent"):
            at(0)
            new = torch.optim.AdamW(model.parameters())
            _train(model, x, new, 3)
            at(2.5)  # under the 3 s floor
            assert agent.clock.at_forward is None  # type: ignore[attr-defined]
            _train(model, x, new, 3)
            at(3.5)  # asked
            _train(model, x, new, 5)
        rows = list(agent.clock.steps)  # type: ignore[attr-defined]
        assert [row[0] for row in rows] == list(range(4)), rows
        assert follower.found == 1 and follower.following() is new
        assert look.step_s == 0.0 and not look.told  # nothing to tell by: no step's time
        told = [r.getMessage() for r in caplog.records]
        assert len(told) == 1 and "(SGD)" in told[0] and "AdamW's" in told[0], told
        assert agent.errors == 0, agent.last_error  # type: ignore[attr-defined]
    finally:
        agent.close()


@pytest.mark.parametrize("in_c", [True, False], ids=["hooks-in-c", "hooks-in-python"])
def test_with_the_shm_ring_the_forwards_look_for_a_new_optimizer(tmp_path, in_c):
    """The shm ring has no thread to look from: the look runs at its pumps (every other step
    here) and at every LOOK_EVERY-th batch of a step. The loop replaces its optimizer: the
    forwards that go on with no step ask for it, the steps end at the new one's from the next
    forward on, and the ring's rows are numbered on with none missing."""
    from syncscope.agent.step_work import LOOK_EVERY

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(
        model=model,
        optimizer=opt,
        exporter=f"shm://{tmp_path}",
        job="t",
        align_every_steps=2,
        native_backward=in_c,
    )
    x = torch.randn(4, 8)
    follower = agent.new_optimizer  # type: ignore[attr-defined]
    look = agent.stopped_steps  # type: ignore[attr-defined]
    assert agent.clock.work.on_batches is look  # type: ignore[attr-defined]
    t = [0.0]  # the look's clock: a quarter of a second a step, whatever this machine's speed
    look.now, look.ask_s = lambda: t[0], 0.0  # three steps' time is the line

    def tick():
        t[0] += 0.25

    ring = agent.reporter.ring  # type: ignore[attr-defined]
    numbers: list[int] = []
    take = ring.take_steps

    def taken(rows):
        numbers.extend(row[0] for row in rows)
        take(rows)

    ring.take_steps = taken
    try:
        _train(model, x, opt, 12, between=tick)  # looked at the pumps of steps 2, 4, ... 12
        new = torch.optim.AdamW(model.parameters())
        forwards = 0
        while follower.found == 0 and forwards < 4 * LOOK_EVERY:
            _train(model, x, new, 1, between=tick)
            forwards += 1
        # asked at the LOOK_EVERY-th batch with no step (3.75 s > 0.75 s), found at the next
        assert follower.found == 1 and follower.following() is new, forwards
        assert forwards == LOOK_EVERY + 1, forwards
        _train(model, x, new, 10, between=tick)
        agent.close()  # pumps the rest
        assert numbers == list(range(22)), numbers
        assert agent.errors == 0, agent.last_error  # type: ignore[attr-defined]
    finally:
        agent.close()


def test_an_optimizer_that_steps_again_is_still_followed_and_the_hook_goes():
    """The look asks, but the optimizer the steps end at steps again (a long pause with
    forwards, evaluation with gradients): nothing changes, and the global hook is gone."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
    x = torch.randn(4, 8)
    follower = agent.new_optimizer  # type: ignore[attr-defined]
    at = _looks_at(agent, [0.0])
    try:
        at(0)
        _train(model, x, opt, 1)
        at(1)
        _train(model, x, opt, 4)
        at(2)
        model(x).pow(2).mean().backward()
        at(3)  # asked
        model(x).pow(2).mean().backward()  # the forward registers the hook
        assert follower.handle is not None
        _train(model, x, opt, 3)
        assert follower.found == 0 and follower.following() is opt and follower.handle is None
        assert agent.clock.step == 8  # type: ignore[attr-defined]
    finally:
        agent.close()


def test_steps_that_stop_with_no_new_optimizer_are_told_once(caplog):
    """The model trains on with no optimizer stepping it (a loop that updates the parameters
    itself): the look asks for a new optimizer, none comes, and it says so once, naming the
    one the steps end at."""
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
    x = torch.randn(4, 8)

    def by_hand(steps):
        for _ in range(steps):
            model.zero_grad()
            model(x).pow(2).mean().backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad

    at = _looks_at(agent, [0.0])
    try:
        with caplog.at_level("WARNING", logger="syncscope.agent"):
            at(0)
            _train(model, x, opt, 1)
            at(1)
            _train(model, x, opt, 4)
            at(2)
            by_hand(20)
            at(3)  # 1 s: asked
            by_hand(5)  # (the global hook registered at the first forward: nothing steps)
            at(5)  # 3 s: told
            by_hand(5)
            at(9)  # and once only
        told = [r.getMessage() for r in caplog.records if "no step" in r.getMessage()]
        assert len(told) == 1 and "(SGD)" in told[0] and "25 forwards" in told[0], told
        assert agent.new_optimizer.handle is not None  # type: ignore[attr-defined]
        assert agent.new_optimizer.found == 0  # type: ignore[attr-defined]
        assert agent.clock.step == 5  # type: ignore[attr-defined]
    finally:
        agent.close()


def test_the_stopped_steps_look_is_silent_while_steps_go_on_or_nothing_trains():
    """No step for a long while is no news where no forward ran either (evaluation without
    gradients, a checkpoint, a wait), before a step's time is known, or under the line."""
    from types import SimpleNamespace

    from syncscope.agent.attach_checks import StoppedSteps

    clock = SimpleNamespace(step=0, work=SimpleNamespace(seen_batches=0))
    t = [0.0]
    look = StoppedSteps(clock, [torch.optim.SGD([torch.zeros(1)], lr=0.1)], now=lambda: t[0])

    def at(seconds: float, step: int, forwards: int) -> bool:
        t[0], clock.step, clock.work.seen_batches = seconds, step, forwards
        look()
        return look.told

    assert not at(0, 0, 3) and not at(100, 0, 40)  # the first step is long: nothing learnt
    assert not at(101, 1, 0) and not at(102, 11, 1)  # 0.1 s a step from here
    assert look.step_s == pytest.approx(0.1)
    assert not at(120, 11, 1)  # 18 s with no forward: not training
    assert not at(131, 11, 1)  # 29 s: still no forward
    assert not at(131.5, 11, 9)  # forwards again, but under the 30 s floor
    assert at(133, 11, 20)  # 31 s, forwards going on: told
    assert at(200, 11, 90)  # and once only (the other test counts the lines)


def test_a_module_ddp_wraps_after_attach_is_told_once(gloo_world_of_one, caplog):
    """attach() given the module, then DistributedDataParallel wrapped around it: the C++
    kernel's all-reduces inside backward add up to the module's gradients in each step, and the
    agent says once that DDP syncs it from outside. Given the DDP module, it says nothing."""
    net = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    told = []
    for wrap_after in (True, False):
        model = net if wrap_after else torch.nn.parallel.DistributedDataParallel(net)
        agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
        if agent.patch.kernel != "c++":  # type: ignore[attr-defined]
            agent.close()
            pytest.skip("the agent's C++ library is not built (python -m syncscope.agent.native)")
        ddp = torch.nn.parallel.DistributedDataParallel(net) if wrap_after else model
        try:
            with caplog.at_level("WARNING", logger="syncscope.agent"):
                for _ in range(4):
                    opt.zero_grad()
                    ddp(torch.randn(2, 8)).sum().backward()
                    opt.step()
                    agent.patch.poll()  # type: ignore[attr-defined]
        finally:
            agent.close()
        told.append([r.getMessage() for r in caplog.records if "from outside" in r.getMessage()])
        caplog.clear()
    assert len(told[0]) == 1 and "(144 bytes a step on group default_pg;" in told[0][0], told
    assert told[1] == []


def test_ddp_outside_needs_the_gradients_bytes_inside_backward_on_one_group():
    """Only all-reduces inside backward count, per group, and only a whole multiple of the
    module's gradients or of their half (DDP's buckets hold exactly those; accumulation without
    no_sync() is twice them, bf16 buckets half) is DDP's sync; it is judged once a later step's
    op comes."""
    from syncscope.agent.attach_checks import DdpOutside

    def told(records) -> bool:
        check = DdpOutside(1000)
        for op, group, size, step, in_autograd in records:
            check(op, group, size, step, in_autograd)
        return check.told

    ar = "all_reduce"
    assert told([(ar, "pg", 600, 0, True), (ar, "pg", 400, 0, True), (ar, "pg", 8, 1, True)])
    assert told([(ar, "pg", 1000, 3, True), (ar, "pg", 1000, 3, True), (ar, "pg", 9, 4, True)])
    assert not told([(ar, "pg", 600, 0, True), (ar, "pg", 400, 0, True)])  # step 0 not over
    assert not told([(ar, "pg", 600, 0, True), (ar, "tp", 400, 0, True), (ar, "pg", 8, 1, True)])
    assert not told([(ar, "pg", 600, 0, True), (ar, "pg", 400, 0, False), (ar, "pg", 8, 1, True)])
    assert told([(ar, "pg", 300, 0, True), (ar, "pg", 200, 0, True), (ar, "pg", 8, 1, True)])
    assert not told([(ar, "pg", 700, 0, True), (ar, "pg", 8, 1, True)])
    assert not told([(ar, "pg", 1004, 0, True), (ar, "pg", 8, 1, True)])
    assert not told([(ar, "pg", 250, 0, True), (ar, "pg", 8, 1, True)])  # under the half
    assert not told([("reduce_scatter", "pg", 1000, 0, True), (ar, "pg", 8, 1, True)])


@pytest.mark.parametrize("both", [False, True])
def test_a_ddp_model_not_given_to_attach_is_told_once(gloo_world_of_one, caplog, both):
    """A GAN's two DDP models on one group, the agent given the generator only: the C++
    kernel's count of the all-reduces it left untimed inside backward (the critic's buckets
    with the generator's) is no sum of the generator's gradients, and the agent says so,
    once. Given both models, it says nothing."""
    generator, critic, opt_g, opt_c = gan()
    model, optimizer = ([generator, critic], [opt_g, opt_c]) if both else (generator, opt_g)
    agent = attach(model=model, optimizer=optimizer, exporter=None, flush_interval_s=3600)
    try:
        if agent.patch.kernel != "c++":  # type: ignore[attr-defined]
            pytest.skip("the agent's C++ library is not built (python -m syncscope.agent.native)")
        with caplog.at_level("WARNING", logger="syncscope.agent"):
            poll = agent.patch.poll  # type: ignore[attr-defined]
            gan_steps(4, generator, critic, opt_g, opt_c, after_step=poll)
    finally:
        agent.close()
    told = [r.getMessage() for r in caplog.records if "do not add up" in r.getMessage()]
    if both:
        assert told == []
    else:  # the critic's 36 bytes twice and the generator's 288 with them: 360 a step
        assert len(told) == 1 and "came to 360 bytes" in told[0] and "(288 bytes)" in told[0]


def test_ddp_unseen_allows_every_sum_of_the_models_gradients_and_their_halves():
    from syncscope.agent.attach_checks import DdpUnseen

    def told(model_bytes, *totals) -> bool:
        check = DdpUnseen(model_bytes)
        for step, total in enumerate(totals):
            check(step, total)
        return check.told

    assert not told([1000], 1000, 2000, 500, 1500)  # syncs of one model, bf16 buckets
    assert told([1000], 1000, 1200)
    assert not told([1000, 36], 1072, 1036, 36)  # a GAN's steps with both models given
    assert told([1000], 1072)
    assert not told([1000], 1000, 1000) and not told([1000], 0)


ACCELERATE_LOOP = """
import json, torch
from accelerate import Accelerator
from syncscope.agent import attach
acc = Accelerator(cpu=True, gradient_accumulation_steps=4)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600)
for _ in range(24):
    with acc.accumulate(model):
        loss = torch.nn.functional.mse_loss(model(torch.randn(16, 16)), torch.randn(16, 1))
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
rows = list(getattr(agent, "queues").steps) if hasattr(agent, "queues") else []
print(json.dumps({"wrapper": type(opt).__name__, "steps": [r[0] for r in rows],
                  "samples": [r[-2] for r in rows]}))
agent.close()
"""


@pytest.mark.slow
def test_accelerates_optimizer_wrapper_is_looked_through_to_the_torch_optimizer():
    """`attach(optimizer=...)` given accelerate's AcceleratedOptimizer (it never runs
    Optimizer.__init__, so takes no step hooks: attach failed and the agent went inert) times
    the torch optimizer inside it, whose step runs once per real step: 24 micro-batches with
    gradient accumulation over 4 are 6 steps of 64 samples. In a process of its own
    (accelerate's state is process-wide)."""
    import json
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    out = subprocess.run(
        [sys.executable, "-c", ACCELERATE_LOOP], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["wrapper"] == "AcceleratedOptimizer", got
    assert got["steps"] == list(range(6)) and got["samples"] == [64] * 6, (got, out.stderr[-2000:])


def test_a_second_attach_closes_the_first_and_each_step_counts_once(caplog):
    """Two agents open in one process would both report as its rank (the exporter counting each
    step twice): attach() closes an earlier open one (a loop restarting in-process attaches
    again) and says so, and the steps after it count on the new agent alone; once the earlier
    one is closed, attach() says nothing."""
    net = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)

    def train(steps: int) -> None:
        for _ in range(steps):
            net(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()

    with caplog.at_level("WARNING", logger="syncscope.agent"):
        first = attach(model=net, optimizer=opt, exporter=None)
        train(3)
        before = first.stats["steps"]
        second = attach(model=net, optimizer=opt, exporter=None)
        train(4)
        after = (first.stats["steps"], second.stats["steps"])
        second.close()
        third = attach(model=net, optimizer=opt, exporter=None)
        third.close()
    assert before == 3 and after == (3, 4), (before, after)
    told = [r.getMessage() for r in caplog.records if "closing that one" in r.getMessage()]
    assert len(told) == 1, told
