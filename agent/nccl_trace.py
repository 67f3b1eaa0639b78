"""NCCL collective durations from PyTorch's Flight Recorder, read off the training thread.

ProcessGroupNCCL has no completion hook (Flight Recorder replaces it), and NCCL calls return to
Python before the GPU has run them, so a CPU timer around them measures only the enqueue. With
TORCH_NCCL_ENABLE_TIMING=1 every Flight Recorder entry gets `duration_ms` from CUDA events
around the NCCL kernel: this rank's wait for the last peer plus the transfer, the very quantity
the arrival estimator (syncscope.arrival) splits. This module turns entries into the records the
gloo path produces, (op, group, bytes, duration_ns, step), and appends them to the same queue.

Costs and bounds: the dump (`torch._C._distributed_c10d._dump_nccl_trace`) builds a pickle
holding the GIL, tens of ms for a full buffer, so it is taken
  * never with stack traces (they cost orders of magnitude more);
  * at steps every rank agrees on: one rank's stall delays every rank, so N ranks dumping at the
    same step cost the job one stall, not N. The reader's thread dumps right after step k ends,
    for k + 1 a multiple of `StepTimeline.dump_every`, a power of two chosen so that dumping
    takes at most `budget` of wall time within [min_interval_s, max_interval_s]; where two ranks
    pick different powers, the larger's multiples are the smaller's, so those dumps coincide
    (bench/bench_dump_alignment.py);
  * in thread-local CUDA capture mode, so that a user's graph capture survives (capture_mode.py);
  * at most `max_records_per_poll` records per dump; entries de-duplicated by `record_id`
    (monotonic per process; a Flight Recorder reset, detected by the id going backwards or by a
    known id with another creation time, starts it again at 0).
An entry is done once it has a duration or the watchdog retired it without one; entries that
fall out of the ring buffer between dumps are not seen (the estimator takes any sample).
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import pickle
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from syncscope.agent.capture_mode import thread_local_capture_mode
from syncscope.agent.collectives import MAX_GROUP_LABELS, group_label

log = logging.getLogger("syncscope.agent")

ENABLE_TIMING_ENV = "TORCH_NCCL_ENABLE_TIMING"
BUFFER_SIZE_ENV = "TORCH_FR_BUFFER_SIZE"
LEGACY_BUFFER_SIZE_ENV = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # the name before torch 2.6
# torch >= 2.6 keeps 2000 entries by default; before 2.6 the default is 0: nothing is recorded.
DEFAULT_BUFFER_SIZE = "2000"

# profiling_name after "nccl:" -> the op label the gloo path uses (syncscope.wire.OPS).
_OPS = {
    "all_reduce": "all_reduce",
    "allreduce_coalesced": "all_reduce",
    "all_reduce_barrier": "barrier",
    "barrier": "barrier",
    "all_gather": "all_gather",
    "_allgather_base": "all_gather",
    "_all_gather_base": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather",
    "ALLGATHER_coalesced": "all_gather",
    "all_gather_single": "all_gather",
    "all_gather_v": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "REDUCE_SCATTER_coalesced": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_v": "reduce_scatter",
    "broadcast": "broadcast",
    "_broadcast_oop": "broadcast",
    "all_to_all": "all_to_all",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "all_to_all_single": "all_to_all",
    "all_to_all_v_single": "all_to_all",
}
# Sized by what a rank ends up with (as collectives.py sizes the gloo path): the gathered
# output for all_gather, the input everywhere else.
_SIZE_FROM_OUTPUT = {"all_gather"}
# c10::toString(ScalarType) -> bytes per element
_DTYPE_BYTES = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "ComplexHalf": 4,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "UInt16": 2,
    "UInt32": 4,
    "UInt64": 8,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
    "Float8_e4m3fnuz": 1,
    "Float8_e5m2fnuz": 1,
    "Float8_e8m0fnu": 1,
    "QInt8": 1,
    "QUInt8": 1,
    "QInt32": 4,
}


def prepare_environment(env: Any = os.environ) -> bool:
    """Ask ProcessGroupNCCL to time collectives, and Flight Recorder to keep entries (its buffer
    is 0 by default before torch 2.6); read when a group is created, so set for groups to come.

    Returns True if this call turned timing on. Costs one more CUDA event per collective on
    NCCL's own path (one `Event.record`, a few µs). A user's own setting is respected.
    """
    if not (env.get(BUFFER_SIZE_ENV, "").strip() or env.get(LEGACY_BUFFER_SIZE_ENV, "").strip()):
        env[BUFFER_SIZE_ENV] = env[LEGACY_BUFFER_SIZE_ENV] = DEFAULT_BUFFER_SIZE
    if env.get(ENABLE_TIMING_ENV, "").strip() == "":
        env[ENABLE_TIMING_ENV] = "1"
        return True
    return False


def enable_timing_on_existing_groups(torch: Any) -> bool:
    """`ProcessGroup._enable_collectives_timing()` on every group that exists (attach() after
    init_process_group, the usual order). True if the default group's timing is on now."""
    dist = torch.distributed
    try:
        c10d = dist.distributed_c10d
        default = c10d._get_default_group()
        groups = [
            default,
            *(g for g in list(getattr(c10d._world, "pg_map", {})) if g is not default),
        ]
    except Exception:  # noqa: BLE001
        return False
    ok = False
    for i, group in enumerate(groups):
        try:
            group._enable_collectives_timing()
            ok = ok or i == 0
        except Exception:  # noqa: BLE001 - a backend without timing (gloo), or an old torch
            continue
    return ok


