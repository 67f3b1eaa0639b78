"""The exporter's counters across its own restarts: the store's cumulative totals in a file.

Goodput divides counters summed since the job started by the time since then, so a counter that
restarts from zero with its exporter would read as work never done. With `--state-file PATH`
the exporter writes what it exports as counters (per rank, as RankState names them; per job:
the pooled steps and transfer) every `interval_s` and at shutdown, and loads it at start. Ranks
loaded are silent until they report again: one that reports with the
same incarnation (its process outlived the exporter's restart) carries on from its totals, a
restarted one is a new incarnation of it as usual; one that never reports expires after
expire_after_s. Each rank's throughput baseline (exporter/throughput.py) is kept too, so that an
exporter restart does not make the verdict wait hundreds of steps for a baseline again; a file
without one loads with fresh baselines.

Writes are atomic (a temporary file beside it, fsync, rename), so a crash mid-write leaves the
last good file. A file that cannot be parsed or does not hold this format is logged as an
error, renamed aside (PATH.corrupt) and the exporter starts empty; a file that cannot be read
at all (permissions, I/O) is logged and left alone, and nothing is saved over it. The exporter
never fails to start because of its state file. Off by default: two exporters given one path
would overwrite each other's counters, so the path is the deployment's choice (a hostPath or a
volume per node, e.g. /var/lib/syncscope/exporter-state.json).

Format (JSON): {"format": FORMAT, "version": VERSION, "saved_unix_s": ..., "ranks": [{field:
value, ...}], "pools": {job: [pooled steps, transfer seconds]}}, a rank's fields as RankState
names them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from syncscope.exporter.store import (
    RATIO_BUCKETS,
    RESUME_MARKS,
    STEP_BUCKETS,
    CollectiveTotals,
    RankState,
    Store,
    clean_label,
)
from syncscope.exporter.throughput import SUSTAINED_BLOCKS, UNITS, Throughput

from syncscope.catalog import BADPUT_CATEGORIES
from syncscope.wire import OPS, PHASES, PacingState

log = logging.getLogger("syncscope.exporter")

FORMAT = "syncscope-exporter-state"
VERSION = 1
CORRUPT_SUFFIX = ".corrupt"

# RankState's fields as the file keeps them, by kind.
_LABELS = ("job", "hostname", "incarnation")
_COUNTS = (
    "rank",
    "local_rank",
    "world_size",
    "pid",
    "incarnations",
    "steps_total",
    "dropped_before",
    "dropped_current",
    "pacing_engagements_before",
    "lost_steps",
    "later_steps",
)
_STEP_NUMBERS = ("high_step", "first_step", "max_step")  # -1: none
_SECONDS = (
    "started_unix_s",
    "last_report_unix_s",
    "step_seconds_sum",
    "ratio_sum",
    "median_s",
    "pacing_delay_before",
    "process_started_unix_s",
    "productive_s",
    "previous_step_s",
    "first_step_s",
    "later_steps_s",
)
_OPTIONAL_COUNTS = ("samples_total", "tokens_total")
_LISTS = {
    "phase_seconds": (float, len(PHASES)),
    "step_bucket_counts": (int, len(STEP_BUCKETS) + 1),
    "ratio_bucket_counts": (int, len(RATIO_BUCKETS) + 1),
}


class BadStateFile(ValueError):
    """A state file this exporter cannot take in."""


def rank_totals(s: RankState) -> dict[str, Any]:
    """A rank's cumulative totals as JSON (the caller holds the store's lock)."""
    out: dict[str, Any] = {
        name: getattr(s, name)
        for name in (*_LABELS, *_COUNTS, *_STEP_NUMBERS, *_SECONDS, *_OPTIONAL_COUNTS)
    }
    for name in _LISTS:
        out[name] = list(getattr(s, name))
    out["badput_s"] = dict(s.badput_s)
    out["phase_every"] = s.phase_every
    out["steps_since_unix_s"] = s.steps_since_unix_s
    out["checkpoint_pending"] = {str(k): v for k, v in s.checkpoint_pending.items()}
    out["previous_max_step"] = s.previous_max_step
    out["resume_marks"] = {str(k): v for k, v in s.resume_marks.items()}
    out["collectives"] = [
        [op, group, t.calls, t.seconds, t.bytes, t.wait_seconds]
        for (op, group), t in s.collectives.items()
    ]
    out["pacing"] = dataclasses.asdict(s.pacing) if s.pacing is not None else None
    t = s.throughput
    out["throughput"] = {
        "unit": t.unit,
        "blocks": t.blocks,
        "rates": list(t.rates),
        "best": {str(hour): rate for hour, rate in t.best.items()},
    }
    return out


def _number(value: Any, what: str, kind: type = float, least: float = 0) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadStateFile(f"{what}: not a number")
    if kind is int and not isinstance(value, int):
        raise BadStateFile(f"{what}: not an integer")
    if not math.isfinite(value) or value < least:
        raise BadStateFile(f"{what}: out of range")
    return kind(value)


def rank_from_totals(data: Any) -> RankState:
    """The inverse of `rank_totals`; raises BadStateFile for anything it would not write."""
    if not isinstance(data, Mapping):
        raise BadStateFile("a rank is not an object")
    try:
        labels = {name: data[name] for name in _LABELS}
        if not all(isinstance(v, str) for v in labels.values()):
            raise BadStateFile("a label is not text")
        s = RankState(job=clean_label(labels["job"]), rank=_number(data["rank"], "rank", int))
        s.hostname = clean_label(labels["hostname"]) if labels["hostname"] else ""
        s.incarnation = clean_label(labels["incarnation"]) if labels["incarnation"] else ""
        for name in _COUNTS:
            setattr(s, name, _number(data[name], name, int))
        for name in _STEP_NUMBERS:
            setattr(s, name, _number(data[name], name, int, least=-1))
        for name in _SECONDS:
            setattr(s, name, _number(data[name], name))
        for name in _OPTIONAL_COUNTS:
            value = data[name]
            setattr(s, name, None if value is None else _number(value, name, int))
        for name, (kind, length) in _LISTS.items():
            values = data[name]
            if not isinstance(values, list) or len(values) != length:
                raise BadStateFile(f"{name}: not {length} values")
            setattr(s, name, [_number(v, name, kind) for v in values])
        badput = data["badput_s"]
        if not isinstance(badput, Mapping):
            raise BadStateFile("badput_s is not an object")
        s.badput_s = {c: _number(badput.get(c, 0.0), c) for c in BADPUT_CATEGORIES}
        pending = data["checkpoint_pending"]
        if not isinstance(pending, Mapping):
            raise BadStateFile("checkpoint_pending is not an object")
        s.checkpoint_pending = {int(k): _number(v, "checkpoint") for k, v in pending.items()}
        # Files written before resume marks were kept: a restart's lost steps at the mean.
        s.previous_max_step = _number(
            data.get("previous_max_step", -1), "previous_max_step", int, least=-1
        )
        marks = data.get("resume_marks", {})
        if not isinstance(marks, Mapping) or len(marks) > RESUME_MARKS:
            raise BadStateFile(f"resume_marks: not an object of at most {RESUME_MARKS} steps")
        s.resume_marks = {int(k): _number(v, "resume mark") for k, v in marks.items()}
        for row in data["collectives"]:
            op, group, calls, seconds, nbytes, wait = row
            if not isinstance(op, str) or not isinstance(group, str):
                raise BadStateFile("a collective's op or group is not text")
            s.collectives[(op if op in OPS else "other", clean_label(group))] = CollectiveTotals(
                _number(calls, "calls", int),
                _number(seconds, "seconds"),
                _number(nbytes, "bytes"),
                _number(wait, "wait_seconds"),
            )
        s.pacing = _pacing(data["pacing"])
        s.throughput = _throughput(data.get("throughput"))
        # Files written before phase sampling was reported: every step timed.
        s.phase_every = _number(data.get("phase_every", 1), "phase_every", int, least=1)
        # Files written before the first step's arrival was kept: its attach, where it stepped.
        since = data.get("steps_since_unix_s", s.started_unix_s if s.steps_total else 0.0)
        s.steps_since_unix_s = _number(since, "steps_since_unix_s")
    except BadStateFile:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise BadStateFile(f"a rank's totals: {exc!r}") from None
    return s


def _throughput(data: Any) -> Throughput:
    """A rank's throughput baseline; a fresh one for files written before it was kept."""
    if data is None:
        return Throughput()
    if not isinstance(data, Mapping) or data.get("unit") not in ("", *UNITS):
        raise BadStateFile("throughput is not a throughput baseline")
    rates, best = data["rates"], data["best"]
    if (
        not isinstance(rates, list)
        or len(rates) > SUSTAINED_BLOCKS
        or not isinstance(best, Mapping)
    ):
        raise BadStateFile("throughput: rates or best are not what this exporter writes")
    t = Throughput(unit=data["unit"], blocks=_number(data["blocks"], "blocks", int))
    t.rates.extend(_number(r, "rate") for r in rates)
    t.best = {int(hour): _number(rate, "best rate") for hour, rate in best.items()}
    return t


