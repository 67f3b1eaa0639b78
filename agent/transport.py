"""Background reporter: drains the training thread's queues and sends them to the exporter.

Everything that costs more than an append happens on this daemon thread: JSON and HTTP here,
and whatever the agent hangs on a flush (the local arrival estimate, the record file). The
queued tuples are sent as rows (wire schema 2), never turned into an object per record: this
thread shares the GIL with training, and per-record Python work here was most of what a flush
cost the training loop. The exporter being absent, slow or failing only ever costs records,
which are counted as dropped; nothing here can block or raise into training.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from syncscope.wire import (
    INGEST_PATH,
    MAX_COLLECTIVES_PER_BATCH,
    MAX_EVENTS_PER_BATCH,
    MAX_STEPS_PER_BATCH,
    SCHEMA_VERSION,
    PacingState,
)

log = logging.getLogger("syncscope.agent")


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


def open_connection(url: str, timeout: float) -> http.client.HTTPConnection:
    """A connection for `http://host:port` or `unix:///path/to/socket`."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme == "unix":
        return _UnixHTTPConnection(parsed.path, timeout)
    if parsed.scheme == "http":
        return http.client.HTTPConnection(
            parsed.hostname or "127.0.0.1", parsed.port or 9464, timeout=timeout
        )
    raise ValueError(f"exporter URL must be http://host:port or unix:///path, not {url!r}")


def drain(queue: deque, limit: int) -> list:
    """Up to `limit` records, oldest first. The training thread only appends meanwhile, so
    the length read here can only grow before the pops."""
    pop = queue.popleft
    return [pop() for _ in range(min(len(queue), limit))]


def split_batch(steps: list[tuple], colls: list[tuple], limit: int) -> list[tuple[list, list]]:
    """Cut a backlog into requests of about `limit` records, a step's collectives with it.

    Rows as queued: a step row starts with its step number, a collective row ends with it.
    One json.dumps holds the GIL from start to end (it never yields to other threads), so a
    backlog sent as one body would stall the training thread for milliseconds.
    """
    if len(steps) + len(colls) <= limit:
        return [(steps, colls)]
    by_step: dict[int, list[tuple]] = {}
    for c in colls:
        by_step.setdefault(c[-1], []).append(c)
    chunks: list[tuple[list, list]] = []
    chunk_steps: list[tuple] = []
    chunk_colls: list[tuple] = []
    for s in steps:
        chunk_colls.extend(by_step.pop(s[0], ()))
        chunk_steps.append(s)
        if len(chunk_steps) + len(chunk_colls) >= limit:
            chunks.append((chunk_steps, chunk_colls))
            chunk_steps, chunk_colls = [], []
    for rest in by_step.values():  # collectives of steps whose record comes in a later flush
        chunk_colls.extend(rest)
    if chunk_steps or chunk_colls:
        chunks.append((chunk_steps, chunk_colls))
    out: list[tuple[list, list]] = []
    for chunk_steps, chunk_colls in chunks:  # a single step with thousands of collectives
        out.append((chunk_steps, chunk_colls[:limit]))
        out.extend(([], chunk_colls[i : i + limit]) for i in range(limit, len(chunk_colls), limit))
    return out