def nccl_group_exists(torch: Any) -> bool:
    """True once the default process group exists and is NCCL."""
    try:
        dist = torch.distributed
        return bool(
            dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend())
        )
    except Exception:  # noqa: BLE001
        return False


def flight_recorder_available(torch: Any) -> bool:
    """True on builds with ProcessGroupNCCL's Flight Recorder (not on CPU-only wheels)."""
    try:
        return hasattr(torch._C._distributed_c10d, "_dump_nccl_trace")
    except Exception:  # noqa: BLE001
        return False


def timing_requested(env: Any = os.environ) -> bool:
    """True if the environment already makes ProcessGroupNCCL time its collectives."""
    for name in (ENABLE_TIMING_ENV, "TORCH_NCCL_DESYNC_DEBUG"):
        if env.get(name, "").strip().lower() in ("1", "true", "yes", "on"):
            return True
    # DETAIL wraps every group in a ProcessGroupWrapper and turns collective timing on too
    return env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL"


class StepTimeline:
    """Wall-clock step ends, so a Flight Recorder entry (stamped CLOCK_REALTIME at creation)
    can be placed in the step it belongs to, and the agreed steps at which the reader dumps.
    `mark` is one append and one modulo: cheap enough for the training thread's step end;
    `step_at` and `step_seconds` run on the reader's thread, which also sets `dump_every`. The
    hooks in C (csrc/hot_path.cpp) mark a CUDA clock's quiet steps on these slots themselves."""

    __slots__ = ("due", "dump_every", "ends")

    def __init__(self, maxlen: int = 4096, dump_every: int = 16) -> None:
        self.ends: deque[tuple[int, int]] = deque(maxlen=maxlen)  # (end_wall_ns, step)
        self.dump_every = dump_every  # a power of two; replaced whole by the reader's thread
        self.due = threading.Event()  # set at the end of step k when k + 1 % dump_every == 0

    def mark(self, step: int, wall_ns: int | None = None) -> None:
        self.ends.append((time.time_ns() if wall_ns is None else wall_ns, step))
        if (step + 1) % self.dump_every == 0:
            self.due.set()

    def step_seconds(self, last: int = 64) -> float:
        """Mean wall time per step over the last `last` steps marked; 0.0 before two."""
        ends = list(self.ends)[-last:]
        if len(ends) < 2 or ends[-1][1] <= ends[0][1]:
            return 0.0
        return (ends[-1][0] - ends[0][0]) / 1e9 / (ends[-1][1] - ends[0][1])

    def step_at(self, wall_ns: int, current: int) -> int:
        """The step in progress at wall_ns: the first step that ended after it, else `current`."""
        ends = list(self.ends)  # one C-level copy under the GIL: the appender cannot interleave
        i = bisect.bisect_left(ends, (wall_ns, -1))
        if i < len(ends):
            return ends[i][1]
        return max(current, ends[-1][1] + 1) if ends else current


