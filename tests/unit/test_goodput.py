"""Goodput and badput over a job's life: checkpoint time seen by the agent (torch.save/load,
torch.distributed.checkpoint, agent.checkpoint()), startup, step numbers across restarts, the
events over HTTP and the shared-memory ring, the exporter's lost progress and counters, and the
state file that keeps them across the exporter's restarts."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed.checkpoint as dcp  # noqa: E402 - imported before attach(): wrapped
from fastapi.testclient import TestClient  # noqa: E402
from syncscope.agent import attach, checkpointing  # noqa: E402
from syncscope.agent.config import process_started_unix_s  # noqa: E402
from syncscope.exporter.app import create_app, parse_batch  # noqa: E402
from syncscope.exporter.collectors import collect_goodput  # noqa: E402
from syncscope.exporter.diagnosis import snapshot  # noqa: E402
from syncscope.exporter.settings import Settings  # noqa: E402
from syncscope.exporter.shm_reader import ShmPoller  # noqa: E402
from syncscope.exporter.state_file import StateFile  # noqa: E402
from syncscope.exporter.store import Store  # noqa: E402

from syncscope.wire import NO_STEP, PHASES  # noqa: E402
from tests.conftest import parse_samples, step_rows  # noqa: E402
from tests.unit.test_reporter import Sink  # noqa: E402

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock

MS = 1_000_000
SLOW_S = 0.03  # what each write of a SlowFile takes


class SlowFile(io.BytesIO):
    """A file that takes SLOW_S for its first write: a checkpoint of known length."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = True

    def write(self, data: bytes) -> int:  # type: ignore[override]
        if self.slow:
            self.slow = False
            time.sleep(SLOW_S)
        return super().write(data)


@pytest.fixture
def agents(monkeypatch):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    made: list = []

    def make(model=None, opt=None, **config):
        agent = attach(model=model, optimizer=opt, exporter=None, flush_interval_s=3600, **config)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.close()