def _pacing(data: Any) -> PacingState | None:
    if data is None:
        return None
    if not isinstance(data, Mapping) or not all(
        isinstance(data.get(flag), bool) for flag in ("enabled", "active")
    ):
        raise BadStateFile("pacing is not a pacing state")
    return PacingState(
        enabled=data["enabled"],
        active=data["active"],
        current_delay_s=_number(data["current_delay_s"], "current_delay_s"),
        threshold_s=_number(data["threshold_s"], "threshold_s"),
        engagements=_number(data["engagements"], "engagements", int),
        total_delay_s=_number(data["total_delay_s"], "total_delay_s"),
    )


def parse(data: Any) -> tuple[list[RankState], dict[str, tuple[int, float]]]:
    """A state file's JSON as ranks and per-job pooled totals; raises BadStateFile."""
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise BadStateFile("not a syncscope exporter state file")
    if data.get("version") != VERSION:
        raise BadStateFile(f"version {data.get('version')!r}, this exporter reads {VERSION}")
    ranks, pools = data.get("ranks"), data.get("pools")
    if not isinstance(ranks, list) or not isinstance(pools, Mapping):
        raise BadStateFile("no ranks or pools")
    pooled = {}
    for job, value in pools.items():
        if not isinstance(value, list) or len(value) != 2:
            raise BadStateFile("a pool is not [steps, seconds]")
        pooled[clean_label(str(job))] = (
            _number(value[0], "pooled steps", int),
            _number(value[1], "transfer seconds"),
        )
    return [rank_from_totals(r) for r in ranks], pooled


