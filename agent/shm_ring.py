"""Shared-memory transport to a local exporter: a file ring under /dev/shm, no thread.

Why: the HTTP reporter (transport.py) drains the queues on a daemon thread once a second and
holds the GIL for JSON and HTTP while it does (0.3-0.8 ms, more after a backlog), each rank at
its own phase. In synchronous training a pause on any rank delays every rank, so across a
thousand ranks nearly every step holds someone's pause. Here the training thread itself moves
the queued rows into a shared-memory ring at every `align_every_steps`-th step boundary (a few
struct.pack_into per row; the same steps on every rank, so the ranks pause together, once), and
the exporter, another process, reads the ring. No JSON, no HTTP, no background thread in the
training process. The HTTP path stays for remote exporters.

The ring's layout and protocol: syncscope/shm_layout.py.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import struct
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from syncscope.shm_layout import (
    CLOSED_AT,
    COLL_SLOT,
    DEFAULT_CAPACITY,
    DROPPED_AT,
    EVENT_SLOT,
    GROUP_BYTES,
    HEAD,
    HEADER_BYTES,
    HEARTBEAT_AT,
    HOUSEKEEPING_EVERY,
    I32,
    KIND_COLLECTIVE,
    KIND_EVENT,
    KIND_STEP,
    MAGIC,
    META_OFFSET,
    NAME_CACHE,
    OFFSET_AT,
    OP_BYTES,
    READ_SEQ_AT,
    READER_AT,
    SLOT_BYTES,
    STEP_FIELDS,
    STEP_SLOT,
    VERSION,
    WRITE_SEQ_AT,
    Q,
    q,
    ring_dir,
    ring_name,
)
from syncscope.wire import EVENT_KINDS, UNKNOWN_WORK

log = logging.getLogger("syncscope.agent")


def _without_work(row: tuple) -> tuple:
    return (*row, UNKNOWN_WORK, UNKNOWN_WORK)


_EVENT_CODES = {kind: code for code, kind in enumerate(EVENT_KINDS)}


def _event_fields(row: tuple) -> tuple:
    kind, step, end, duration = row
    return (_EVENT_CODES[kind], int(step), int(end), int(duration))


class ShmRing:
    """The producer side: create the ring file, put rows, publish. One thread only."""

    def __init__(self, path: str, meta: dict[str, Any], capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 2:
            raise ValueError("capacity must be at least 2 slots")
        meta_bytes = json.dumps(meta).encode()
        if len(meta_bytes) > HEADER_BYTES - META_OFFSET:
            raise ValueError("ring metadata too large")
        self.path = path
        self.capacity = capacity
        size = HEADER_BYTES + capacity * SLOT_BYTES
        tmp = f"{path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o660)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        mm = self.mm
        mm[META_OFFSET : META_OFFSET + len(meta_bytes)] = meta_bytes
        HEAD.pack_into(
            mm, 0, MAGIC, VERSION, SLOT_BYTES, capacity, 0, 0, 0, 0, 0, len(meta_bytes),
            time.time_ns(), os.getpid(),
        )  # fmt: skip
        self.update_offset()
        os.replace(tmp, path)  # readers never see a file without its header
        self.wseq = 0
        self.rseq_seen = 0  # the consumer's cursor as last read: read again when a batch won't fit
        self.dropped = 0  # records refused by a full ring
        self.written = 0
        self._names: dict[tuple[str, str], tuple[bytes, bytes]] = {}

    def _room(self, need: int) -> int:
        """Free slots; the consumer's cursor is read again only when the last reading of it
        leaves fewer than `need`."""
        room = self.capacity - (self.wseq - self.rseq_seen)
        if room < need:
            self.rseq_seen = Q.unpack_from(self.mm, READ_SEQ_AT)[0]
            room = self.capacity - (self.wseq - self.rseq_seen)
        return room

    def _collective_fields(self, row: tuple) -> tuple:
        op, group, nbytes, duration, step = row
        names = self._names.get((op, group))
        if names is None:
            if len(self._names) >= NAME_CACHE:
                self._names.clear()
            names = self._names[(op, group)] = (
                op.encode()[:OP_BYTES],
                group.encode()[:GROUP_BYTES],
            )
        return (*names, int(nbytes), int(duration), int(step))

    def take_steps(self, rows: deque) -> None:
        """Every row queued in `rows` now, popped into the ring (those it has no room for are
        dropped and counted). Rows come from one clock, so the first row's length says whether
        they carry their work: rows of the 9-field wire form go in with it unknown."""
        fields = None if not rows or len(rows[0]) == STEP_FIELDS else _without_work
        self._take(rows, STEP_SLOT, KIND_STEP, fields)

    def take_collectives(self, rows: deque) -> None:
        self._take(rows, COLL_SLOT, KIND_COLLECTIVE, self._collective_fields)

    def take_events(self, rows: deque) -> None:
        self._take(rows, EVENT_SLOT, KIND_EVENT, _event_fields)

    def _take(
        self,
        rows: deque,
        slot: struct.Struct,
        kind: int,
        fields: Callable[[tuple], tuple] | None,
    ) -> None:
        # One loop over the rows: the room is read once, not per row (a pump moves
        # align_every_steps steps' rows at once), each slot stamped at both ends.
        n = len(rows)  # rows other threads append meanwhile wait for the next pump
        fit = min(n, max(0, self._room(n)))
        pop, pack, mm, capacity = rows.popleft, slot.pack_into, self.mm, self.capacity
        seq = self.wseq
        try:
            for _ in range(fit):
                row = pop()
                offset = HEADER_BYTES + (seq % capacity) * SLOT_BYTES
                pack(mm, offset, seq + 1, kind, *(fields(row) if fields else row), seq + 1)
                seq += 1
        finally:
            self.wseq = seq  # what was packed before an error stays written
        for _ in range(n - fit):
            pop()
        self.dropped += n - fit

    def publish(self) -> None:
        """Make every record put so far visible to the reader (after their slots are written)."""
        Q.pack_into(self.mm, WRITE_SEQ_AT, self.wseq)
        self.written = self.wseq

    def update_offset(self) -> None:
        q.pack_into(self.mm, OFFSET_AT, time.time_ns() - time.perf_counter_ns())
        q.pack_into(self.mm, HEARTBEAT_AT, time.time_ns())

    def set_dropped(self, total: int) -> None:
        Q.pack_into(self.mm, DROPPED_AT, total)

    def close(self) -> None:
        """Mark the ring closed; the reader drains it and removes the file. A ring no reader
        ever opened is removed here: no exporter is coming for it, and /dev/shm is memory."""
        try:
            self.publish()
            I32.pack_into(self.mm, CLOSED_AT, 1)
            seen = I32.unpack_from(self.mm, READER_AT)[0]
            self.mm.close()
            if not seen:
                os.unlink(self.path)
        except (ValueError, OSError):
            pass


class ShmTransport:
    """What the agent holds instead of a Reporter when the exporter is `shm://DIR`.

    `pump()` runs on the training thread at every `align_every_steps`-th step boundary (the
    phase clock calls it after the step's row is queued, as does the end of `with
    agent.step()`): it moves the queued rows into the ring. Every HOUSEKEEPING_EVERY pumps it
    also refreshes the header's clock offset, heartbeat and drop count. Being tied to step
    numbers, it falls on the same steps on every rank: the ranks pause together. Nothing here
    waits or raises into training: a full ring drops and counts, an error is counted and the
    transport goes quiet.
    """

    def __init__(
        self,
        *,
        identity: dict[str, Any],
        url: str,
        steps: deque,
        collectives: deque,
        dropped_elsewhere: Callable[[], int],
        topology: dict[str, Any] | None = None,
        capacity: int = DEFAULT_CAPACITY,
        events: deque | None = None,
        before_drain: Callable[[], None] | None = None,
        finish_rows: Callable[[deque], list[tuple]] | None = None,
    ) -> None:
        directory = ring_dir(url)
        os.makedirs(directory, mode=0o770, exist_ok=True)
        meta = {"agent": identity, "topology": topology or None}
        self.ring: ShmRing | None = ShmRing(
            os.path.join(directory, ring_name(identity)), meta, capacity
        )
        self.path = self.ring.path
        self.steps = steps
        self.collectives = collectives
        self.events = events
        self.before_drain = before_drain  # moves records buffered elsewhere into the queues
        self.finish_rows = finish_rows  # the clock's quiet rows made whole (PhaseClock.finish)
        self._finish_dropped = 0  # their sync records a full collectives queue refused
        self.dropped_elsewhere = dropped_elsewhere
        self.errors = 0
        self.pumps = 0
        self._final_written = 0
        self._ring_dropped = 0

    # The Reporter's interface, as the agent uses it.
    def start(self) -> None:
        pass

    def stop(self, timeout: float = 0.0) -> None:
        self.pump()
        ring = self.ring
        if ring is not None:
            try:
                ring.update_offset()
                ring.set_dropped(self.dropped_total)
            except (ValueError, OSError):
                pass
            ring.close()
            self.ring = None

    @property
    def sent_records(self) -> int:
        """Records handed to the ring (what the exporter will read, unless it never comes)."""
        return self.ring.written if self.ring is not None else self._final_written

    @property
    def send_dropped(self) -> int:
        return self._ring_dropped

    @property
    def dropped_total(self) -> int:
        return self._ring_dropped + self._finish_dropped + self.dropped_elsewhere()

    def _finished(self, syncs: list[tuple]) -> None:
        """Queue the estimated sync records of the rows just made whole (tail drop, counted)."""
        coll = self.collectives
        room = (coll.maxlen or sys.maxsize) - len(coll)
        coll.extend(syncs[:room])
        self._finish_dropped += max(0, len(syncs) - max(0, room))

    def pump(self, _step: int = 0) -> None:
        ring = self.ring
        if ring is None:
            return
        try:
            if self.before_drain is not None:
                self.before_drain()
            if self.events:  # before the steps: a step's checkpoints come before its row
                ring.take_events(self.events)
            if self.steps:
                if self.finish_rows is not None:
                    self._finished(self.finish_rows(self.steps))
                ring.take_steps(self.steps)
            if self.collectives:
                ring.take_collectives(self.collectives)
            ring.publish()
            self._final_written = ring.written
            self._ring_dropped = ring.dropped
            self.pumps += 1
            if self.pumps % HOUSEKEEPING_EVERY == 0:
                ring.update_offset()
                ring.set_dropped(self.dropped_total)
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self.errors += 1
            if self.errors <= 3:
                log.warning("syncscope: shared-memory ring error (records dropped): %r", exc)