class GroupLabels:
    """(pg_name, pg_desc) -> label, as agent.collectives.GroupLabels labels the gloo path;
    at most MAX_GROUP_LABELS distinct."""

    def __init__(self) -> None:
        self._labels: dict[tuple[str, str], str] = {}

    def group_count(self) -> int:
        """Distinct process groups in the dumps (their ranks are not read: two groups on the
        same ranks count twice, which only errs towards caution)."""
        return len(self._labels)

    def __call__(self, pg: Any) -> str:
        if isinstance(pg, (list, tuple)) and len(pg) == 2:
            key = (str(pg[0]), str(pg[1]))
        else:
            key = (str(pg), "")
        label = self._labels.get(key)
        if label is None:
            if len(self._labels) >= MAX_GROUP_LABELS:
                return "other"
            label = self._labels[key] = group_label(*key)
        return label


def op_label(profiling_name: str) -> str | None:
    """'nccl:all_reduce' -> 'all_reduce'; point-to-point (send/recv) -> None; unknown -> 'other'."""
    name = profiling_name.split(":", 1)[-1].strip()
    base = name.split(" ", 1)[0]  # "send 0->1"
    if base in ("send", "recv") or base.startswith(("send", "recv")):
        return None
    return _OPS.get(base, "other")


def entry_bytes(entry: dict[str, Any], op: str) -> float:
    sizes_key, dtypes_key = (
        ("output_sizes", "output_dtypes")
        if op in _SIZE_FROM_OUTPUT
        else ("input_sizes", "input_dtypes")
    )
    sizes = entry.get(sizes_key) or []
    dtypes = entry.get(dtypes_key) or []
    total = 0
    for i, shape in enumerate(sizes):
        numel = 1
        for dim in shape or ():
            numel *= int(dim)
        dtype = dtypes[i] if i < len(dtypes) else (dtypes[0] if dtypes else "Float")
        total += numel * _DTYPE_BYTES.get(str(dtype), 4)
    return float(total)


def dump_every_steps(
    cost_s: float, step_s: float, budget: float, min_interval_s: float, max_interval_s: float
) -> int:
    """The power of two k such that dumping every k steps holds the GIL for at most `budget` of
    wall time, k steps lasting between min_interval_s and max_interval_s where they can."""
    if step_s <= 0.0:
        return 1
    want_s = min(max_interval_s, max(min_interval_s, cost_s / budget))
    k = max(1.0, want_s / step_s)
    return 1 << max(0, math.ceil(math.log2(k) - 1e-9))


