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
    """What the phase clock queues: 20 ms steps (2 ms of each phase), one 3 ms DDP sync each."""
    end0 = time.perf_counter_ns()
    steps = deque((i, end0 + i * 20 * MS, 20 * MS, *[2 * MS] * 6) for i in range(n))
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
    step, duration, end_unix_s, phases = ingest.steps[5]
    assert (step, duration) == (5, pytest.approx(0.020))
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