class Reporter:
    """Owns the daemon thread; `flush()` is also called once more at close.

    When flushes happen: in synchronous training a pause on any rank delays every rank, so a
    flush at each rank's own phase would, across a thousand ranks, put someone's pause into
    nearly every step. The phase clock calls `at_step(step)` at step ends from just before each
    tick (when the last call said) until the step that flushes: the first step boundary after
    each `flush_interval_s` tick of the wall clock that is also a multiple of
    `align_every_steps`, or any boundary once two ticks have passed without one (steps longer
    than the grid), where it wakes the thread. Ticks are absolute and step numbers agree
    across ranks, so the ranks flush in the same step, and a rank that once disagrees (a tick
    falling between ranks' step ends) agrees again at the next tick. With no step boundary for
    `IDLE_FLUSHES` intervals (before the first step, a hang, very long steps) the thread flushes
    on its own timer, so records still leave.

    Delivery is at most once: a batch that fails is counted as dropped and never resent, so a
    request the exporter did process before the connection broke cannot be counted twice. Every
    record drained ends in `sent_records` or `send_dropped` (their sum: `drained_records`).

    Two hooks, both called on this thread and only when set (the agent sets them when the local
    arrival estimate has a reader): `on_drained(steps, collectives, clock_offset_ns)` gets every
    flush's rows as queued, also with no exporter; `on_reply(body)` gets the exporter's answer
    to each batch it accepted. A third, `on_events(events, clock_offset_ns)`, gets each flush's
    event rows (the record file writes them), only when there are some. Events (startup,
    checkpoints: a few per run) go with the first request of a flush.
    """

    MAX_BACKOFF_S = 2.0
    MIN_BACKOFF_S = 0.25
    MAX_RECORDS_PER_REQUEST = 1024
    IDLE_FLUSHES = 4  # intervals without a step boundary's wake-up before the timer flushes

    def __init__(
        self,
        *,
        identity: dict[str, Any],
        url: str | None,
        token: str | None,
        steps: deque,
        collectives: deque,
        flush_interval_s: float,
        send_timeout_s: float,
        align_every_steps: int = 1,
        dropped_elsewhere: Callable[[], int],
        pacing_state: Callable[[], PacingState | None] | None = None,
        topology: Callable[[], dict[str, Any] | None] | None = None,
        on_drained: Callable[[list[tuple], list[tuple], int], None] | None = None,
        on_reply: Callable[[bytes], None] | None = None,
        events: deque | None = None,
        on_events: Callable[[list[tuple], int], None] | None = None,
        before_drain: Callable[[], None] | None = None,
        finish_rows: Callable[[list], list[tuple]] | None = None,
    ) -> None:
        self.identity = identity
        self.url = url
        self.token = token
        self.steps = steps
        self.collectives = collectives
        self.flush_interval_s = flush_interval_s
        self.align_every_steps = max(1, align_every_steps)
        self.send_timeout_s = send_timeout_s
        self.dropped_elsewhere = dropped_elsewhere
        self.pacing_state = pacing_state
        self.topology = topology
        self.on_drained = on_drained
        self.on_reply = on_reply
        self.events = events
        self.on_events = on_events
        self.before_drain = before_drain  # moves records buffered elsewhere into the queues
        # makes the clock's quiet rows whole off the training thread (PhaseClock.finish); returns
        # their estimated DDP sync records
        self.finish_rows = finish_rows
        self.send_dropped = 0
        self.sent_records = 0
        self.sent_batches = 0
        self.errors = 0
        self.refusals = 0
        self.drained_records = 0
        self._in_flight = 0  # drained, neither sent nor counted as dropped yet
        self._conn: http.client.HTTPConnection | None = None
        self._retry_at = 0.0
        self._backoff = self.MIN_BACKOFF_S
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._tick = -1  # the wall-clock tick of the last step-triggered flush (-1: no step yet)
        self._quiet_until = 0.0  # before this wall-clock time no step can wake the thread
        self.wall_clock = time.time  # unix seconds; NTP keeps it alike across hosts
        self._lock = threading.Lock()  # flush() from close() and from the thread
        self._thread = threading.Thread(target=self._run, name="syncscope-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.flush()
        if self._conn is not None:
            self._conn.close()

    @property
    def dropped_total(self) -> int:
        return self.send_dropped + self.dropped_elsewhere()

    def at_step(self, step: int) -> int:
        """Training thread, at a step end: wake the thread if this is the boundary where every
        rank flushes (see the class). Returns the step-end time (time.perf_counter_ns) before
        which the next call would do nothing, a little before the next tick, so that the phase
        clock calls it only from then on (PhaseClock.after_at)."""
        now = self.wall_clock()
        if now < self._quiet_until:  # within the last flush's tick
            return self._perf_until(now)
        interval = self.flush_interval_s
        tick = int(now / interval)
        last = self._tick
        if last < 0:  # the first step end starts the count (the timer covers the time before)
            self._tick = tick
            self._quiet_until = (tick + 1) * interval
        elif tick != last and (step % self.align_every_steps == 0 or tick - last >= 2):
            self._tick = tick
            self._quiet_until = (tick + 1) * interval
            self._wake.set()
        return self._perf_until(now)

    def _perf_until(self, now: float) -> int:
        """`_quiet_until` on the step clock, less a margin for the two clocks' drift (10 ms),
        at most an interval ahead (a wall clock set back must not silence the steps)."""
        ahead = min(self._quiet_until - now, self.flush_interval_s) - 0.01
        return time.perf_counter_ns() + int(ahead * 1e9)

    def _run(self) -> None:
        idle_s = self.flush_interval_s * self.IDLE_FLUSHES
        while True:
            self._wake.wait(idle_s)
            if self._stop.is_set():
                return
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        try:
            with self._lock:
                try:
                    self._flush()
                finally:
                    # Whatever an unexpected error left undelivered is lost: count it.
                    self.send_dropped += self._in_flight
                    self._in_flight = 0
        except BaseException as exc:  # noqa: BLE001 - the reporter must outlive anything
            self.errors += 1
            if self.errors <= 3:
                log.warning("syncscope reporter error (records dropped): %r", exc)

    def _flush(self) -> None:
        if self.before_drain is not None:
            self.before_drain()
        raw_steps = drain(self.steps, MAX_STEPS_PER_BATCH)
        raw_colls = drain(self.collectives, MAX_COLLECTIVES_PER_BATCH)
        if raw_steps and self.finish_rows is not None:
            raw_colls += self.finish_rows(raw_steps)
        raw_events = drain(self.events, MAX_EVENTS_PER_BATCH) if self.events else []
        self._in_flight = len(raw_steps) + len(raw_colls) + len(raw_events)
        self.drained_records += self._in_flight
        if not raw_steps and not raw_colls and not raw_events and self.url is None:
            return
        offset_ns = time.time_ns() - time.perf_counter_ns()  # the queues' clock -> unix time
        if self.on_drained is not None:
            self.on_drained(raw_steps, raw_colls, offset_ns)
        if raw_events and self.on_events is not None:
            self.on_events(raw_events, offset_ns)
        if self.url is not None:
            # The queued tuples go out as they are (wire schema 2): no object per record.
            # While backing off, _send counts them as dropped without building a body.
            chunks = split_batch(raw_steps, raw_colls, self.MAX_RECORDS_PER_REQUEST)
            for i, chunk in enumerate(chunks):
                self._send(*chunk, offset_ns, raw_events if i == 0 else [])
        else:
            self._in_flight = 0  # kept locally, or nowhere: nothing was meant to be sent

    def _send(
        self, steps: list[tuple], colls: list[tuple], clock_offset_ns: int, events: list[tuple]
    ) -> None:
        count = len(steps) + len(colls) + len(events)
        now = time.monotonic()
        if now < self._retry_at:
            self.send_dropped += count
            self._in_flight -= count
            return
        pacing = self.pacing_state() if self.pacing_state is not None else None
        batch = {
            "schema_version": SCHEMA_VERSION,
            "agent": self.identity,
            "clock_offset_ns": clock_offset_ns,
            "dropped_total": self.dropped_total,
            "steps": steps,
            "collectives": colls,
            "pacing": asdict(pacing) if pacing is not None else None,
            "topology": self.topology() if self.topology is not None else None,
        }
        if events:
            batch["events"] = events
        body = json.dumps(batch).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = "Bearer " + self.token
        try:
            if self._conn is None:
                self._conn = open_connection(self.url, self.send_timeout_s)  # type: ignore[arg-type]
            self._conn.request("POST", INGEST_PATH, body, headers)
            response = self._conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.send_dropped += count
            self._in_flight -= count
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._back_off(now)
            if self.errors == 0:
                log.warning(
                    "syncscope: exporter %s unreachable (%s); records are dropped and counted",
                    self.url,
                    exc,
                )
            self.errors += 1
            return
        if response.status != 200:
            self.send_dropped += count
            self._in_flight -= count
            self.refusals += 1
            # Refused (auth, schema, capacity): asking again at once would be refused again.
            self._back_off(now)
            if self.refusals <= 3:
                log.warning(
                    "syncscope: exporter refused a batch: %s %s", response.status, payload[:200]
                )
            return
        self._backoff = self.MIN_BACKOFF_S
        self.sent_records += count
        self._in_flight -= count
        self.sent_batches += 1
        if self.on_reply is not None:
            self.on_reply(payload)

    def _back_off(self, now: float) -> None:
        self._retry_at = now + self._backoff
        self._backoff = min(self.MAX_BACKOFF_S, self._backoff * 2)
