"""Shared-memory transport to a local exporter: a file ring under /dev/shm, no thread (issue 18).

Why: the HTTP reporter (transport.py) drains the queues on a daemon thread once a second and
holds the GIL for JSON and HTTP while it does (0.3-0.8 ms, more after a backlog), each rank at
its own phase. In synchronous training a pause on any rank delays every rank, so across a
thousand ranks nearly every step holds someone's pause. Here the training thread itself moves
the queued rows into a shared-memory ring at every `align_every_steps`-th step boundary (a few
struct.pack_into per row; the same steps on every rank, so the ranks pause together, once), and
the exporter, another process, reads the ring. No JSON, no HTTP, no background thread in the training
process. The HTTP path stays for remote exporters.

The ring is one file, `<dir>/<job>.<rank>.<pid>.<incarnation>.ring`, single producer (the
training thread; other threads' rows reach it through the deques) and single consumer (the
exporter, exporter/shm_reader.py). Layout, little-endian:

  header (HEADER_BYTES)
    0   8s  magic                 8   I  version        12  I  slot bytes
    16  Q   capacity (slots)      24  Q  write_seq (producer)
    32  Q   read_seq (consumer)   40  Q  dropped_total (producer: every record the agent lost)
    48  q   clock_offset_ns       56  I  closed flag    60  I  meta length
    64  q   heartbeat unix ns     72  Q  pid            80  I  a reader opened it
    128 ... meta: JSON of the agent's identity and its static topology (written once)
  slots: capacity x SLOT_BYTES; slot i holds record seq where seq % capacity == i:
    stamp (Q, seq + 1), kind (Q), payload, stamp again (Q, seq + 1)

Protocol: the producer writes a slot only while write_seq - read_seq < capacity, then publishes
write_seq; the consumer reads [read_seq, write_seq) and publishes read_seq after copying. A full
ring (no exporter, or a slow one) refuses the new record and counts it as dropped: tail drop as
in the queues, bounded memory, never a wait. The stamps at both ends of a slot let the reader
reject a slot it caught half-written (which the protocol excludes; a foreign writer or a weakly
ordered CPU could not), counting it as dropped.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import struct
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger("syncscope.agent")

MAGIC = b"SSRING01"
VERSION = 1
HEADER_BYTES = 4096
META_OFFSET = 128
SLOT_BYTES = 160
DEFAULT_CAPACITY = 16384  # slots: 2.5 MiB; at 10 ms steps with 2 records each, 80 s of them
DEFAULT_DIR = "/dev/shm/syncscope"
SUFFIX = ".ring"
HOUSEKEEPING_EVERY = 4  # pumps between header updates (offset, heartbeat, dropped)
NAME_CACHE = 1024  # (op, group) pairs whose encoded names a ring keeps

KIND_STEP = 1
KIND_COLLECTIVE = 2
OP_BYTES = 32
GROUP_BYTES = 64

HEAD = struct.Struct("<8sIIQQQQqII qQ")
WRITE_SEQ = struct.Struct("<Q")  # at 24
READ_SEQ_AT = 32
WRITE_SEQ_AT = 24
DROPPED_AT = 40
OFFSET_AT = 48
CLOSED_AT = 56
HEARTBEAT_AT = 64
READER_AT = 80
Q = struct.Struct("<Q")
q = struct.Struct("<q")
I32 = struct.Struct("<I")
# stamp, kind, 9 x int64 (a step row), 32 pad, stamp
STEP_SLOT = struct.Struct("<QQ9q64xQ")
# stamp, kind, op, group, bytes, duration_ns, step, 16 pad, stamp
COLL_SLOT = struct.Struct(f"<QQ{OP_BYTES}s{GROUP_BYTES}sqqq16xQ")
assert STEP_SLOT.size == SLOT_BYTES and COLL_SLOT.size == SLOT_BYTES


def ring_dir(url: str) -> str:
    """The directory of `shm:///path` (or `shm://` for the default)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme != "shm":
        raise ValueError(f"not a shm:// exporter URL: {url!r}")
    return parsed.path or DEFAULT_DIR


def ring_name(identity: dict[str, Any]) -> str:
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", str(identity.get("job", "job")))[:64]
    return (
        f"{safe}.{int(identity.get('rank', 0))}.{int(identity.get('pid', os.getpid()))}."
        f"{identity.get('incarnation', 'x')}{SUFFIX}"
    )


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
        dropped and counted)."""
        self._take(rows, STEP_SLOT, KIND_STEP, None)

    def take_collectives(self, rows: deque) -> None:
        self._take(rows, COLL_SLOT, KIND_COLLECTIVE, self._collective_fields)

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
    numbers, it falls on the same steps on every rank: the ranks pause together. Nothing here waits or raises into
    training: a full ring drops and counts, an error is counted and the transport goes quiet.
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
        return self._ring_dropped + self.dropped_elsewhere()

    def pump(self, _step: int = 0) -> None:
        ring = self.ring
        if ring is None:
            return
        try:
            if self.steps:
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
