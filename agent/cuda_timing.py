"""GPU-side phase timing: CUDA events at the phase clock's boundaries, resolved off the hot path.

On CUDA the CPU phase clock measures when work was *enqueued*: the time shows up wherever the
loop next synchronises (`loss.item()`, a host copy). So on CUDA the same boundaries also record
a CUDA event on the current stream, and a background thread turns the events into phases once
`Event.query()` says the GPU has passed them. Nothing here synchronises: the training thread
only records events, the background thread only queries them and reads elapsed times.

GPU phases between events (k = this step): data (end of step k-1 -> forward pre-hook), forward (pre-hook -> post-hook), backward (torch.autograd.backward entered ->
callback A), comm_exposed (A -> callback B, after DDP made the stream wait for its all-reduces),
optimizer (pre-hook -> post-hook / step end), other (the rest). They add up to the GPU's step
time (end k-1 -> end k) and reach the reporter in the CPU clock's tuple, GPU phases in place of
CPU ones (pacing and work counts stay the CPU clock's); DDP's `ddp_grad_sync` records carry the
GPU's exposed communication. If the queue of unresolved steps is full, an event cannot be had or
queried, or the stream is capturing a CUDA graph, a step goes out with its CPU phases and the
next step starts a new chain. Phase sampling: a quiet step records one event, its end; the
resolver estimates its phases and sync record from the last timed step's shares (docs/gpu.md).

Events go on the current stream *of the model's device* (`stream_of`), not of whatever device
is current. The resolver thread puts itself in thread-local capture mode before its first query
(agent/capture_mode.py), so a user's global-mode graph capture survives it. Pacing on CUDA: the
CPU sees almost no exposed communication, so the resolver feeds the pacer each resolved GPU
step's, and the training thread sleeps the latest delay it decided (a few steps behind: the
controller adapts over many steps).
"""

from __future__ import annotations

import functools
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from syncscope.agent.capture_mode import thread_local_capture_mode
from syncscope.agent.config import AgentConfig
from syncscope.agent.phases import (
    ACC_LEN,
    BACKWARD,
    BWD_END,
    BWD_START,
    COMM,
    COMM_END,
    DATA,
    FORWARD,
    FWD_POST,
    FWD_PRE,
    OPT_POST,
    OPT_PRE,
    OPTIMIZER,
    PACING,
    ROW_PHASES,
    ROW_WORK,
    STEP_END,
    STEP_START,
    PhaseClock,
    estimate_phases,
    phase_shares,
)

# a forward after them starts with data (OPT_POST: an optimizer's step within a training step's)
_IDLE_BEFORE_FORWARD = (STEP_START, BWD_END, COMM_END, OPT_POST)
# Inside optimizer.step(closure) (PhaseClock.forward_began), the gap from one of the first to
# one of the second is the optimizer's: from the step's start or a closure's backward to the
# next closure's forward or the step's end.
_CLOSURE_AFTER, _CLOSURE_BEFORE = (OPT_PRE, BWD_END, COMM_END), (FWD_PRE, OPT_POST, STEP_END)
NO_PHASES = (0,) * ACC_LEN  # a quiet step's row until the resolver estimates them (and in C)
# A quiet step's estimate, taken at its end: the last timed step's phase shares (CPU) and its
# DDP sync's share of its total (None: it had no sync).
Estimate = tuple[list[float] | None, float | None]


def torch_event_factory(torch: Any = None, stream_of: StreamOf | None = None) -> Callable[[], Any]:
    """Timing events for the clock's marks: `torch.Event`s on the device of `stream_of`'s stream,
    whose `record` is torch's C, where two of them record, complete and time each other there
    (tried once, here); else `torch.cuda.Event`s, whose `record` is a Python method around it:
    a frame at every mark."""
    if torch is None:
        import torch
    if stream_of is not None and getattr(torch, "Event", None) is not None:
        try:
            stream = stream_of()
            if stream is not None:  # (capturing: try no event now)
                device = stream.device

                def event() -> Any:
                    return torch.Event(device=device, enable_timing=True)

                start, end = event(), event()
                start.record(stream)
                end.record(stream)
                end.synchronize()
                if end.query() and start.elapsed_time(end) >= 0:
                    return event
        except Exception:  # noqa: BLE001 - torch.cuda.Event serves
            pass
    return lambda: torch.cuda.Event(enable_timing=True)