def linear() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(8, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def train_step(model, opt) -> None:
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    opt.zero_grad()


def events(agent, kind: str | None = None) -> list[tuple]:
    return [e for e in agent.queues.events if kind is None or e[0] == kind]


# -- the agent: what it times --------------------------------------------------------------------
def test_saves_and_loads_are_timed_apart_and_return_what_torch_returns(agents):
    model, opt = linear()
    agent = agents(model, opt)
    train_step(model, opt)
    f = SlowFile()
    t0 = time.perf_counter_ns()
    assert torch.save(model.state_dict(), f) is None
    saved_ns = time.perf_counter_ns() - t0
    f.seek(0)
    loaded = torch.load(f, weights_only=True)
    assert torch.equal(loaded["weight"], model.state_dict()["weight"])
    (save,) = events(agent, "checkpoint_save")
    (load,) = events(agent, "checkpoint_load")
    # In the step after the first (steps run from optimizer post-hook to post-hook).
    assert save[1] == load[1] == 1
    assert SLOW_S * 1e9 <= save[3] <= saved_ns
    assert 0 < load[3] < SLOW_S * 1e9
    assert agent.checkpoints.save_ns == save[3] and agent.checkpoints.load_ns == load[3]
    # What torch raises still reaches the caller, and is timed all the same.
    with pytest.raises(FileNotFoundError):
        torch.load("/nonexistent/checkpoint.pt")
    assert len(events(agent, "checkpoint_load")) == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_call_nested_in_a_timed_call_counts_once(agents, tmp_path):
    model, opt = linear()
    agent = agents(model, opt)
    with agent.checkpoint("save"):
        torch.save(model.state_dict(), SlowFile())
        torch.save(model.state_dict(), io.BytesIO())
    assert [e[0] for e in events(agent)] == ["checkpoint_save"]
    assert events(agent)[0][3] >= SLOW_S * 1e9
    # torch.distributed.checkpoint, imported before attach(): its save is one save too,
    # whatever it calls inside.
    agent.queues.events.clear()
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert [e[0] for e in events(agent)] == ["checkpoint_save", "checkpoint_load"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_an_async_save_costs_the_training_thread_its_staging_only(agents, tmp_path):
    """dcp.async_save: the call (staging, starting the writer) is one save; the write that
    follows on torch's thread adds nothing, also where it goes through the wrapped functions."""
    model, opt = linear()
    agent = agents(model, opt)
    t0 = time.perf_counter_ns()
    future = dcp.async_save(
        {"model": model.state_dict()}, checkpoint_id=str(tmp_path / "async"), no_dist=True
    )
    called_ns = time.perf_counter_ns() - t0
    future.result(timeout=60)
    ((kind, _step, _end, duration),) = events(agent)
    assert kind == "checkpoint_save" and 0 < duration <= called_ns
    assert agent.checkpoints.calls == 1 and agent.checkpoints.depth == 0
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(tmp_path / "async"), no_dist=True)
    assert torch.equal(state["model"]["weight"], model.state_dict()["weight"])


def test_calls_from_other_threads_are_not_the_training_loops(agents):
    model, opt = linear()
    agent = agents(model, opt)
    done = []
    writer = threading.Thread(target=lambda: done.append(torch.save({"x": 1}, SlowFile())))
    writer.start()
    writer.join()
    assert done == [None] and events(agent) == [] and agent.checkpoints.depth == 0


def test_time_checkpointing_in_a_step_moves_to_other_and_phases_still_add_up(agents):
    model, opt = linear()
    agent = agents(model, opt)
    train_step(model, opt)
    between = []  # each wait between the steps as this loop lived it, the save's included
    for _ in range(3):
        before = time.perf_counter_ns()
        time.sleep(0.01)  # data loading
        torch.save(model.state_dict(), SlowFile())  # between the steps: would read as data
        between.append(time.perf_counter_ns() - before)
        train_step(model, opt)
    rows = step_rows(agent)[1:]
    saves = events(agent, "checkpoint_save")
    assert len(rows) == 3 and [e[1] for e in saves] == [1, 2, 3]
    for row, lived, (_kind, _step, _end, saved) in zip(rows, between, saves, strict=True):
        step, _end, total, data, fwd, bwd, optim, comm, pacing, *_work = row
        other = total - (data + fwd + bwd + optim + comm + pacing)
        # Data is the wait without the save (the save alone is >= SLOW_S): against what the
        # loop lived, not the sleep's 10 ms, so that a late wake-up on a busy core is data too.
        assert saved >= SLOW_S * 1e9, saves
        assert 0.01e9 <= data < lived - saved + SLOW_S * 1e9 / 2, (step, lived, saved)
        assert other >= saved, step


def test_a_checkpoint_in_the_optimizer_step_is_not_optimizer_time(agents):
    model, opt = linear()
    agent = agents(model, opt)
    opt.register_step_post_hook(lambda *_: torch.save({"w": 1}, SlowFile()))
    train_step(model, opt)
    train_step(model, opt)
    # The user's hook runs after the agent's post-hook, in the next step: the first row is
    # clean and the second carries one save, out of its data wait.
    first, second = step_rows(agent)[:2]
    assert first[6] < SLOW_S * 1e9 and second[3] < SLOW_S * 1e9
    assert second[2] - sum(second[3:9]) >= SLOW_S * 1e9


def test_startup_is_process_start_to_the_first_step_less_checkpoints_before_it(agents):
    model = torch.nn.Linear(8, 1)
    blob = io.BytesIO()
    torch.save(model.state_dict(), blob)
    agent = agents(model)  # steps marked by hand: none open before the first block
    blob.seek(0)
    with agent.checkpoint("load"):
        time.sleep(SLOW_S)
        torch.load(blob, weights_only=True)
    (load,) = events(agent, "checkpoint_load")
    assert load[1] == NO_STEP
    with agent.step():
        model(torch.randn(2, 8)).sum().backward()
    (startup,) = events(agent, "startup")
    first_start = step_rows(agent)[0][1] - step_rows(agent)[0][2]
    assert startup[1] == NO_STEP and startup[2] == first_start
    assert startup[3] == first_start - agent.clock.process_started_ns - load[3]
    started = agent.identity["process_started_unix_s"]
    assert started < agent.identity["started_unix_s"] <= time.time()


def test_process_start_from_proc_and_none_where_unreadable(tmp_path):
    (tmp_path / "self").mkdir()
    ticks = os.sysconf("SC_CLK_TCK")
    # A command name with spaces and parentheses, then the start time as field 22.
    fields = ["S"] + ["0"] * 18 + [str(250 * ticks)] + ["0"] * 10
    (tmp_path / "self" / "stat").write_text(f"123 (a b) c) {' '.join(fields)}\n")
    (tmp_path / "uptime").write_text("310.25 600.00\n")  # booted 310.25 s ago: 60.25 s old
    assert process_started_unix_s(str(tmp_path)) == pytest.approx(time.time() - 60.25, abs=0.1)
    (tmp_path / "uptime").write_text("120.00 1.00\n")  # started after now: not a start
    assert process_started_unix_s(str(tmp_path)) is None
    (tmp_path / "uptime").unlink()
    assert process_started_unix_s(str(tmp_path)) is None
    # A process started now reads its own start as now (this test's own process may be an hour
    # old by the time it runs, late in the suite).
    before = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "from syncscope.agent.config import process_started_unix_s as p; print(p())",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    real = float(out)
    assert before - 2.0 < real <= time.time() + 0.1


# -- the agent: step numbers ---------------------------------------------------------------------
def test_step_numbers_start_where_the_restored_checkpoint_left_off(agents):
    model, opt = linear()
    agent = agents(model, opt, start_step=120)
    train_step(model, opt)
    train_step(model, opt)
    assert [r[0] for r in agent.queues.steps] == [120, 121]


def test_an_adam_family_optimizer_says_the_first_step_and_an_explicit_one_wins(agents):
    model = torch.nn.Linear(8, 1)
    adam = torch.optim.AdamW(model.parameters())
    for _ in range(7):
        train_step(model, adam)
    restored = torch.optim.AdamW(model.parameters())
    restored.load_state_dict(adam.state_dict())
    agent = agents(model, restored)
    train_step(model, restored)
    train_step(model, restored)
    assert [r[0] for r in agent.queues.steps] == [7, 8]
    agent.close()
    fresh = torch.optim.Adam(model.parameters())
    agent = agents(model, fresh)
    train_step(model, fresh)
    assert [r[0] for r in agent.queues.steps] == [0]  # nothing restored: from 0
    agent.close()
    again = torch.optim.AdamW(model.parameters())
    again.load_state_dict(adam.state_dict())
    agent = agents(model, again, start_step=0)  # said: not read from the optimizer
    train_step(model, again)
    assert [r[0] for r in agent.queues.steps] == [0]


# -- the agent: never in the way -----------------------------------------------------------------
def test_failures_of_its_own_never_reach_the_caller(agents):
    model, opt = linear()
    agent = agents(model, opt)

    class Broken:
        maxlen = None

        def __len__(self) -> int:
            raise RuntimeError("broken queue")

    agent.clock.events = Broken()
    buf = io.BytesIO()
    assert torch.save({"w": 1}, buf) is None  # timed, its event lost to the broken queue
    buf.seek(0)
    assert torch.load(buf) == {"w": 1}
    assert agent.errors == 2 and isinstance(agent.last_error, RuntimeError)
    with agent.checkpoint("sideways"):  # a kind it does not know: nothing timed, no raise
        pass
    assert agent.errors == 3 and isinstance(agent.last_error, ValueError)
    assert agent.checkpoints.depth == 0


def test_close_puts_torchs_functions_back_unless_wrapped_again(agents):
    original_save, original_load = torch.serialization.save, torch.serialization.load
    model, opt = linear()
    agent = agents(model, opt)
    assert torch.save is not original_save and torch.save.__wrapped__ is original_save
    assert dcp.save.__syncscope_wrapped__
    agent.close()
    assert torch.save is original_save and torch.load is original_load
    assert not getattr(dcp.save, "__syncscope_wrapped__", False)
    agent = agents(model, opt)
    ours = torch.save

    def theirs(*args, **kwargs):
        return ours(*args, **kwargs)

    torch.save = theirs  # someone else's wrapper on top of ours
    try:
        agent.close()
        assert torch.save is theirs  # theirs stays; ours under it passes calls through
        assert torch.save({"w": 1}, io.BytesIO()) is None
    finally:
        torch.save = original_save


def test_the_inert_agent_times_nothing(monkeypatch):
    monkeypatch.setenv("SYNCSCOPE_DISABLE", "1")
    inert = attach()
    with inert.checkpoint("save"):
        assert getattr(torch.save, "__syncscope_wrapped__", False) is False


# -- the events' way to the exporter -------------------------------------------------------------
def batch(
    inc: str, first: int, n: int, *, events=(), rank: int = 0, started: float = 0.0, ms: int = 100
):
    """Steps first..first+n-1 of `ms` (100) ms: data 10, forward 20, backward 30, optimizer 5,
    exposed communication 15, pacing 5, other the rest (productive: `ms` − 30 ms)."""
    base = 1_700_000_000 * 10**9
    steps = [
        [
            k,
            base + k * 100 * MS,
            ms * MS,
            10 * MS,
            20 * MS,
            30 * MS,
            5 * MS,
            15 * MS,
            5 * MS,
            -1,
            -1,
        ]
        for k in range(first, first + n)
    ]
    agent = {"job": "g", "rank": rank, "local_rank": rank, "world_size": 2, "incarnation": inc}
    agent["hostname"] = "n1"
    if started:
        agent |= {"started_unix_s": started + 1, "process_started_unix_s": started}
    return {
        "schema_version": 2,
        "agent": agent,
        "clock_offset_ns": 0,
        "steps": steps,
        "collectives": [],
        "events": [list(e) for e in events],
    }


def ingest(store: Store, body: dict) -> None:
    assert store.ingest(parse_batch(json.dumps(body).encode()))["accepted"]


def counters(store: Store) -> dict[str, float]:
    out = {}
    for family in collect_goodput(snapshot(store)):
        for s in family.samples:
            out[s.labels.get("category", s.name)] = s.value
    return out


def test_the_latest_rank_start_is_when_the_nodes_newest_incarnation_first_stepped(monkeypatch):
    """What the job-wide rules wait a straggler window after (recorded.WINDOW_FULL): per node,
    when this exporter received the first step of its latest rank's current incarnation, not
    its attach (its series start with its first steps, seconds later), so that every rank's
    rates span a whole window. The time of the scrape while a rank has no step yet; a relaunch
    moves it on; an earlier incarnation or rank, or the same incarnation's later steps, do not."""
    clock = [5000.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])

    def latest(store: Store) -> float:
        return counters(store)["syncscope_ranks_started_timestamp_seconds"]

    store = Store(Settings())
    ingest(store, batch("a", 0, 3, rank=0, started=1000.0))  # attached at 1001, stepped at 5000
    clock[0] = 5010.0
    ingest(store, batch("a", 0, 0, rank=1, started=2000.0))  # attached, no step yet
    clock[0] = 5020.0
    assert latest(store) == 5020.0  # not judged before rank 1's steps come in
    ingest(store, batch("a", 0, 3, rank=1, started=2000.0))
    clock[0] = 5030.0
    assert latest(store) == 5020.0
    ingest(store, batch("a", 3, 3, rank=0, started=1000.0))  # later steps: unchanged
    ingest(store, batch("b", 3, 3, rank=0, started=3000.0))  # rank 0 relaunched
    clock[0] = 5040.0
    assert latest(store) == 5030.0
    ingest(store, batch("c", 3, 3, rank=1))  # rank 1 relaunched, saying nothing
    assert latest(store) == 5040.0