class FlightRecorderReader:
    """Reads Flight Recorder at agreed steps and appends (op, group, bytes, duration_ns, step)
    to `sink`.

    `dump` returns the pickle `_dump_nccl_trace(includeCollectives=True,
    includeStackTraces=False, onlyActive=False)` returns (injected for tests); `timeline` is the
    phase clock's StepTimeline: its step ends place entries in steps, and its `due` event wakes
    the thread at the agreed steps; `current_step` is the training step now.
    """

    PROBE_DUMPS = 3  # dumps with completed entries but no duration (or none) before falling back

    def __init__(
        self,
        sink: deque,
        *,
        dump: Callable[[], bytes] | None = None,
        timeline: StepTimeline | None = None,
        current_step: Callable[[], int] = lambda: 0,
        min_interval_s: float = 5.0,
        max_interval_s: float = 120.0,
        budget: float = 0.001,
        max_records_per_poll: int = 4096,
        attached_after_group: bool = False,
        ready: Callable[[], bool] | None = None,
        thread_guard: Callable[[], object] = thread_local_capture_mode,
    ) -> None:
        self.sink = sink
        self.dump = dump or _torch_dump
        # Before the NCCL group exists there is nothing to read (attach() may run first):
        # skip quietly rather than count failures towards turning the reader off.
        self.ready = ready or (_nccl_group_now if dump is None else (lambda: True))
        self.timeline = timeline or StepTimeline()
        self.current_step = current_step
        self.min_interval_s = min_interval_s
        self.max_interval_s = max_interval_s
        self.budget = budget
        self.max_records_per_poll = max_records_per_poll
        self.attached_after_group = attached_after_group
        self.thread_guard = thread_guard
        self.labels = GroupLabels()
        self.active = True
        self.fallback_reason: str | None = None
        # de-duplication: every id below `floor` is done; `done` holds the ids at or above it
        self.floor = 0
        self.newest = -1
        self.anchor: tuple[int, Any] | None = None  # (record_id, time_created_ns) of the newest
        self.done: set[int] = set()
        self.stats = {
            "dumps": 0,
            "dump_seconds_total": 0.0,
            "last_dump_seconds": 0.0,
            "entries_seen": 0,
            "records": 0,
            "no_duration": 0,
            "p2p_skipped": 0,
            "dropped": 0,
            "resets": 0,
            "errors": 0,
        }
        self.dump_steps: deque[int] = deque(maxlen=64)  # the steps the last dumps came after
        self._probes_without_duration = 0
        self._empty_dumps = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- the loop -------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncscope-nccl-trace", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0, final: bool = False) -> None:
        """Stop the dump thread. With `final` (the agent's close), read Flight Recorder once
        more: what completed since the last dump, up to one period (5 s to 120 s) at a job's
        end, would otherwise never be reported. Not while the thread is still in a dump."""
        self._stop.set()
        self.timeline.due.set()  # wake the thread
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if final and (thread is None or not thread.is_alive()):
            self.poll()

    def _run(self) -> None:
        self.thread_guard()  # before the first dump: see agent/capture_mode.py
        due = self.timeline.due
        while self.active:
            due.wait()
            due.clear()
            if self._stop.is_set():
                return
            self.dump_steps.append(self.current_step())
            self.poll()
            self.reschedule()

    def reschedule(self) -> None:
        """Pick the next power-of-two period from this dump's cost and the job's step time."""
        step_s = self.timeline.step_seconds()
        if step_s > 0.0:
            self.timeline.dump_every = dump_every_steps(
                self.stats["last_dump_seconds"],
                step_s,
                self.budget,
                self.min_interval_s,
                self.max_interval_s,
            )

    def poll(self) -> int:
        """One dump: parse, de-duplicate, append. Returns records appended; never raises."""
        if not self.active or not self.ready():
            return 0
        try:
            t0 = time.perf_counter()
            raw = self.dump()
            trace = pickle.loads(raw) if isinstance(raw, (bytes, bytearray)) else raw
            entries = (trace.get("entries") or []) if isinstance(trace, dict) else []
            added = self.ingest(entries)
            cost = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never hurt training
            self.stats["errors"] += 1
            if self.stats["errors"] >= 3:
                self._fall_back(f"Flight Recorder dump failed repeatedly ({exc!r})")
            return 0
        s = self.stats
        s["dumps"] += 1
        s["last_dump_seconds"] = cost
        s["dump_seconds_total"] += cost
        self._empty_dumps = 0 if entries else self._empty_dumps + 1
        if self._empty_dumps >= self.PROBE_DUMPS:
            self._fall_back(
                "Flight Recorder records no entries: its buffer is 0 (the default before torch "
                f"2.6). Set {BUFFER_SIZE_ENV}={DEFAULT_BUFFER_SIZE} (before torch 2.6: "
                f"{LEGACY_BUFFER_SIZE_ENV}) before init_process_group, or call syncscope's "
                "attach() before it. Falling back to DDP's exposed communication from CUDA "
                "events; per-collective NCCL timing is disabled for this run."
            )
        return added

    # -- parsing ---------------------------------------------------------------------------------
    def _reset_seen(self, entries: list[dict[str, Any]], newest: int) -> bool:
        if newest < self.newest:
            return True  # ids went backwards: Flight Recorder was reset (reset_all)
        if self.anchor is None:
            return False
        rid, created = self.anchor
        for e in entries:  # reset and refilled past the old newest: the same id, another entry
            if e["record_id"] == rid:
                return e.get("time_created_ns") != created
        return False

    def ingest(self, entries: Iterable[dict[str, Any]]) -> int:
        """Fold one dump's entries in; returns how many records were appended to the sink."""
        entries = sorted(
            (e for e in entries if isinstance(e, dict) and isinstance(e.get("record_id"), int)),
            key=lambda e: e["record_id"],
        )
        if not entries:
            return 0
        newest = entries[-1]["record_id"]
        if self._reset_seen(entries, newest):
            self.stats["resets"] += 1
            self.floor, self.done = 0, set()
        self.newest = newest
        self.anchor = (newest, entries[-1].get("time_created_ns"))
        self.floor = max(self.floor, entries[0]["record_id"])  # older ids left the ring buffer
        self.stats["entries_seen"] += len(entries)
        members = _coalesced_members(entries)

        current = self.current_step()
        fresh: list[tuple[str, str, float, int, int]] = []
        lowest_pending: int | None = None
        completed_without_duration = completed_with_duration = 0
        for e in entries:
            rid = e["record_id"]
            if rid < self.floor or rid in self.done:
                continue
            if id(e) in members.covered:  # an op inside a coalesced group: its entry reports
                self.done.add(rid)
                continue
            duration_ms = e.get("duration_ms")
            timed = isinstance(duration_ms, (int, float)) and duration_ms >= 0
            if e.get("state") != "completed" or (not timed and e.get("retired") is False):
                # not finished, or finished but not retired yet: the duration comes later
                if lowest_pending is None:
                    lowest_pending = rid
                continue
            self.done.add(rid)
            if e.get("is_p2p"):
                self.stats["p2p_skipped"] += 1
                continue
            op, nbytes = members.sized.get(id(e), (None, None))
            if op is None:
                op = op_label(str(e.get("profiling_name", "")))
            if op is None:
                self.stats["p2p_skipped"] += 1
                continue
            if not timed:
                self.stats["no_duration"] += 1
                completed_without_duration += 1
                continue
            completed_with_duration += 1
            created = e.get("time_created_ns")
            step = (
                self.timeline.step_at(int(created), current)
                if isinstance(created, int)
                else current
            )
            fresh.append(
                (
                    op,
                    self.labels(e.get("process_group")),
                    entry_bytes(e, op) if nbytes is None else nbytes,
                    round(duration_ms * 1e6),  # type: ignore[operator]
                    step,
                )
            )
        self.floor = lowest_pending if lowest_pending is not None else newest + 1
        self.done = {rid for rid in self.done if rid >= self.floor}

        if completed_without_duration and not completed_with_duration:
            self._probes_without_duration += 1
            if self._probes_without_duration >= self.PROBE_DUMPS:
                # attach() has already warned where it could tell; say it once, not twice
                self._fall_back(self._no_timing_message(), warn=not self.attached_after_group)
        elif completed_with_duration:
            self._probes_without_duration = 0

        if len(fresh) > self.max_records_per_poll:
            self.stats["dropped"] += len(fresh) - self.max_records_per_poll
            fresh = fresh[-self.max_records_per_poll :]
        sink = self.sink
        if sink.maxlen is not None:
            # Tail drop, as the phase clock does: a full queue refuses new records, counted.
            room = max(0, sink.maxlen - len(sink))
            self.stats["dropped"] += max(0, len(fresh) - room)
            fresh = fresh[:room]
        sink.extend(fresh)
        self.stats["records"] += len(fresh)
        return len(fresh)

    def _no_timing_message(self) -> str:
        when = (
            "attach() ran after the NCCL process group was created, and "
            if self.attached_after_group
            else ""
        )
        return (
            f"{when}Flight Recorder entries carry no duration: NCCL collective timing is off. "
            f"Set {ENABLE_TIMING_ENV}=1 before init_process_group (or call syncscope's attach() "
            "before it). Falling back to DDP's exposed communication from CUDA events; "
            "per-collective NCCL timing is disabled for this run."
        )

    def _fall_back(self, reason: str, warn: bool = True) -> None:
        if self.active:
            self.active = False
            self.fallback_reason = reason
            (log.warning if warn else log.info)("syncscope: %s", reason)