class StreamOf:
    """The current stream of the model's device, or None while it is capturing a CUDA graph
    (an event recorded then would be a node of the graph, not a point in the stream).

    `stream_of(fresh)`: the stream is looked up (`current()`) when `fresh` (a step's first mark)
    and reused for the step's other marks: `torch.cuda.current_stream` builds a new Stream
    object at each call, the costliest part of a mark (docs/evaluation.md); whether the stream
    is capturing (`capturing()`) is still asked at every mark. The hooks in C
    (csrc/hot_path.cpp's cuda_mark) do the same on these slots, without a frame of its own."""

    __slots__ = ("capturing", "current", "last")

    def __init__(self, capturing: Callable[[], bool], current: Callable[[], Any]) -> None:
        self.capturing = capturing
        self.current = current
        self.last: Any = None

    def __call__(self, fresh: bool = True) -> Any:
        if self.capturing():
            return None
        if fresh or self.last is None:
            self.last = self.current()
        return self.last


def torch_stream_of(torch: Any, device_index: int) -> StreamOf:
    """StreamOf the model's device, `device_index` (a capture runs on the current device)."""
    return StreamOf(
        torch.cuda.is_current_stream_capturing,
        functools.partial(torch.cuda.current_stream, device_index),
    )


def gpu_phases(start: Any, marks: list[tuple[int, Any]]) -> tuple[int, list[int], list[int]]:
    """(total_ns, [data, forward, backward, optimizer, comm, pacing=0], comm intervals) from
    a step's start event and its (kind, event) marks, all of which have completed."""
    phases = [0, 0, 0, 0, 0, 0]
    comm: list[int] = []
    total = 0
    prev_kind, prev = STEP_START, start
    stepping = False  # inside optimizer.step: between its pre-hook's mark and its post-hook's
    idle = 0  # the gap before that pre-hook, after an idle mark: data if a closure follows
    for kind, event in marks:
        ns = max(0, round(prev.elapsed_time(event) * 1e6))
        total += ns
        if stepping and kind in _CLOSURE_BEFORE and prev_kind in _CLOSURE_AFTER:
            phases[OPTIMIZER] += ns  # the optimizer's own work (around its closures, if any)
            phases[DATA] += idle if kind == FWD_PRE else 0
            idle = 0
        elif kind == FWD_PRE and prev_kind in _IDLE_BEFORE_FORWARD:
            phases[DATA] += ns
        elif kind == FWD_POST and prev_kind == FWD_PRE:
            phases[FORWARD] += ns
        elif kind == BWD_END and prev_kind == BWD_START:
            phases[BACKWARD] += ns
        elif kind == COMM_END and prev_kind == BWD_END:
            phases[COMM] += ns
            comm.append(ns)
        if kind in (OPT_PRE, OPT_POST, STEP_END):
            stepping = kind == OPT_PRE
            idle = ns if stepping and prev_kind in _IDLE_BEFORE_FORWARD else 0
        prev_kind, prev = kind, event
    return total, phases, comm