def test_a_restart_that_goes_back_to_its_checkpoint_is_lost_progress():
    store = Store(Settings())
    save = ("checkpoint_save", 21, 0, 40 * MS)  # in step 21: out of that step's productive
    ingest(store, batch("a", 0, 30, events=[("startup", NO_STEP, 0, 2_500 * MS), save]))
    # Restarted from the checkpoint taken after step 19: steps 20..29 run again.
    load = ("checkpoint_load", 20, 0, 60 * MS)
    ingest(store, batch("b", 20, 15, events=[("startup", NO_STEP, 0, 2_000 * MS), load]))
    c = counters(store)
    # Incarnation a's mean productive step (70 ms less its checkpoint time), its first step
    # left out: (29 x 70 - 40) / 29 ms; 10 steps of it lost.
    assert c["lost_progress"] == pytest.approx(10 * (2.03 - 0.04) / 29)
    assert c["startup"] == pytest.approx(4.5)
    assert (c["checkpoint_save"], c["checkpoint_load"]) == pytest.approx((0.04, 0.06))
    # 45 steps of 70 ms productive, less the checkpoint time inside steps 21 and 20.
    assert c["syncscope_node_productive_seconds_total"] == pytest.approx(45 * 0.07 - 0.1)
    (rank,) = snapshot(store).jobs["g"].ranks
    assert rank.lost_steps == 10 and rank.restarts == 1
    # A restart that goes forward (a later checkpoint than any step reported) loses nothing.
    ingest(store, batch("c", 40, 5))
    assert counters(store)["lost_progress"] == pytest.approx(c["lost_progress"])