class _Coalesced:
    __slots__ = ("covered", "sized")

    def __init__(self) -> None:
        self.covered: set[int] = set()  # id() of member entries, reported by their group's
        self.sized: dict[int, tuple[str, float]] = {}  # id() of a group entry -> (op, bytes)


def _coalesced_members(entries: list[dict[str, Any]]) -> _Coalesced:
    """Torch versions that record a coalesced group as one untyped `nccl:coalesced` entry (no
    sizes; it holds the CUDA events and the duration) also record each op inside the group,
    typed and sized but without events, under the same collective_seq_id. The group's entry is
    given their op and summed bytes, and the members are not reported on their own. (torch 2.11
    records `nccl:allreduce_coalesced` etc. with sizes instead: nothing to do there.)"""
    found = _Coalesced()
    groups = [
        e
        for e in entries
        if str(e.get("profiling_name", "")).split(":", 1)[-1] == "coalesced" and not e.get("is_p2p")
    ]
    for group in groups:
        key = (_pg_key(group), group.get("collective_seq_id"))
        members = [
            e
            for e in entries
            if e is not group
            and not e.get("is_p2p")
            and (_pg_key(e), e.get("collective_seq_id")) == key
            and e["record_id"] < group["record_id"]
        ]
        ops = {op_label(str(e.get("profiling_name", ""))) for e in members}
        ops.discard(None)
        if not members or len(ops) != 1:
            continue
        op = ops.pop()
        assert op is not None
        found.sized[id(group)] = (op, sum(entry_bytes(e, op) for e in members))
        found.covered.update(id(e) for e in members)
    return found


