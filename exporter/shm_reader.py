"""The exporter's side of the shared-memory transport (agent/shm_ring.py).

A thread of the exporter scans the ring directory once per interval, reads every ring's new
records and folds them into the store through the same validation and `Store.ingest` as an
HTTP batch (the rows are the wire schema's version-2 rows; only JSON and HTTP are skipped). All
the decoding happens here, in the exporter's process, none of it in training.

Per ring and poll: at most `capacity` records, in batches of at most MAX_RECORDS_PER_BATCH. A
slot whose two stamps disagree (caught half-written) or rows the schema refuses are counted as
dropped and reported in the rank's `dropped_total`. A ring is forgotten and its file removed
once it is drained and its agent closed it, or it brought nothing for `expire_after_s`. While
the agent's process lives (as far as this pid namespace shows), every poll ingests a batch
even with no rows, as the HTTP reporter sends one every flush: the rank stays live.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError
from syncscope.exporter.store import Ingest

from syncscope.shm_layout import (
    CLOSED_AT,
    COLL_SLOT,
    DROPPED_AT,
    EVENT_SLOT,
    HEAD,
    HEADER_BYTES,
    HEARTBEAT_AT,
    I32,
    KIND_COLLECTIVE,
    KIND_EVENT,
    KIND_STEP,
    MAGIC,
    META_OFFSET,
    OFFSET_AT,
    READ_SEQ_AT,
    READER_AT,
    SLOT_BYTES,
    STEP_SLOTS,
    SUFFIX,
    WRITE_SEQ_AT,
    Q,
    q,
)
from syncscope.wire import EVENT_KINDS, SCHEMA_VERSION, BadRows, BatchV1, BatchV2

log = logging.getLogger("syncscope.exporter")

MAX_RECORDS_PER_BATCH = 1024
MAX_CAPACITY = 1 << 22
MAX_RINGS = 4096
_adapter: TypeAdapter[BatchV1 | BatchV2] = TypeAdapter(
    Annotated[BatchV1 | BatchV2, Field(discriminator="schema_version")]
)


class BadRing(ValueError):
    """A file in the ring directory that is not a ring this reader understands."""


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except OSError as exc:
        return exc.errno == errno.EPERM
    return True


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


class RingReader:
    """One agent's ring, opened read-write (the reader publishes its cursor)."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_NOFOLLOW", 0))
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
                raise BadRing(f"{path}: not a ring")
            self.mm = mmap.mmap(fd, st.st_size)
        finally:
            os.close(fd)
        try:
            magic, version, slot, capacity, *_rest, meta_len, _hb, pid = HEAD.unpack_from(
                self.mm, 0
            )
            if magic != MAGIC or version not in STEP_SLOTS or slot != SLOT_BYTES:
                raise BadRing(f"{path}: unknown ring format")
            if not 2 <= capacity <= MAX_CAPACITY or st.st_size != HEADER_BYTES + capacity * slot:
                raise BadRing(f"{path}: ring size does not match its header")
            if meta_len > HEADER_BYTES - META_OFFSET:
                raise BadRing(f"{path}: metadata too long")
            meta = json.loads(bytes(self.mm[META_OFFSET : META_OFFSET + meta_len]))
            if not isinstance(meta, dict) or not isinstance(meta.get("agent"), dict):
                raise BadRing(f"{path}: metadata without an agent")
        except BaseException:
            self.mm.close()
            raise
        I32.pack_into(self.mm, READER_AT, 1)  # the agent leaves the file to us at close
        self.path = path
        self.capacity = capacity
        self.step_slot = STEP_SLOTS[version]  # the step row's layout in this ring's version
        self.pid = int(pid)
        self.agent: dict[str, Any] = meta["agent"]
        topology = meta.get("topology")
        self.topology: dict[str, Any] | None = topology if isinstance(topology, dict) else None
        self.torn = 0  # slots rejected by their stamps, or rows the schema refused
        self.read_records = 0
        self.last_progress = time.monotonic()  # when records last came

    def header(self, at: int, fmt: Any = Q) -> int:
        return int(fmt.unpack_from(self.mm, at)[0])

    @property
    def closed(self) -> bool:
        return self.header(CLOSED_AT, I32) != 0

    def pending(self) -> int:
        return max(0, self.header(WRITE_SEQ_AT) - self.header(READ_SEQ_AT))

    def read(self, limit: int) -> tuple[list[tuple], list[tuple], list[tuple]]:
        """Up to `limit` new records as wire rows (steps, collectives, events); advances the
        cursor."""
        mm, cap, step_slot = self.mm, self.capacity, self.step_slot
        wseq, rseq = self.header(WRITE_SEQ_AT), self.header(READ_SEQ_AT)
        if wseq < rseq or wseq - rseq > cap:  # a cursor no producer could have left
            self.torn += abs(wseq - rseq)
            Q.pack_into(mm, READ_SEQ_AT, wseq)
            return [], [], []
        end = min(wseq, rseq + limit)
        steps: list[tuple] = []
        colls: list[tuple] = []
        events: list[tuple] = []
        for seq in range(rseq, end):
            at = HEADER_BYTES + (seq % cap) * SLOT_BYTES
            stamp, kind = Q.unpack_from(mm, at)[0], Q.unpack_from(mm, at + 8)[0]
            if kind == KIND_STEP:
                fields = step_slot.unpack_from(mm, at)
                if stamp == seq + 1 == fields[-1]:
                    steps.append(fields[2:-1])
                    continue
            elif kind == KIND_COLLECTIVE:
                _s, _k, op, group, nbytes, duration, step, tail = COLL_SLOT.unpack_from(mm, at)
                if stamp == seq + 1 == tail:
                    colls.append((_text(op), _text(group), nbytes, duration, step))
                    continue
            elif kind == KIND_EVENT:
                _s, _k, code, step, end_ns, duration, tail = EVENT_SLOT.unpack_from(mm, at)
                if stamp == seq + 1 == tail and 0 <= code < len(EVENT_KINDS):
                    events.append((EVENT_KINDS[code], step, end_ns, duration))
                    continue
            self.torn += 1
        Q.pack_into(mm, READ_SEQ_AT, end)  # the slots are copied: the producer may reuse them
        self.read_records += end - rseq
        if end > rseq:
            self.last_progress = time.monotonic()
        return steps, colls, events

    def batch(
        self,
        steps: list[tuple],
        colls: list[tuple],
        link: dict[str, Any],
        events: list[tuple] | None = None,
    ) -> dict:
        topology = dict(self.topology) if self.topology else None
        if link:
            topology = {**(topology or {}), **link}
        return {
            "schema_version": SCHEMA_VERSION,
            "agent": self.agent,
            "clock_offset_ns": self.header(OFFSET_AT, q),
            "dropped_total": self.header(DROPPED_AT) + self.torn,
            "steps": steps,
            "collectives": colls,
            "pacing": None,
            "topology": topology,
            "events": events or [],
        }

    def heartbeat_unix_s(self) -> float:
        return self.header(HEARTBEAT_AT, q) / 1e9

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.mm.close()