class StateFile:
    """The store's totals in `path`: `load()` once before serving, then `start()` a thread that
    saves every `interval_s`; `stop()` saves once more. Never raises."""

    def __init__(self, path: str, store: Store, interval_s: float = 5.0) -> None:
        self.path = path
        self.store = store
        self.interval_s = interval_s
        self.load_error: str | None = None  # what went wrong at start, as logged
        self.save_error: str | None = None  # the last save's failure (None once one succeeds)
        self.loaded_ranks = 0
        self.saves = 0
        self.saved_unix_s: float | None = None
        # False once the file could not be read: what is there may be good, never overwrite it.
        self.writable = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one save at a time (the thread's, the final one)

    # -- load -----------------------------------------------------------------------------------
    def load(self) -> int:
        """Take the file's totals into the store; the number of ranks taken in."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return 0  # the first run with this path
        except OSError as exc:
            self.writable = False
            self.load_error = (
                f"state file {self.path} cannot be read ({exc}); starting with empty counters "
                "and not saving over it"
            )
            log.error("syncscope: %s", self.load_error)
            return 0
        try:
            states, pooled = parse(json.loads(raw))
        except (ValueError, RecursionError) as exc:  # BadStateFile, JSON, UTF-8
            aside = self._set_aside()
            where = f"moved to {aside}" if aside else "could not be moved aside, not saving over it"
            self.load_error = (
                f"state file {self.path} is not one this exporter can read ({exc}); {where}; "
                "starting with empty counters"
            )
            log.error("syncscope: %s", self.load_error)
            return 0
        self.loaded_ranks = self.store.adopt(states, pooled)
        log.info("syncscope: %d ranks' counters loaded from %s", self.loaded_ranks, self.path)
        return self.loaded_ranks

    def _set_aside(self) -> str | None:
        aside = self.path + CORRUPT_SUFFIX
        if os.path.exists(aside):  # an earlier one is kept too
            aside = f"{aside}.{time.strftime('%Y%m%dT%H%M%S')}"
        try:
            os.replace(self.path, aside)
        except OSError:
            self.writable = False
            return None
        return aside

    # -- save -----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        store = self.store
        with store.lock:
            ranks = [rank_totals(s) for s in store.ranks.values()]
            pools = {
                job: [p.pooled_steps_total, p.transfer_seconds_total]
                for job, p in store.pools.items()
            }
        return {
            "format": FORMAT,
            "version": VERSION,
            "saved_unix_s": time.time(),
            "ranks": ranks,
            "pools": pools,
        }

    def save(self) -> bool:
        """Write the totals atomically; False (logged) where it could not."""
        if not self.writable:
            return False
        with self._lock:
            tmp = f"{self.path}.{os.getpid()}.tmp"
            try:
                data = self.snapshot()
                text = json.dumps(data, separators=(",", ":"), allow_nan=False)
                with open(tmp, "w", encoding="utf-8") as f:
                    f.write(text)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
                with contextlib.suppress(OSError):  # the rename itself, durable
                    fd = os.open(os.path.dirname(os.path.abspath(self.path)), os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            except Exception as exc:  # noqa: BLE001 - a full disk must not stop the exporter
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                message = f"state file {self.path} not saved: {exc}"
                if message != self.save_error:  # once per distinct failure, not every interval
                    log.error("syncscope: %s", message)
                self.save_error = message
                return False
            self.saves += 1
            self.saved_unix_s = data["saved_unix_s"]
            self.save_error = None
            return True

    # -- the thread -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncscope-state-file", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.save()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.save()

    def status(self) -> dict[str, Any]:
        """For /v1/state: where, what was loaded, when it was last saved, what went wrong."""
        return {
            "path": self.path,
            "loaded_ranks": self.loaded_ranks,
            "saves": self.saves,
            "saved_unix_s": self.saved_unix_s,
            "saving": self.writable,
            "load_error": self.load_error,
            "save_error": self.save_error,
        }