@pytest.mark.parametrize("exporter_restarts", [False, True])
def test_steps_run_again_cost_what_they_took_before(tmp_path, exporter_restarts):
    """A job whose steps sped up (150 ms, then 100 ms after a checkpoint in step 20) restarts
    from that checkpoint: the ten steps it runs again cost their own productive time, not the
    incarnation's mean, across a restart of the exporter (its state file) too. Restarted from
    the same checkpoint once more after 5 steps of 150 ms: those 5 as they ran, the 5 beyond
    them that only the first incarnation ran at the latest incarnation's mean."""
    store = Store(Settings())
    save = ("checkpoint_save", 20, 0, 40 * MS)  # in step 20: out of that step's productive
    ingest(store, batch("a", 0, 20, ms=150))
    ingest(store, batch("a", 20, 10, events=[save]))
    if exporter_restarts:
        path = str(tmp_path / "state.json")
        assert StateFile(path, store).save()
        store = Store(Settings())
        assert StateFile(path, store).load() == 1
    load = ("checkpoint_load", 20, 0, 60 * MS)
    ingest(store, batch("b", 20, 5, events=[load], ms=150))
    # Steps 20..29 as incarnation a ran them: 70 ms less the save's 40, then 9 x 70 ms.
    assert counters(store)["lost_progress"] == pytest.approx(0.03 + 9 * 0.07)
    ingest(store, batch("c", 20, 3, events=[load]))
    # b's steps 20..24: 120 ms less the load's 60, then 4 x 120; 25..29 at b's mean (its first
    # step left out): 120 ms.
    assert counters(store)["lost_progress"] == pytest.approx(0.66 + 0.06 + 4 * 0.12 + 5 * 0.12)
    (rank,) = snapshot(store).jobs["g"].ranks
    assert rank.lost_steps == 20 and rank.restarts == 2


