"""Verdicts wait for the evidence: until every rank of a job has delivered a settled window of
steps (Thresholds.window, after its incarnation's first, compiling, step and after a checkpoint
load), the exporter names no straggler and fires no mode anywhere (/v1/state, the page, the
metrics); the page and /v1/state say it is warming up. A slowed rank is still named once the
job has warmed up, and a restart puts the job back into warm-up for its reloaded steps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from fastapi.testclient import TestClient
from syncscope.exporter.app import create_app
from syncscope.exporter.diagnosis import diagnose_job, warming_up
from syncscope.exporter.settings import DEFAULT_THRESHOLDS, Settings
from syncscope.exporter.store import RankView, RecentStep

from syncscope.catalog import STEP_WINDOW
from tests.conftest import parse_samples

MS = 1_000_000
WINDOW = DEFAULT_THRESHOLDS.window
OFFSET_NS = 1_700_000_000 * 10**9 - 5_000 * 10**9


def agent(rank: int, incarnation: str = "a1") -> dict:
    return {
        "job": "j",
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "incarnation": incarnation,
        "hostname": "h",
    }


def row(
    step: int, step_ms: int, exposed_ms: int, data_ms: int = 10, forward_ms: int = 20
) -> list[int]:
    """A step of `step_ms` (wire schema 2): data, forward, backward 30 ms, optimizer 10 ms,
    the exposed wait at the sync, no pacing."""
    phases = (data_ms, forward_ms, 30, 10, exposed_ms, 0)
    return [step, (5_000 + step) * 10**9, step_ms * MS, *(ms * MS for ms in phases)]


@dataclass
class Job:
    client: TestClient

    def post(self, rank: int, rows: list[list[int]], incarnation: str = "a1", **extra) -> None:
        body = {
            "schema_version": 2,
            "agent": agent(rank, incarnation),
            "clock_offset_ns": OFFSET_NS,
            "steps": rows,
            **extra,
        }
        assert self.client.post("/v1/ingest", json=body).status_code == 200

    def start(self, incarnation: str = "a1", **extra) -> None:
        """Both ranks report before any step, so that every step pools both."""
        for rank in (0, 1):
            self.post(rank, [], incarnation, **extra)

    def seen(self) -> tuple[dict, str, str]:
        """(/v1/state's diagnosis, the page, /metrics)."""
        state = self.client.get("/v1/state").json()["jobs"]["j"]
        return state, self.client.get("/").text, self.client.get("/metrics").text


@pytest.fixture
def job() -> Iterator[Job]:
    with TestClient(create_app(Settings())) as client:
        yield Job(client)


def assert_no_verdict(state: dict, page: str, metrics: str, settled: int) -> None:
    diag = state["diagnosis"]
    assert diag["straggler"] is None, diag
    assert not [m for m, v in diag["modes"].items() if v["verdict"]], diag["modes"]
    assert "verdict" not in diag and diag["victims"] == []
    assert diag["warming_up"] == {"steps": settled, "of": WINDOW}, diag
    assert f"warming up ({settled} of {WINDOW} steps)" in page
    assert "STRAGGLER" not in page and 'data-kind="straggler"' not in page
    assert parse_samples(metrics, "syncscope_straggler_cause") == {}
    assert parse_samples(metrics, "syncscope_job_verdict") == {}
    assert parse_samples(metrics, "syncscope_victim_wait_seconds") == {}
    scores = parse_samples(metrics, "syncscope_diagnosis")
    assert all(v < DEFAULT_THRESHOLDS.verdict_score for v in scores.values()), scores


def unequal_start(job: Job, steps: int = 30, check: bool = True) -> None:
    """A clean job's first `steps` steps, unequal as a real trainer's are: rank 0 compiles in
    its first step (5 s; rank 1 waits for it at the sync) and its data loader warms up slowly
    after (rank 0 arrives 30 ms after rank 1 each step, persistently: without the warm-up the
    rules would name it, cause unknown, as the exporter once did at steps 3-5). Checks after
    every step that nothing is named anywhere."""
    job.start()
    for step in range(steps):
        first = step == 0
        job.post(0, [row(step, 5_000 if first else 120, 20, 10 if first else 40)])
        job.post(1, [row(step, 5_000 if first else 120, 4_930 if first else 50)])
        if check:
            assert_no_verdict(*job.seen(), settled=step)


def test_a_clean_jobs_first_30_steps_name_no_straggler_anywhere(job):
    unequal_start(job, 30)
    state, _, _ = job.seen()
    # The compile's step is marked and left out of the rolling figures: no 5 s median.
    for r in state["ranks"]:
        assert r["settled_steps"] == 29
        assert r["step_time_median_s"] == pytest.approx(0.120)
        assert r["step_time_cv"] == pytest.approx(0.0, abs=1e-9)
    steps = client_recent(job)
    assert [s["step"] for s in steps if s.get("warm_up")] == [0]
    # What it measured is kept, below the line: the skew and the straggler's reason.
    diag = state["diagnosis"]
    assert diag["skew_s"] == pytest.approx(0.030)
    assert diag["modes"]["straggler"]["reason"].startswith(f"warming up (29 of {WINDOW} steps)")


def client_recent(job: Job) -> list[dict]:
    ranks = job.client.get("/v1/state", params={"recent": 300}).json()["jobs"]["j"]["ranks"]
    return ranks[0]["recent_steps"]


def test_the_clean_job_stays_clean_once_warmed_up(job):
    """After warm-up its window holds the settled steps only: equal ranks, nobody named, and
    the page and /v1/state no longer say it is warming up."""
    unequal_start(job, 30, check=False)
    for step in range(30, 1 + WINDOW + 40):
        job.post(0, [row(step, 105, 35)])
        job.post(1, [row(step, 105, 35)])
    state, page, metrics = job.seen()
    diag = state["diagnosis"]
    assert "warming_up" not in diag and "warming up" not in page
    assert diag["straggler"] is None
    assert not diag["modes"]["straggler"]["verdict"]
    assert parse_samples(metrics, "syncscope_straggler_cause") == {}


def slowed(job: Job, start: int, stop: int, incarnation: str = "a1", **extra) -> None:
    """Steps `start`..`stop` - 1 of 120 ms with rank 1 slowed: its forward 30 ms longer, it
    arrives 30 ms after rank 0 (rank 0 waits 50 ms at the sync, rank 1 20 ms)."""
    for rank, exposed, forward in ((0, 50, 20), (1, 20, 50)):
        rows = [row(s, 120, exposed, forward_ms=forward) for s in range(start, stop)]
        job.post(rank, rows, incarnation, **extra)


def test_a_slowed_rank_is_named_once_the_job_has_warmed_up_and_not_before(job):
    """The wrong rank is never named on the way (rank 0, slow while warming up), and the
    slowed one (rank 1) is once every rank has a settled window and it is last in the share
    of it the rule asks (3 of 4 steps with two ranks: from step 104 of this job)."""
    unequal_start(job, 30)
    for step in range(30, WINDOW):  # one step short of a settled window
        slowed(job, step, step + 1)
        assert_no_verdict(*job.seen(), settled=step)
    named = []
    for step in range(WINDOW, WINDOW + 10):
        slowed(job, step, step + 1)
        state, page, metrics = job.seen()
        diag = state["diagnosis"]
        assert "warming_up" not in diag and "warming up" not in page
        named.append(diag["straggler"] and diag["straggler"]["rank"])
    assert set(named) == {None, 1} and named[-1] == 1, named
    assert diag["modes"]["straggler"]["verdict"] is True
    assert "STRAGGLER: rank 1" in page and "warming up" not in page
    causes = parse_samples(metrics, "syncscope_straggler_cause")
    assert [dict(k)["rank"] for k in causes] == ["1"], causes


def test_a_restart_puts_the_job_back_into_warm_up_for_its_reloaded_steps(job):
    """Both ranks restart from a checkpoint at step 80 (a new incarnation each, the load
    before their first step): the straggler named before is no longer named while their
    reloaded steps settle, the first of them marked, and it is named again after a window."""
    unequal_start(job, 30, check=False)
    slowed(job, 30, 140)
    assert job.seen()[0]["diagnosis"]["straggler"]["rank"] == 1
    load = {"events": [["checkpoint_load", -1, 4_999 * 10**9, 2 * 10**9]]}
    job.start("a2", **load)
    slowed(job, 80, 81, "a2")
    state, page, metrics = job.seen()
    assert_no_verdict(state, page, metrics, settled=0)
    assert [r["restarts"] for r in state["ranks"]] == [1, 1]
    assert [s["step"] for s in client_recent(job) if s.get("warm_up")] == [80]
    slowed(job, 81, 80 + WINDOW, "a2")
    assert_no_verdict(*job.seen(), settled=WINDOW - 1)
    slowed(job, 80 + WINDOW, 81 + WINDOW, "a2")
    assert job.seen()[0]["diagnosis"]["straggler"]["rank"] == 1


@pytest.mark.parametrize("kind", ["checkpoint_load", "compile"])
def test_a_load_or_a_recompile_inside_a_step_starts_the_settled_count_again(job, kind):
    """A load (an in-process recovery, no restart) or a torch.compile recompilation inside
    step 120: that step is warm-up and the ranks' settled steps count again from the next one.
    A load's time is badput; a compile's stays in the step's phases."""
    unequal_start(job, 30, check=False)
    slowed(job, 30, 120)
    event = {"events": [[kind, 120, 5_120 * 10**9, 2 * 10**9]]}
    slowed(job, 120, 126, **event)
    state, page, metrics = job.seen()
    assert_no_verdict(state, page, metrics, settled=5)
    assert [s["step"] for s in client_recent(job) if s.get("warm_up")] == [0, 120]
    badput = {
        dict(k)["category"]: v
        for k, v in parse_samples(metrics, "syncscope_node_badput_seconds_total").items()
    }
    assert badput.get("checkpoint_load", 0.0) == (4.0 if kind == "checkpoint_load" else 0.0)
    assert "compile" not in badput  # 2 s of a load on each rank above; a compile's are not


def test_the_agent_marks_the_step_a_torch_compile_recompiles_in(monkeypatch):
    """torch.compile's compilations reach the agent (agent/compiles.py): one event in the
    step a new input shape recompiled in, none in the steps that ran compiled code."""
    import torch
    from syncscope.agent import attach

    from syncscope.wire import EVENT_COMPILE

    monkeypatch.delenv("SYNCSCOPE_EXPORTER", raising=False)
    torch.compiler.reset()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager", dynamic=False)
    agent = attach(optimizer=opt, exporter=None, flush_interval_s=3600)
    try:
        recompiled_in = None
        for step in range(8):
            if step == 5:
                recompiled_in = agent.clock.step
            compiled(torch.randn(6 if step == 5 else 4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
        compiles = [e for e in agent.queues.events if e[0] == EVENT_COMPILE]
        assert len(compiles) == 2, compiles  # the first compilation, the new shape's
        assert compiles[1][1] == recompiled_in and compiles[1][3] > 0, compiles
    finally:
        agent.close()
        torch.compiler.reset()
    assert agent.compiles.handler is None


def view(rank: int, settled: int | None, stale: bool = False) -> RankView:
    steps = tuple(RecentStep(k, 0.1, (0.0,) * 7, 0.0) for k in range(3))
    return RankView(
        rank=rank,
        local_rank=rank,
        world_size=2,
        hostname="h",
        pid=1,
        incarnation="a",
        restarts=0,
        last_report_unix_s=0.0,
        stale=stale,
        steps_total=3,
        step_seconds_sum=0.3,
        step_bucket_counts=(),
        phase_seconds_total=(),
        step_time_mean_s=0.1,
        step_time_median_s=0.1,
        step_time_cv=None,
        phase_shares=(),
        arrival_lead_s=None,
        wait_mean_s=None,
        collectives=(),
        dropped_total=0,
        pacing=None,
        topology=None,
        recent_steps=steps,
        settled_steps=settled,
    )


def test_warm_up_is_the_rank_with_fewest_settled_steps_against_the_window():
    assert WINDOW == STEP_WINDOW  # M: the diagnosis's own window, no constant of its own
    w = warming_up([view(0, 150), view(1, 7)])
    assert w is not None
    assert (w.steps, w.of, w.text) == (7, WINDOW, f"warming up (7 of {WINDOW} steps)")
    assert warming_up([view(0, WINDOW), view(1, WINDOW + 5)]) is None
    # A stale rank does not hold the job back; a view that does not count (replayed) is settled.
    assert warming_up([view(0, WINDOW), view(1, 3, stale=True)]) is None
    assert warming_up([view(0, None), view(1, None)]) is None
    diag = diagnose_job([view(0, 2), view(1, 2)], Settings())
    assert diag.warming_up is not None and diag.verdict is None and diag.straggler is None


def test_the_diagnosis_runs_on_new_data_not_per_scrape():
    """Scrapes between two batches of the job reuse its diagnosis; a batch, a rank gone stale
    or a new job-wide reading makes a new one, from the job's last (which carries the modes'
    holds)."""
    from syncscope.exporter.diagnosis import Diagnoser
    from syncscope.exporter.jobwide import JobWide
    from syncscope.exporter.store import Store

    settings = Settings()
    store = Store(settings)
    calls, made = [], []

    def counted(*args):
        calls.append(args)
        made.append(Diagnoser(settings)(*args))
        return made[-1]

    with TestClient(create_app(settings, store)) as client:
        job = Job(client)
        job.start()
        job.post(0, [row(s, 100, 20) for s in range(5)])
        for _ in range(3):
            store.view(counted)
        assert len(calls) == 1
        job.post(1, [row(s, 100, 50) for s in range(5)])
        store.view(counted)
        store.view(counted)
        assert len(calls) == 2
        reading = JobWide({0: 0.0}, read_unix_s=1.0)
        store.job_wide = lambda _job, as_of=None: reading
        store.view(counted)
        store.view(counted)
        assert len(calls) == 3
        settings.stale_after_s = 0.0  # every rank silent longer than that: stale
        store.view(counted)
        assert len(calls) == 4
        assert calls[0][3] is None
        assert all(args[3] is last for args, last in zip(calls[1:], made, strict=False))