def _pg_key(entry: dict[str, Any]) -> str:
    return str(entry.get("process_group"))


def _nccl_group_now() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and nccl_group_exists(torch)


def _torch_dump() -> bytes:
    import torch

    dump = torch._C._distributed_c10d._dump_nccl_trace  # type: ignore[attr-defined]
    return dump(includeCollectives=True, includeStackTraces=False, onlyActive=False)


def check_timing_at_attach(torch: Any, env: Any = os.environ) -> tuple[bool, bool]:
    """(attached_after_group, timing_on) at attach(): turns timing on if it still can, and
    warns once, clearly, if the NCCL group already exists and timing cannot be had."""
    if not nccl_group_exists(torch):
        prepare_environment(env)
        return False, True
    if timing_requested(env):
        return True, True
    if enable_timing_on_existing_groups(torch):
        prepare_environment(env)  # and for the groups created from now on
        log.info("syncscope: NCCL collective timing turned on for the existing process groups")
        return True, True
    log.warning(
        "syncscope: attach() ran after the NCCL process group was created without %s=1, so "
        "NCCL collectives are not timed. Set %s=1 before init_process_group (or call attach() "
        "first). Falling back to DDP's exposed communication from CUDA events; the Flight "
        "Recorder reader checks a few dumps and turns itself off if they carry no durations.",
        ENABLE_TIMING_ENV,
        ENABLE_TIMING_ENV,
    )  # the one warning: the reader stays quiet when its dumps confirm it
    return True, False
