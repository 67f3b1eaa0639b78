"""The shared-memory transport (agent/shm_ring.py) and the exporter's reader (shm_reader.py)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from syncscope.agent.shm_ring import (
    ShmRing,
    ShmTransport,
)
from syncscope.exporter.settings import Settings
from syncscope.exporter.shm_reader import RingReader, ShmPoller
from syncscope.exporter.store import Store

from syncscope.shm_layout import HEADER_BYTES, SLOT_BYTES, Q, ring_dir

MS = 1_000_000
IDENTITY = {
    "job": "j",
    "rank": 3,
    "local_rank": 3,
    "world_size": 4,
    "incarnation": "inc",
    "hostname": "h",
    "pid": os.getpid(),
    "started_unix_s": 1.0,
}


def step_row(s: int) -> tuple:
    end = time.perf_counter_ns() + s * 10 * MS
    return (s, end, 10 * MS, MS, 2 * MS, 3 * MS, MS, 2 * MS, 0)


def coll_row(s: int) -> tuple:
    return ("ddp_grad_sync", "default_pg", 4096.0, 2 * MS, s)


def transport(
    tmp_path: Path, capacity: int = 64, clock: Any = None
) -> tuple[ShmTransport, deque, deque]:
    """A transport over fresh queues, or over `clock`'s (its quiet rows made whole at the
    pump)."""
    steps: deque = deque(maxlen=1024) if clock is None else clock.steps
    colls: deque = deque(maxlen=4096) if clock is None else clock.collectives
    tr = ShmTransport(
        identity=dict(IDENTITY),
        url=f"shm://{tmp_path}",
        steps=steps,
        collectives=colls,
        dropped_elsewhere=lambda: 0,
        capacity=capacity,
        finish_rows=None if clock is None else clock.finish,
    )
    return tr, steps, colls


def test_url_gives_the_directory() -> None:
    assert ring_dir("shm:///dev/shm/x") == "/dev/shm/x"
    with pytest.raises(ValueError):
        ring_dir("http://127.0.0.1:1")


def test_rows_round_trip_through_the_store(tmp_path: Path) -> None:
    tr, steps, colls = transport(tmp_path)
    for s in range(5):
        steps.append(step_row(s))
        colls.append(coll_row(s))
        tr.pump()
    assert not steps and not colls
    store = Store(Settings())
    poller = ShmPoller(str(tmp_path), store.ingest, store.reject)
    assert poller.poll_once() == 10
    state = store.ranks[("j", 3)]
    assert state.world_size == 4
    assert store.ingested_records == 10
    tr.stop()
    assert poller.poll_once() == 0
    assert os.listdir(tmp_path) == []  # closed and drained: the reader removed the file


def test_the_pump_sends_quiet_rows_whole_with_their_estimated_syncs(tmp_path: Path) -> None:
    """A phase clock's quiet rows (phase sampling) leave through the ring as full rows, their
    phases their timed step's shares of their own totals, and a DDP sync record estimated alike
    (PhaseClock.finish, at the pump)."""
    from syncscope.agent.phases import QUIET_ROW, PhaseClock

    clock = PhaseClock(deque(maxlen=64), deque(maxlen=64), None, "default_pg", 4096.0, print)
    tr, steps, _colls = transport(tmp_path, clock=clock)
    end = time.perf_counter_ns()
    shares = [0.1, 0.2, 0.3, 0.1, 0.2, 0.0]  # data, forward, backward, optimizer, comm, pacing
    steps.append((0, end, 10 * MS, MS, 2 * MS, 3 * MS, MS, 2 * MS, 0, 4, -1))  # timed
    steps.append((1, end + 20 * MS, 20 * MS, shares, 0.2, 4, -1))  # quiet, as queued
    assert len(steps[1]) == QUIET_ROW
    tr.pump()
    reader = RingReader(tr.path)
    rows, syncs, _events = reader.read(100)
    assert [tuple(r[3:9]) for r in rows] == [
        (MS, 2 * MS, 3 * MS, MS, 2 * MS, 0),
        (2 * MS, 4 * MS, 6 * MS, 2 * MS, 4 * MS, 0),
    ]
    assert [(c[0], c[3], c[4]) for c in syncs] == [("ddp_grad_sync", 4 * MS, 1)]
    tr.stop()


def test_ring_wraps_around_many_times(tmp_path: Path) -> None:
    tr, steps, colls = transport(tmp_path, capacity=8)
    reader = RingReader(tr.path)
    got: list[tuple] = []
    for s in range(100):
        steps.append(step_row(s))
        colls.append(coll_row(s))
        tr.pump()
        if s % 3 == 2:  # the reader keeps up, three steps (6 records) at a time
            st, co, _ev = reader.read(1000)
            got += st
            assert [c[-1] for c in co] == [r[0] for r in st]
    st, _, _ev = reader.read(1000)
    got += st
    assert [r[0] for r in got] == list(range(100))
    assert tr.dropped_total == 0 and reader.torn == 0


def test_absent_reader_drops_and_counts_never_blocks(tmp_path: Path) -> None:
    tr, steps, colls = transport(tmp_path, capacity=16)
    t0 = time.perf_counter()
    for s in range(1000):
        steps.append(step_row(s))
        colls.append(coll_row(s))
        tr.pump()
    assert time.perf_counter() - t0 < 2.0
    assert tr.sent_records == 16
    assert tr.dropped_total == 2000 - 16
    assert not steps and not colls
    # A reader that comes later gets the oldest 16 (tail drop) and makes room again.
    reader = RingReader(tr.path)
    st, co, _ev = reader.read(100)
    assert len(st) + len(co) == 16 and st[0][0] == 0
    steps.append(step_row(1000))
    tr.pump()
    st, _, _ev = reader.read(100)
    assert [r[0] for r in st] == [1000]


def test_dropped_total_reaches_the_exporter(tmp_path: Path) -> None:
    tr, steps, _ = transport(tmp_path, capacity=4)
    store = Store(Settings())
    poller = ShmPoller(str(tmp_path), store.ingest)
    poller.poll_once()  # the exporter found the ring
    for s in range(10):
        steps.append(step_row(s))
        tr.pump()
    tr.stop()  # the header carries the drop count once closed (and every few pumps)
    poller.poll_once()
    assert store.ranks[("j", 3)].dropped_current == 6
    assert store.ingested_records == 4


def test_a_pump_fills_the_room_the_reader_made_since_the_ring_last_looked(tmp_path: Path) -> None:
    ring = ShmRing(str(tmp_path / "r.ring"), {"agent": IDENTITY}, capacity=8)
    ring.take_steps(deque(step_row(s) for s in range(6)))
    ring.publish()
    reader = RingReader(ring.path)
    assert len(reader.read(10)[0]) == 6  # 2 slots left as the ring last saw it, 8 in truth
    ring.take_steps(deque(step_row(s) for s in range(6, 12)))
    ring.publish()
    assert [r[0] for r in reader.read(10)[0]] == list(range(6, 12)) and ring.dropped == 0


def test_torn_slot_is_rejected_and_counted(tmp_path: Path) -> None:
    ring = ShmRing(str(tmp_path / "t.ring"), {"agent": IDENTITY}, capacity=8)
    ring.take_steps(deque(step_row(s) for s in range(3)))
    ring.publish()
    # Slot 1 caught half-written: its trailing stamp is not yet the new one.
    Q.pack_into(ring.mm, HEADER_BYTES + 2 * SLOT_BYTES - 8, 0)
    reader = RingReader(ring.path)
    st, _, _ev = reader.read(10)
    assert [r[0] for r in st] == [0, 2]
    assert reader.torn == 1
    assert reader.batch(st, [], {})["dropped_total"] == 1


def test_unpublished_records_are_not_read(tmp_path: Path) -> None:
    ring = ShmRing(str(tmp_path / "u.ring"), {"agent": IDENTITY}, capacity=8)
    ring.take_steps(deque([step_row(0)]))
    reader = RingReader(ring.path)
    assert reader.read(10) == ([], [], [])
    ring.publish()
    assert len(reader.read(10)[0]) == 1


def test_reader_ignores_foreign_files(tmp_path: Path) -> None:
    (tmp_path / "junk.ring").write_bytes(b"x" * 5000)
    (tmp_path / "short.ring").write_bytes(b"SSRING01")
    store = Store(Settings())
    poller = ShmPoller(str(tmp_path), store.ingest)
    assert poller.poll_once() == 0
    assert poller.bad == {"junk.ring", "short.ring"}


def test_concurrent_reader_sees_every_record_once(tmp_path: Path) -> None:
    tr, steps, _ = transport(tmp_path, capacity=32)
    reader = RingReader(tr.path)
    got: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set() or reader.pending():
            got.extend(r[0] for r in reader.read(7)[0])

    t = threading.Thread(target=read)
    t.start()
    n = 0
    for s in range(3000):
        steps.append(step_row(s))
        tr.pump()
        n += 1
    done.set()
    t.join(10)
    dropped = tr.dropped_total
    assert len(got) + dropped == n
    assert got == sorted(got) and len(set(got)) == len(got)
    assert reader.torn == 0


def test_agent_over_shm_has_no_reporter_thread(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import syncscope.agent as sa

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {t.name for t in threading.enumerate()}
    agent = sa.attach(model, opt, exporter=f"shm://{tmp_path}", job="t", align_every_steps=4)
    assert {t.name for t in threading.enumerate()} - before == set()
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    # pumped at step 4, the same step on every rank: 4 step rows and the startup event
    assert agent.stats["sent_records"] == 5
    for _ in range(3):
        with agent.step():
            pass
    assert agent.stats["sent_records"] == 9  # manual steps 5..7: pumped at step 8
    store = Store(Settings())
    poller = ShmPoller(str(tmp_path), store.ingest)
    poller.poll_once()
    assert store.ingested_records == 9
    agent.close()  # sends the rest
    agent.close()
    poller.poll_once()
    assert store.ingested_records == 9 and agent.stats["dropped_records"] == 0


def test_exporter_app_reads_rings(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient
    from syncscope.exporter.app import create_app

    tr, steps, colls = transport(tmp_path)
    steps.append(step_row(0))
    colls.append(coll_row(0))
    tr.pump()
    app = create_app(Settings(), shm_dir=str(tmp_path))
    with TestClient(app) as client:
        assert app.state.rings.poll_once() == 2  # what its thread does once a second
        ranks = client.get("/v1/state").json()
        assert "j" in str(ranks)
    tr.stop()


def test_ring_no_reader_opened_is_removed_at_close(tmp_path: Path) -> None:
    tr, steps, _ = transport(tmp_path)
    steps.append(step_row(0))
    tr.pump()
    tr.stop()
    assert os.listdir(tmp_path) == []
    tr.stop()  # twice is harmless


def test_open_ring_is_kept_until_silent(tmp_path: Path) -> None:
    tr, steps, _ = transport(tmp_path)
    store = Store(Settings())
    keep = ShmPoller(str(tmp_path), store.ingest, expire_after_s=600.0)
    steps.append(step_row(0))
    tr.pump()
    assert keep.poll_once() == 1
    assert keep.poll_once() == 0 and len(keep.rings) == 1  # drained, open: kept
    gone = ShmPoller(str(tmp_path), store.ingest, expire_after_s=0.0)
    gone.poll_once()
    assert gone.rings == {} and os.listdir(tmp_path) == []  # silent past expiry: forgotten
    tr.stop()