def test_unknown_event_kinds_are_ignored_and_version_1_batches_carry_events_too():
    store = Store(Settings())
    body = batch("a", 0, 3, events=[("warp_drive", NO_STEP, 0, 5 * MS), ("startup", -1, 0, MS)])
    ingest(store, body)
    v1 = {
        "schema_version": 1,
        "agent": body["agent"] | {"rank": 1},
        "events": [{"kind": "checkpoint_save", "duration_s": 0.25, "end_unix_s": 1.7e9}],
    }
    ingest(store, v1)
    c = counters(store)
    assert (c["startup"], c["checkpoint_save"]) == pytest.approx((0.001, 0.25))


def test_goodput_of_the_ranks_here_adds_up_with_its_badput(tmp_path):
    store = Store(Settings())
    started = time.time() - 1000.0
    for rank in (0, 1):
        ingest(store, batch("a", 0, 100, rank=rank, started=started))
    g = snapshot(store).jobs["g"].goodput
    assert g is not None and g.started_unix_s == started and g.ranks == 2
    rank_seconds = 2 * (snapshot(store).now_unix_s - started)
    assert g.ratio == pytest.approx(2 * 100 * 0.07 / rank_seconds, rel=1e-3)
    assert g.badput["data_wait"] == pytest.approx(2 * 100 * 0.01 / rank_seconds, rel=1e-3)
    assert g.ratio + sum(g.badput.values()) == pytest.approx(1.0)
    app = create_app(Settings(), store=store)
    with TestClient(app) as client:
        state = client.get("/v1/state").json()
        assert state["jobs"]["g"]["goodput"]["ratio"] == pytest.approx(g.ratio, rel=1e-2)
        page = client.get("/").text
    assert 'class="goodput"' in page and "all 2 ranks" in page


