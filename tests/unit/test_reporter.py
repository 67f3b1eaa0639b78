"""The reporter's batches as the exporter parses them, and the hooks the agent hangs on a flush."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from syncscope.agent.local_arrival import LocalArrival
from syncscope.agent.pacing import PacingController
from syncscope.agent.recording import RecordWriter
from syncscope.exporter.app import parse_batch

from syncscope.wire import SCHEMA_VERSION, PacingState
from tests.conftest import make_reporter

# clock: phases judged against sleeps on the real clock (pyproject.toml's markers).
pytestmark = pytest.mark.clock

MS = 1_000_000


class Sink:
    """An HTTP server on 127.0.0.1 that keeps every body and answers with fixed baselines."""

    def __init__(self, reply: dict[str, Any] | bytes) -> None:
        bodies = self.bodies = []
        payload = reply if isinstance(reply, bytes) else json.dumps(reply).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def sink():
    s = Sink({"accepted": True, "baselines": {"ddp_grad_sync|default_pg|20": 0.001}})
    yield s
    s.close()


def queued(n: int) -> tuple[deque, deque]:
    """What the phase clock queues: 20 ms steps (2 ms of each phase) of 16 samples, tokens not
    known (-1), one 3 ms DDP sync each."""
    end0 = time.perf_counter_ns()
    steps = deque((i, end0 + i * 20 * MS, 20 * MS, *[2 * MS] * 6, 16, -1) for i in range(n))
    colls = deque(("ddp_grad_sync", "default_pg", 1 << 20, 3 * MS, i) for i in range(n))
    return steps, colls


@pytest.mark.parametrize("estimate", [False, True])
def test_batches_parse_as_sent_and_replies_reach_the_estimate(sink, estimate):
    steps, colls = queued(30)
    identity = {"job": "r", "rank": 0, "local_rank": 0, "world_size": 2, "incarnation": "i"}
    arrival = LocalArrival() if estimate else None  # what the agent builds when it is read
    rep = make_reporter(
        sink.url,
        steps,
        colls,
        identity=identity,
        send_timeout_s=2.0,
        on_drained=arrival.drained if arrival is not None else None,
        on_reply=arrival.merge_reply if arrival is not None else None,
    )
    before = time.time()
    rep.flush()
    assert rep.sent_records == 60 and rep.send_dropped == 0 and len(sink.bodies) == 1
    # What the agent sent goes through the exporter's own parser unchanged.
    ingest = parse_batch(sink.bodies[0])
    assert ingest.batch.schema_version == SCHEMA_VERSION == 2
    step, duration, end_unix_s, phases, samples, tokens = ingest.steps[5]
    assert (step, duration, samples, tokens) == (5, pytest.approx(0.020), 16, -1)
    assert phases == pytest.approx((0.002,) * 6 + (0.008,))  # other: what the phases leave
    assert before - 1 < end_unix_s - 5 * 0.020 < before + 1  # monotonic clock mapped to unix
    assert ingest.collectives[5] == ("ddp_grad_sync", "default_pg", float(1 << 20), 0.003, 5)
    assert ingest.batch.pacing is None and ingest.batch.topology is None
    if arrival is not None:  # pacing reads this baseline; the exporter's reply is folded in
        assert arrival.ddp_baseline_s == pytest.approx(0.001)
        assert arrival.baselines_text()["ddp_grad_sync|default_pg|20"] == pytest.approx(0.001)


def test_pacing_state_goes_out_as_the_wire_type(sink):
    controller = PacingController()
    for _ in range(40):
        controller.update(0.030)
    steps, colls = queued(2)
    rep = make_reporter(sink.url, steps, colls, pacing_state=controller.state)
    rep.flush()
    sent = json.loads(sink.bodies[0])["pacing"]
    assert sent == {
        "enabled": True,
        "active": True,
        "current_delay_s": controller.current_delay_s,
        "threshold_s": controller.threshold_s,
        "engagements": 1,
        "total_delay_s": controller.total_delay_s,
    }
    assert parse_batch(sink.bodies[0]).batch.pacing == controller.state()
    assert isinstance(controller.state(), PacingState)


def test_on_drained_sees_every_flush_without_an_exporter_and_on_reply_only_answers():
    steps, colls = queued(3)
    seen: list = []
    replies: list = []
    rep = make_reporter(
        None,
        steps,
        colls,
        on_drained=lambda s, c, offset: seen.append((list(s), list(c), offset)),
        on_reply=replies.append,
    )
    rep.flush()
    rep.flush()  # nothing queued and nowhere to send: no call
    assert len(seen) == 1 and replies == []
    drained_steps, drained_colls, offset = seen[0]
    assert [s[0] for s in drained_steps] == [0, 1, 2] and [c[-1] for c in drained_colls] == [
        0,
        1,
        2,
    ]
    assert abs(offset - (time.time_ns() - time.perf_counter_ns())) < 1e9
    assert rep.drained_records == 6 and rep.send_dropped == 0 and rep.sent_records == 0


def test_a_reply_nobody_reads_is_not_parsed():
    s = Sink(b"not json")  # the local estimate would choke on it; without one nothing reads it
    try:
        steps, colls = queued(2)
        rep = make_reporter(s.url, steps, colls)
        rep.flush()
        assert rep.sent_records == 4 and rep.errors == 0
    finally:
        s.close()


def test_the_record_file_gets_the_estimated_waits(tmp_path):
    steps, colls = queued(3)
    identity = {"rank": 1, "world_size": 2}
    record = RecordWriter(str(tmp_path / "rec-{rank}.jsonl"), identity)
    arrival = LocalArrival(record)
    rep = make_reporter(None, steps, colls, identity=identity, on_drained=arrival.drained)
    rep.start()
    rep.stop()  # its last flush writes the file
    record.close()
    lines = [json.loads(line) for line in (tmp_path / "rec-1.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert lines[0]["step_s"] == pytest.approx(0.020)
    assert lines[0]["phases"]["other"] == pytest.approx(0.008)
    assert all(r["wait_s"] >= 0.0 for r in lines)
    assert arrival.baselines_text()  # the waits came from a fed estimator


def wakes(offset_s: float, step_s: float, steps: int, start_s: float = 1000.003) -> list[int]:
    """The steps at whose end a reporter (flush interval 1 s, grid 16) wakes its thread, for a
    rank whose wall clock reads `offset_s` ahead and whose steps end every `step_s`."""
    rep = make_reporter(None, deque(), deque(), align_every_steps=16)
    now = [0.0]
    rep.wall_clock = lambda: now[0]
    out = []
    for step in range(1, steps + 1):
        now[0] = start_s + offset_s + step * step_s
        rep.at_step(step)
        if rep._wake.is_set():
            out.append(step)
            rep._wake.clear()
    return out


def test_ranks_flush_in_the_same_step_and_agree_again_after_a_tick_splits_them():
    # Four ranks, 10 ms steps, wall clocks 0..3 ms apart: the first 16th step after each
    # second of wall time, once per second, on every rank.
    offsets = [0.0, 0.001, 0.002, 0.003]
    by_rank = [wakes(o, 0.010, 1000) for o in offsets]
    assert all(s % 16 == 0 for s in by_rank[0])
    assert 9 <= len(by_rank[0]) <= 11  # ten seconds of steps: about one flush a second
    assert by_rank[0] == by_rank[1] == by_rank[2] == by_rank[3]
    # A tick that falls between two ranks' ends of the same grid step splits them once: the
    # late clock flushes at step 96, the early one 16 steps later; at the next tick they agree.
    # (start 999.04: step 96 ends at 1000.0 - 0.001 on rank 0 and 1000.0 + 0.001 on rank 1)
    early = wakes(-0.001, 0.010, 400, start_s=999.04)
    late = wakes(+0.001, 0.010, 400, start_s=999.04)
    assert 96 in late and 96 not in early and 112 in early
    assert early[-3:] == late[-3:]


def test_steps_longer_than_the_grid_flush_every_two_ticks_at_the_same_step():
    # 300 ms steps: 16 of them span 4.8 s, so the grid alone would flush every 4.8 s; after two
    # ticks without a grid step the reporter wakes at whatever step ends there, on every rank.
    a, b = wakes(0.0, 0.3, 100), wakes(0.002, 0.3, 100)
    assert a == b
    gaps = [y - x for x, y in zip(a[1:], a[2:], strict=False)]
    assert max(gaps) <= 7  # at most 2.1 s: the first step end two ticks on, or a grid step
    assert len(a) >= 14


def test_the_thread_flushes_when_woken_at_a_step_and_on_its_own_only_when_idle():
    steps, colls = queued(2)
    flushed: list[float] = []
    rep = make_reporter(
        None,
        steps,
        colls,
        flush_interval_s=0.1,
        on_drained=lambda *_: flushed.append(time.monotonic()),
    )
    now = [100.0]
    rep.wall_clock = lambda: now[0]
    rep.start()
    try:
        t0 = time.monotonic()
        rep.at_step(1)  # the first step end starts the count
        now[0] += 0.25
        rep.at_step(16)  # a grid step two ticks on wakes it
        deadline = t0 + 2.0
        while not flushed and time.monotonic() < deadline:
            time.sleep(0.005)
        assert flushed and flushed[0] - t0 < 0.2
        steps.extend(queued(1)[0])
        # No step boundary: the idle timer (IDLE_FLUSHES intervals) sends the rest.
        while len(flushed) < 2 and time.monotonic() < deadline + 2.0:
            time.sleep(0.01)
        assert len(flushed) == 2
        assert flushed[1] - flushed[0] >= 0.1 * rep.IDLE_FLUSHES * 0.9
    finally:
        rep.stop()


def test_attach_over_http_wakes_the_reporter_from_the_step_end(sink):
    torch = pytest.importorskip("torch")
    import syncscope.agent as sa

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agent = sa.attach(model, opt, exporter=sink.url, job="t", flush_interval_s=0.5)
    try:
        assert agent.clock.after_step == agent.reporter.at_step and agent.clock.after_every == 1
        t0 = time.monotonic()
        for _ in range(32):  # steps of ~50 ms: a grid step or two ticks on wakes it
            opt.zero_grad()
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            time.sleep(0.05)
            if sink.bodies:
                break
        # Woken at a step end: the reporter's own timer would wait 4 intervals (2 s).
        assert sink.bodies and time.monotonic() - t0 < 0.5 * agent.reporter.IDLE_FLUSHES
        assert json.loads(sink.bodies[0])["steps"]
    finally:
        agent.close()