class CudaPhaseClock(PhaseClock):
    """The phase clock plus CUDA events at every boundary; `start()` runs the resolver thread.

    Takes the reporter's `steps` and `collectives` queues like PhaseClock; the CPU clock's own
    output goes to private staging queues and reaches the reporter's through the resolver.
    """

    __slots__ = (
        "_due",
        "_lock",
        "_prev_end",
        "_stop",
        "_thread",
        "capture_skips",
        "chain_broken",
        "cpu_steps",
        "event_factory",
        "events_created",
        "free",
        "gpu_delay_ns",
        "gpu_shares",
        "gpu_steps",
        "marks",
        "max_events",
        "max_pending",
        "out_collectives",
        "out_steps",
        "pending",
        "poll_interval_s",
        "query_errors",
        "resolve_every",
        "stream_of",
        "thread_guard",
        "timeline",
    )

    def __init__(
        self,
        steps: deque,
        collectives: deque,
        queue_callback: Callable[[Callable[[], None]], None] | None,
        ddp_group: str | None,
        ddp_bytes: float,
        on_error: Callable[[BaseException], None],
        ddp_model: Any = None,
        *,
        event_factory: Callable[[], Any] | None = None,
        stream_of: Callable[[bool], Any] | None = None,
        thread_guard: Callable[[], object] = thread_local_capture_mode,
        timeline: Any = None,
        max_pending: int = 64,
        max_events: int = 2048,
        resolve_every: int = AgentConfig.align_every_steps,
        poll_interval_s: float = 1.0,
    ) -> None:
        super().__init__(
            deque(maxlen=steps.maxlen or 8192),
            deque(maxlen=collectives.maxlen or 32768),
            queue_callback,
            ddp_group,
            ddp_bytes,
            on_error,
            ddp_model,
        )
        self.out_steps = steps
        self.out_collectives = collectives
        self.event_factory = event_factory or torch_event_factory()
        self.stream_of = stream_of  # None: record on the current stream (tests, one device)
        self.thread_guard = thread_guard
        self.timeline = timeline  # StepTimeline (agent.nccl_trace) or None
        self.max_pending = max_pending
        self.max_events = max_events
        # The resolver wakes at every `resolve_every`-th step end, the same steps on every rank
        # (its queries and elapsed times, ~10 µs a step, would otherwise hold the GIL at each
        # rank's own phase), and after `poll_interval_s` without one (long steps,
        # none at all).
        self.resolve_every = max(1, resolve_every)
        self.poll_interval_s = poll_interval_s
        self._due = threading.Event()
        self.free: deque = deque()  # recorded-and-resolved events, reused (resolver appends)
        self.pending: deque = deque()  # (cpu tuple, marks or None, ddp records, chain break)
        self.marks: list[tuple[int, Any]] | None = []
        self.events_created = 0
        self.chain_broken = False
        self.cpu_steps = 0  # steps that went out with CPU phases
        self.gpu_steps = 0
        self.capture_skips = 0  # marks not recorded because the stream was capturing
        self.query_errors = 0
        self.gpu_delay_ns = 0  # pacing's latest decision from a GPU step (resolver writes)
        self.gpu_shares: list[float] | None = None  # the last timed GPU step's (resolver side)
        self._prev_end: Any = None  # resolver side only (under _lock)
        self._lock = threading.Lock()  # the resolver thread vs. stop() at close
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.mark = self._mark  # type: ignore[misc]  # PhaseClock's slot; at every boundary

    # -- training thread ------------------------------------------------------------------------
    def _mark(self, kind: int) -> None:
        marks = self.marks
        if marks is None or (self.quiet and kind != STEP_END):
            return
        try:
            stream = None
            if self.stream_of is not None:
                # looked up at a timed step's first mark; a quiet step reuses it
                stream = self.stream_of(not marks and not self.quiet)
                if stream is None:  # capturing: leave the graph alone, time this step on CPU
                    self.capture_skips += 1
                    self._abandon_step()
                    return
            try:
                event = self.free.pop()
            except IndexError:
                if self.events_created >= self.max_events:
                    self._abandon_step()
                    return
                event = self.event_factory()
                self.events_created += 1
            if stream is None:
                event.record()
            else:
                event.record(stream)
            marks.append((kind, event))
        except BaseException as exc:  # noqa: BLE001 - nothing may reach the training loop
            self._abandon_step()
            self.on_error(exc)

    def _abandon_step(self) -> None:
        if self.marks:
            self.free.extend(event for _, event in self.marks)
        self.marks = None

    def _pace(self, comm_ns: int, step_ns: int) -> int:
        # The CPU's comm_ns is only DDP's enqueue here: sleep what the GPU's steps decided.
        return self.gpu_delay_ns

    def _quiet_end(self, t: int, total: int) -> None:
        self.end_step(t)  # a quiet step's end, here as a timed one's: below

    def restart_step(self, t: int) -> None:
        super().restart_step(t)
        if self.marks:  # the dropped step's events, and its DDP records
            self.free.extend(event for _, event in self.marks)
        self.marks = []
        self.collectives.clear()
        self.chain_broken = True  # the GPU's time since the last step's end is no step's

    def end_step(self, t: int) -> None:
        step = self.step
        self.mark(STEP_END)  # before PhaseClock's pacing sleep: that belongs to the next step
        if self.timeline is not None:
            self.timeline.mark(step)
        marks = self.marks
        estimate: Estimate | None = None
        if self.quiet:
            # Its phases and DDP sync are the resolver's to estimate, from the GPU's shares;
            # here only its total and work (the less a quiet step touches, the less it costs).
            cpu: tuple | None = (step, t, t - self.step_start, *NO_PHASES, *self.work.take())
            ddp: list = []
            estimate = (self.shares, self.sync_share)
            self._next_step(t)
        else:
            super().end_step(t)
            cpu = self.steps.pop() if self.steps else None
            ddp = list(self.collectives)
            self.collectives.clear()
        self.marks = []
        if cpu is None:
            return
        timed = bool(marks) and marks[-1][0] == STEP_END  # type: ignore[index]
        if len(self.pending) >= self.max_pending:
            # The resolver is behind (or gone): report CPU phases now rather than nothing.
            if marks:
                self.free.extend(event for _, event in marks)
            self.chain_broken = True
            self._emit_cpu(cpu, ddp, estimate)
            return
        self.pending.append((cpu, marks if timed else None, ddp, self.chain_broken, estimate))
        self.chain_broken = False
        if self.step % self.resolve_every == 0:
            self._due.set()

    # -- resolver thread ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="syncscope-cuda-events", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 0.5) -> None:
        """Resolve what the GPU finishes within `timeout`; the rest goes out with CPU phases."""
        self._stop.set()
        self._due.set()
        if self._thread is not None:
            self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        while self.pending and time.monotonic() < deadline:
            if not self.resolve():
                time.sleep(0.01)
        with self._lock:
            while self.pending:
                cpu, _marks, ddp, _, estimate = self.pending.popleft()
                self._emit_cpu(cpu, ddp, estimate)

    def _run(self) -> None:
        while True:
            self._due.wait(self.poll_interval_s)
            if self._stop.is_set():
                return
            self._due.clear()
            self.resolve()

    def resolve(self) -> int:
        """Turn every leading pending step whose events have completed into a report."""
        done = 0
        try:
            self.thread_guard()  # before this thread's first query: see agent/capture_mode.py
            with self._lock:
                done = self._resolve_locked()
        except BaseException as exc:  # noqa: BLE001 - a CUDA error must not kill the thread
            self.on_error(exc)
        return done

    def _resolve_locked(self) -> int:
        done = 0
        while self.pending:
            cpu, marks, ddp, chain_break, estimate = self.pending[0]
            try:
                if marks and not all(event.query() for _, event in marks):
                    break  # in stream order: nothing after this step has completed either
            except Exception as exc:  # noqa: BLE001 - this step's events are unusable
                # Out of the queue with CPU phases, its events dropped (their state is unknown),
                # and the chain restarts: the steps behind it still resolve.
                self.pending.popleft()
                self.query_errors += 1
                self._prev_end = None
                self._emit_cpu(cpu, ddp, estimate)
                done += 1
                self.on_error(exc)
                continue
            self.pending.popleft()
            done += 1
            start = self._prev_end
            if chain_break or not marks:
                if start is not None:
                    self.free.append(start)
                start = self._prev_end = None
            if not marks:
                self._emit_cpu(cpu, ddp, estimate)
                continue
            if start is None:  # the first step of a chain has no start event
                if estimate is None and self.phase_every > 1:  # the shares quiet steps carry
                    self.gpu_shares = phase_shares(list(cpu[ROW_PHASES:ROW_WORK]), cpu[2])
                self._emit_cpu(cpu, ddp, estimate)
            else:
                self._emit_gpu(cpu, ddp, start, marks, estimate)
                self.free.append(start)
            self.free.extend(event for _, event in marks[:-1])
            self._prev_end = marks[-1][1]
        return done

    def _emit_gpu(
        self, cpu: tuple, ddp: list, start: Any, marks: list, estimate: Estimate | None
    ) -> None:
        total, phases, comm = gpu_phases(start, marks)
        if estimate is not None:  # phase sampling: one event, the step's end
            phases = estimate_phases(self.gpu_shares or estimate[0], total)
            if estimate[1] is not None:  # on CUDA the exposed phase is DDP's sync alone
                comm = [phases[COMM]]
                ddp = [self._sync_record(cpu[0])]
        elif self.phase_every > 1:
            self.gpu_shares = phase_shares(phases, total)
        step, end_ns = cpu[0], cpu[1]
        # The CPU's pacing sleep; on the GPU it looks like data wait.
        pacing = min(cpu[ROW_PHASES + PACING], total)
        phases[DATA] = max(0, phases[DATA] - pacing)
        phases[PACING] = pacing
        self.gpu_steps += 1
        pacer = self.pacer
        if pacer is not None:
            self.gpu_delay_ns = pacer(phases[COMM], total)
        gpu_ddp = []
        for i, record in enumerate(ddp):
            if i < len(comm):
                op, group, nbytes, _cpu_ns, rec_step = record
                record = (op, group, nbytes, comm[i], rec_step)
            gpu_ddp.append(record)
        self._emit((step, end_ns, total, *phases, *cpu[ROW_WORK:]), gpu_ddp)

    def _emit_cpu(self, cpu: tuple, ddp: list, estimate: Estimate | None = None) -> None:
        """A step that goes out with its CPU phases (no usable events); a quiet one with the
        CPU clock's estimate, its timed step's shares of its total."""
        if estimate is not None:
            shares, sync_share = estimate
            total = cpu[2]
            cpu = (*cpu[:ROW_PHASES], *estimate_phases(shares, total), *cpu[ROW_WORK:])
            if sync_share is not None:
                ddp = [self._sync_record(cpu[0], int(sync_share * total))]
        self._emit(cpu, ddp)
        self.cpu_steps += 1

    def _emit(self, step_tuple: tuple, ddp: list) -> None:
        # Tail drop, as PhaseClock does: a full queue refuses the new record and counts it.
        out = self.out_steps
        if out.maxlen is None or len(out) < out.maxlen:
            out.append(step_tuple)
        else:
            self.dropped += 1
        coll = self.out_collectives
        for record in ddp:
            if coll.maxlen is None or len(coll) < coll.maxlen:
                coll.append(record)
            else:
                self.dropped += 1
