"""Background reporter: drains the training thread's queues, batches records, sends them.

Everything that costs more than an append happens here, on a daemon thread: building dicts,
the arrival estimator, JSON, HTTP. The exporter being absent, slow or failing only ever
costs records, which are counted as dropped; nothing here can block or raise into training.
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
from typing import Any

from syncscope.arrival import ArrivalEstimator, collective_key, key_text, parse_key_text
from syncscope.wire import DDP_GRAD_SYNC, INGEST_PATH, PHASES, SCHEMA_VERSION

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
    out = []
    pop = queue.popleft
    try:
        while len(out) < limit:
            out.append(pop())
    except IndexError:
        pass
    return out


class Reporter:
    """Owns the daemon thread; `flush()` is also called once more at close."""

    MAX_BACKOFF_S = 2.0

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
        record_path: str | None,
        dropped_elsewhere: Callable[[], int],
        pacing_state: Callable[[], dict[str, Any] | None],
        topology: Callable[[], dict[str, Any] | None],
    ) -> None:
        self.identity = identity
        self.url = url
        self.token = token
        self.steps = steps
        self.collectives = collectives
        self.flush_interval_s = flush_interval_s
        self.send_timeout_s = send_timeout_s
        self.dropped_elsewhere = dropped_elsewhere
        self.pacing_state = pacing_state
        self.topology = topology
        self.estimator = ArrivalEstimator()
        self.ddp_baseline_s = 0.0  # read by the pacing hook on the training thread
        self.send_dropped = 0
        self.sent_records = 0
        self.sent_batches = 0
        self.errors = 0
        self._conn: http.client.HTTPConnection | None = None
        self._retry_at = 0.0
        self._backoff = 0.25
        self._record = open(record_path, "a", buffering=1) if record_path else None  # noqa: SIM115
        self._stop = threading.Event()
        self._lock = threading.Lock()  # flush() from close() and from the thread
        self._thread = threading.Thread(target=self._run, name="syncscope-reporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self.flush()
        if self._conn is not None:
            self._conn.close()
        if self._record is not None:
            self._record.close()
            self._record = None

    @property
    def dropped_total(self) -> int:
        return self.send_dropped + self.dropped_elsewhere()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            self.flush()

    def flush(self) -> None:
        try:
            with self._lock:
                self._flush()
        except BaseException as exc:  # noqa: BLE001 - the reporter must outlive anything
            self.errors += 1
            if self.errors <= 3:
                log.warning("syncscope reporter error (records dropped): %r", exc)

    def _flush(self) -> None:
        raw_steps = drain(self.steps, 4096)
        raw_colls = drain(self.collectives, 16384)
        if not raw_steps and not raw_colls and self.url is None:
            return
        colls = [
            {
                "op": op,
                "group": group,
                "bytes": float(nbytes),
                "duration_s": dur / 1e9,
                "step": step,
            }
            for op, group, nbytes, dur, step in raw_colls
        ]
        waits = self.estimator.observe(
            "self",
            [
                (collective_key(c["op"], c["group"], c["bytes"]), c["duration_s"], c["step"])
                for c in colls
            ],
        )
        wait_by_step: dict[int, float] = {}
        for c, wait in zip(colls, waits, strict=True):
            wait_by_step[c["step"]] = wait_by_step.get(c["step"], 0.0) + wait
            if c["op"] == DDP_GRAD_SYNC:
                self.ddp_baseline_s = c["duration_s"] - wait
        offset = time.time() - time.perf_counter_ns() / 1e9
        steps = []
        for step, end_ns, total, *acc in raw_steps:
            phases = dict(zip(PHASES, (v / 1e9 for v in acc), strict=False))
            phases["other"] = max(0.0, (total - sum(acc)) / 1e9)
            steps.append(
                {
                    "step": step,
                    "duration_s": total / 1e9,
                    "end_unix_s": end_ns / 1e9 + offset,
                    "phases": phases,
                }
            )
        if self._record is not None:
            for s in steps:
                line = {
                    "rank": self.identity["rank"],
                    "world_size": self.identity["world_size"],
                    "step": s["step"],
                    "step_s": s["duration_s"],
                    "phases": s["phases"],
                    "wait_s": wait_by_step.get(s["step"], 0.0),
                }
                self._record.write(json.dumps(line) + "\n")
        if self.url is not None:
            self._send(steps, colls)

    def _send(self, steps: list[dict], colls: list[dict]) -> None:
        count = len(steps) + len(colls)
        now = time.monotonic()
        if now < self._retry_at:
            self.send_dropped += count
            return
        batch = {
            "schema_version": SCHEMA_VERSION,
            "agent": self.identity,
            "dropped_total": self.dropped_total,
            "steps": steps,
            "collectives": colls,
            "pacing": self.pacing_state(),
            "topology": self.topology(),
        }
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
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._retry_at = now + self._backoff
            self._backoff = min(self.MAX_BACKOFF_S, self._backoff * 2)
            if self.errors == 0:
                log.warning(
                    "syncscope: exporter %s unreachable (%s); records are dropped and counted",
                    self.url,
                    exc,
                )
            self.errors += 1
            return
        self._backoff = 0.25
        if response.status != 200:
            self.send_dropped += count
            log.warning(
                "syncscope: exporter refused a batch: %s %s", response.status, payload[:200]
            )
            return
        self.sent_records += count
        self.sent_batches += 1
        self._apply_reply(payload)

    def _apply_reply(self, payload: bytes) -> None:
        reply = json.loads(payload)
        external = {}
        for text, value in (reply.get("baselines") or {}).items():
            key = parse_key_text(text)
            if key is not None and isinstance(value, (int, float)):
                external[key] = float(value)
        if external:
            self.estimator.merge_baselines(external)
            for key, value in external.items():
                if key[0] == DDP_GRAD_SYNC:
                    self.ddp_baseline_s = min(self.ddp_baseline_s or value, value)

    def baselines_text(self) -> dict[str, float]:
        return {key_text(k): v for k, v in self.estimator.baselines().items()}
