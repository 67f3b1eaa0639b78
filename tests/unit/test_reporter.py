"""The reporter's batches as the exporter parses them, and the local estimator only when read."""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from syncscope.exporter.app import parse_batch

from syncscope.wire import SCHEMA_VERSION
from tests.conftest import make_reporter

MS = 1_000_000


class Sink:
    """An HTTP server on 127.0.0.1 that keeps every body and answers with fixed baselines."""

    def __init__(self, reply: dict[str, Any]) -> None:
        bodies = self.bodies = []
        payload = json.dumps(reply).encode()

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
def test_batches_parse_as_sent_and_estimate_only_when_read(sink, estimate):
    steps, colls = queued(30)
    identity = {"job": "r", "rank": 0, "local_rank": 0, "world_size": 2, "incarnation": "i"}
    rep = make_reporter(
        sink.url, steps, colls, identity=identity, send_timeout_s=2.0, estimate=estimate
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
    if estimate:  # pacing reads this baseline; the exporter's reply is folded in
        assert rep.ddp_baseline_s == pytest.approx(0.001)
        assert rep.baselines_text()["ddp_grad_sync|default_pg|20"] == pytest.approx(0.001)
    else:  # nobody reads it: not fed, not merged
        assert rep.ddp_baseline_s == 0.0 and rep.baselines_text() == {}


def test_a_record_file_needs_the_estimate(tmp_path):
    steps, colls = queued(3)
    path = tmp_path / "rec.jsonl"
    rep = make_reporter(
        None,
        steps,
        colls,
        identity={"rank": 1, "world_size": 2},
        record_path=str(path),
        estimate=False,
    )
    rep.start()
    rep.stop()  # its last flush writes the file
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2] and rep.estimate
    assert lines[0]["step_s"] == pytest.approx(0.020)
    assert lines[0]["phases"]["other"] == pytest.approx(0.008)
    assert all(r["wait_s"] >= 0.0 for r in lines)
    assert rep.baselines_text()  # the waits came from a fed estimator