def test_events_travel_over_http_into_the_record_file_and_the_counters(monkeypatch, tmp_path):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    sink = Sink({"accepted": True})
    try:
        model, opt = linear()
        record = tmp_path / "r{rank}.jsonl"
        agent = attach(model, opt, exporter=sink.url, record=str(record), flush_interval_s=3600)
        train_step(model, opt)
        torch.save(model.state_dict(), SlowFile())
        train_step(model, opt)
        agent.close()
    finally:
        sink.close()
    store = Store(Settings())
    for body in sink.bodies:
        assert store.ingest(parse_batch(body))["accepted"]
    c = counters(store)
    assert c["checkpoint_save"] >= SLOW_S and c["startup"] > 0
    lines = [json.loads(line) for line in (tmp_path / "r0.jsonl").read_text().splitlines()]
    by_event = {line["event"]: line for line in lines if "event" in line}
    assert by_event["checkpoint_save"]["step"] == 1
    assert by_event["checkpoint_save"]["duration_s"] == pytest.approx(c["checkpoint_save"])
    assert by_event["startup"]["step"] is None
    assert by_event["startup"]["duration_s"] == pytest.approx(c["startup"])
    assert by_event["startup"]["process_started_unix_s"] == agent.identity["process_started_unix_s"]
    steps = [line for line in lines if "event" not in line]
    assert [s["step"] for s in steps] == [0, 1]
    assert {line["incarnation"] for line in lines} == {agent.identity["incarnation"]}


def test_events_travel_over_the_shared_memory_ring(monkeypatch, tmp_path):
    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    model, opt = linear()
    agent = attach(model, opt, exporter=f"shm://{tmp_path}", job="ring", align_every_steps=1)
    store = Store(Settings())
    poller = ShmPoller(str(tmp_path), store.ingest)
    poller.poll_once()  # the exporter has the ring open (a ring nobody read goes at close)
    train_step(model, opt)
    torch.save(model.state_dict(), SlowFile())
    train_step(model, opt)
    agent.close()
    poller.poll_once()
    c = counters(store)
    saved = agent.checkpoints.save_ns / 1e9
    assert c["checkpoint_save"] == pytest.approx(saved) and saved >= SLOW_S
    assert c["startup"] > 0
    (rank,) = snapshot(store).jobs["ring"].ranks
    # The save was in step 1: out of its productive time.
    assert rank.productive_s < rank.step_seconds_sum - saved


# -- the state file: counters across the exporter's restarts -------------------------------------
def scrape(store: Store) -> str:
    with TestClient(create_app(Settings(), store=store)) as client:
        return client.get("/metrics").text


COUNTERS = (
    "syncscope_steps_total",
    "syncscope_phase_seconds_total",
    "syncscope_step_duration_seconds_count",
    "syncscope_step_duration_seconds_sum",
    "syncscope_rank_samples_total",
    "syncscope_collective_seconds_total",
    "syncscope_node_badput_seconds_total",
    "syncscope_node_productive_seconds_total",
    "syncscope_job_started_timestamp_seconds",
    "syncscope_ranks_started_timestamp_seconds",
    "syncscope_agent_records_dropped_total",
    "syncscope_pacing_delay_seconds_total",
)


def busy_store() -> Store:
    store = Store(Settings())
    started = time.time() - 60
    body = batch("a", 0, 30, events=[("startup", NO_STEP, 0, 3_000 * MS)], started=started)
    body["steps"] = [[*row[:9], 16, -1] for row in body["steps"]]
    body["collectives"] = [["all_reduce", "dp", 4096, 2 * MS, k] for k in range(30)]
    body["dropped_total"] = 2
    body["pacing"] = {"enabled": True, "active": True, "engagements": 3, "total_delay_s": 1.5}
    ingest(store, body)
    restarted = batch("b", 25, 10, started=started)
    restarted["pacing"] = {"enabled": True, "engagements": 1, "total_delay_s": 0.25}
    ingest(store, restarted)
    return store