def _link_counters(topology: dict[str, Any] | None, sys_class_net: str) -> dict[str, Any]:
    """The link byte counters the HTTP reporter reads at each flush, read here instead."""
    ifname = (topology or {}).get("link_interface")
    if not isinstance(ifname, str) or "/" in ifname or ifname.startswith("."):
        return {}
    out = {}
    for direction in ("tx", "rx"):
        try:
            with open(f"{sys_class_net}/{ifname}/statistics/{direction}_bytes") as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit():
            out[f"link_{direction}_bytes"] = int(text)
    return out


class ShmPoller:
    """Reads every ring in `directory` each `interval_s` on a daemon thread; `poll_once()` is
    the unit the thread repeats (the tests call it directly)."""

    def __init__(
        self,
        directory: str,
        ingest: Callable[[Ingest], dict[str, Any]],
        reject: Callable[[str, int], None] | None = None,
        *,
        interval_s: float = 1.0,
        expire_after_s: float = 600.0,
        sys_class_net: str = "/sys/class/net",
    ) -> None:
        self.directory = directory
        self.ingest = ingest
        self.reject = reject
        self.interval_s = interval_s
        self.expire_after_s = expire_after_s
        self.sys_class_net = sys_class_net
        self.rings: dict[str, RingReader] = {}
        self.bad: set[str] = set()
        self.ingested_records = 0
        self.errors = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncscope-shm-reader", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for ring in self.rings.values():
            ring.close()
        self.rings.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.poll_once()
            except Exception as exc:  # noqa: BLE001 - the reader must outlive anything
                self.errors += 1
                if self.errors <= 3:
                    log.warning("syncscope: shared-memory reader error: %r", exc)

    def _discover(self) -> None:
        try:
            names = os.listdir(self.directory)
        except OSError:
            return
        for name in names:
            if not name.endswith(SUFFIX) or name in self.rings or name in self.bad:
                continue
            if len(self.rings) >= MAX_RINGS:
                break
            try:
                self.rings[name] = RingReader(os.path.join(self.directory, name))
            except (OSError, ValueError) as exc:  # BadRing, bad JSON, a file that went away
                self.bad.add(name)
                log.info("syncscope: ignoring %s (%s)", name, exc)

    def poll_once(self) -> int:
        """Ingest what every ring holds; return the number of records ingested."""
        self._discover()
        total = 0
        now = time.monotonic()
        for name, ring in list(self.rings.items()):
            closed = ring.closed
            alive = _alive(ring.pid)
            sent = False
            for _ in range(ring.capacity // MAX_RECORDS_PER_BATCH + 1):
                steps, colls, events = ring.read(MAX_RECORDS_PER_BATCH)
                if not steps and not colls and not events and (sent or closed or not alive):
                    break
                total += self._ingest(ring, steps, colls, events)
                sent = True
                if not ring.pending():
                    break
            # A pid the exporter cannot see may live in another pid namespace: only a ring
            # that is closed, or silent for expire_after_s, is forgotten.
            silent = now - ring.last_progress > self.expire_after_s
            if not ring.pending() and (closed or silent):
                ring.close()
                del self.rings[name]
                with contextlib.suppress(OSError):
                    os.unlink(ring.path)
        self.ingested_records += total
        return total

    def _ingest(
        self, ring: RingReader, steps: list[tuple], colls: list[tuple], events: list[tuple]
    ) -> int:
        link = _link_counters(ring.topology, self.sys_class_net)
        raw = ring.batch(steps, colls, link, events)
        count = len(steps) + len(colls) + len(events)
        try:
            batch = Ingest.of(_adapter.validate_python(raw))
        except (ValidationError, BadRows):
            ring.torn += count
            if self.reject is not None:
                self.reject("invalid_schema", 1)
            return 0
        reply = self.ingest(batch)
        return count if reply.get("accepted") else 0