def test_the_state_file_round_trip_keeps_every_counter(tmp_path):
    path = str(tmp_path / "state.json")
    before = busy_store()
    (kept,) = before.ranks.values()
    kept.phase_every = 4  # its agent samples its phases (wire.AgentInfo)
    assert StateFile(path, before).save()
    after = Store(Settings())
    assert StateFile(path, after).load() == 1
    old, new = scrape(before), scrape(after)
    for name in COUNTERS:
        assert parse_samples(new, name) == parse_samples(old, name), name
        assert parse_samples(new, name), name
    (rank,) = snapshot(after).jobs["g"].ranks
    assert rank.restarts == 1 and rank.lost_steps == 5 and rank.phase_every == 4
    assert rank.steps_since_unix_s == kept.steps_since_unix_s > 0


def test_a_state_file_from_before_first_steps_were_kept_takes_the_attach(tmp_path):
    """A rank of a file without `steps_since_unix_s` stepped since its attach (the gate the
    job-wide rules had then); one that had no step yet has none."""
    path = str(tmp_path / "state.json")
    before = busy_store()
    StateFile(path, before).save()
    data = json.loads(Path(path).read_text())
    del data["ranks"][0]["steps_since_unix_s"]
    Path(path).write_text(json.dumps(data))
    store = Store(Settings())
    assert StateFile(path, store).load() == 1
    (rank,) = store.ranks.values()
    assert rank.steps_since_unix_s == rank.started_unix_s > 0
    data["ranks"][0]["steps_total"] = 0
    Path(path).write_text(json.dumps(data))
    store = Store(Settings())
    assert StateFile(path, store).load() == 1
    assert [r.steps_since_unix_s for r in store.ranks.values()] == [0.0]


def test_a_state_file_from_before_phase_sampling_loads_every_step_timed(tmp_path):
    """A file without `phase_every` loads with every step timed; one below 1 is refused."""
    path = str(tmp_path / "state.json")
    StateFile(path, busy_store()).save()
    data = json.loads(Path(path).read_text())
    del data["ranks"][0]["phase_every"]
    Path(path).write_text(json.dumps(data))
    store = Store(Settings())
    assert StateFile(path, store).load() == 1
    assert [r.phase_every for r in store.ranks.values()] == [1]
    data["ranks"][0]["phase_every"] = 0
    Path(path).write_text(json.dumps(data))
    store = Store(Settings())
    assert StateFile(path, store).load() == 0 and store.ranks == {}


def test_counters_continue_after_a_reload(tmp_path):
    path = str(tmp_path / "state.json")
    before = busy_store()
    StateFile(path, before).save()
    steps_before = parse_samples(scrape(before), "syncscope_steps_total")
    lost_before = counters(before)["lost_progress"]
    after = Store(Settings())
    StateFile(path, after).load()
    ingest(after, batch("b", 35, 5))  # the same incarnation goes on: no restart
    (rank,) = snapshot(after).jobs["g"].ranks
    assert rank.restarts == 1 and not rank.stale
    assert parse_samples(scrape(after), "syncscope_steps_total") == {
        k: v + 5 for k, v in steps_before.items()
    }
    ingest(after, batch("c", 30, 5))  # restarted from step 30: steps 30..39 again
    assert counters(after)["lost_progress"] > lost_before
    (rank,) = snapshot(after).jobs["g"].ranks
    assert rank.restarts == 2 and rank.lost_steps == 5 + 10


def test_the_exporter_saves_at_shutdown_and_loads_at_start(tmp_path):
    path = str(tmp_path / "state.json")
    settings = Settings(state_file=path, state_interval_s=3600)
    app = create_app(settings)
    with TestClient(app) as client:
        assert client.post("/v1/ingest", json=batch("a", 0, 10)).status_code == 200
    saved = json.loads(Path(path).read_text())
    assert saved["format"] == "syncscope-exporter-state" and len(saved["ranks"]) == 1
    with TestClient(create_app(settings)) as client:
        state = client.get("/v1/state").json()
        assert (
            state["state_file"]["loaded_ranks"] == 1 and state["state_file"]["load_error"] is None
        )
        assert state["jobs"]["g"]["ranks"][0]["steps_total"] == 10


@pytest.mark.parametrize("content", [b"{not json", b'{"format": "other"}', b"\xff\xfe", b"[]"])
def test_a_corrupt_state_file_is_set_aside_reported_and_the_exporter_starts_empty(
    tmp_path, caplog, content
):
    path = tmp_path / "state.json"
    path.write_bytes(content)
    settings = Settings(state_file=str(path), state_interval_s=3600)
    with caplog.at_level(logging.ERROR, logger="syncscope.exporter"):
        app = create_app(settings)
    assert (tmp_path / "state.json.corrupt").read_bytes() == content
    assert any("state.json.corrupt" in r.getMessage() for r in caplog.records)
    with TestClient(app) as client:
        state = client.get("/v1/state").json()
        assert state["jobs"] == {}
        assert "state.json.corrupt" in state["state_file"]["load_error"]
        client.post("/v1/ingest", json=batch("a", 0, 3))
    assert json.loads(path.read_text())["ranks"][0]["steps_total"] == 3  # saved anew


def test_a_bad_rank_in_the_file_refuses_the_whole_file(tmp_path):
    path = str(tmp_path / "state.json")
    StateFile(path, busy_store()).save()
    data = json.loads(Path(path).read_text())
    data["ranks"][0]["phase_seconds"] = [0.0] * (len(PHASES) - 1)  # another layout
    Path(path).write_text(json.dumps(data))
    store = Store(Settings())
    assert StateFile(path, store).load() == 0 and store.ranks == {}
    assert os.path.exists(path + ".corrupt")


def test_an_unreadable_state_file_is_left_alone_and_never_saved_over(tmp_path, caplog):
    path = tmp_path / "state.json"
    path.mkdir()  # cannot be read as a file (root reads through any mode bits)
    state = StateFile(str(path), busy_store())
    with caplog.at_level(logging.ERROR, logger="syncscope.exporter"):
        assert state.load() == 0
    assert "cannot be read" in caplog.text and path.is_dir()
    assert not state.save() and path.is_dir()


def test_a_failed_save_is_logged_and_the_last_good_file_stays(tmp_path, caplog):
    path = tmp_path / "state.json"
    state = StateFile(str(path), busy_store())
    assert state.save()
    good = path.read_bytes()
    os.chmod(tmp_path, 0o500)  # no new files beside it (root ignores this: then make it fail)
    try:
        if os.access(tmp_path, os.W_OK):
            state.path = str(tmp_path / "missing-dir" / "state.json")
        with caplog.at_level(logging.ERROR, logger="syncscope.exporter"):
            assert not state.save()
    finally:
        os.chmod(tmp_path, 0o700)
    assert "not saved" in caplog.text and state.status()["save_error"]
    assert path.read_bytes() == good
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_the_checkpoint_kinds_are_badput_categories():
    from syncscope.catalog import BADPUT_CATEGORIES
    from syncscope.wire import EVENT_COMPILE, EVENT_KINDS

    assert set(EVENT_KINDS) - {EVENT_COMPILE} <= set(BADPUT_CATEGORIES)
    assert EVENT_COMPILE not in BADPUT_CATEGORIES  # marks the settled steps only
    assert checkpointing.checkpoint_kind("save") == "checkpoint_save"
    assert checkpointing.checkpoint_kind("checkpoint_load") == "checkpoint_load"


def test_readers_of_the_record_file_skip_its_event_lines(tmp_path):
    from syncscope.sim.records import load_jsonl

    from syncscope.lab.truth import read_records

    path = tmp_path / "rank0.jsonl"
    phases = dict.fromkeys(PHASES, 0.001)
    steps = [
        {"rank": 0, "world_size": 1, "step": k, "step_s": 0.007, "phases": phases, "wait_s": 0}
        for k in range(3)
    ]
    startup = {"rank": 0, "world_size": 1, "event": "startup", "step": None, "duration_s": 2.0}
    save = {"rank": 0, "world_size": 1, "event": "checkpoint_save", "step": 1, "duration_s": 0.1}
    lines = [startup, steps[0], save, *steps[1:]]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = load_jsonl(path)
    assert run.skipped_records == 0 and list(run.ranks[0].steps) == [0, 1, 2]
    assert read_records([str(path)])[0][1]["step_s"] == 0.007
