"""This rank's own arrival estimate: each step's wait at its collectives, DDP's transfer baseline.

The exporter owns the lead (node-wide in its pooling, job-wide from the rules: syncscope.arrival);
a rank keeps transfer baselines of its own only for readers on the rank itself: pacing subtracts `ddp_baseline_s` or
`first_baseline_s` from each step's first wait (step_pacing.py), and the record file writes each
step's wait. Without either it would be a quarter
of a flush's CPU spent on nothing (bench/bench_agent_overhead.py), so the agent builds none.
It runs on the reporter's thread, once per flush, also while the exporter is away, and takes
the node-wide baselines the exporter replies with in place of its own: a steady straggler's peers
never see a wait-free call of their own, and a rank's own smallest duration sits well below the
typical transfer on a noisy fabric, so only the node-wide view knows the transfer time.
"""

from __future__ import annotations

import json
from collections import Counter, deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from syncscope.arrival import Key, collective_key, key_text, parse_key_text
from syncscope.wire import DDP_GRAD_SYNC

if TYPE_CHECKING:
    from syncscope.agent.recording import RecordWriter

MAX_MEMO_KEYS = 4096


class Baselines:
    """Transfer per key: the one the exporter replied with, else this rank's smallest duration
    over its last `window` calls of the key (the last arriver of a call waits for nobody)."""

    def __init__(self, window: int = 256) -> None:
        self.window = window
        self._durations: dict[Key, deque[float]] = {}
        self._external: dict[Key, float] = {}

    def observe(self, calls: Iterable[tuple[Key, float]]) -> list[float]:
        """Add (key, duration_s) calls; return each call's wait (s, >= 0) over its baseline."""
        calls = list(calls)
        for key, duration in calls:
            kept = self._durations.get(key)
            if kept is None:
                kept = self._durations[key] = deque(maxlen=self.window)
            kept.append(duration)
        return [max(0.0, duration - self.baseline(key)) for key, duration in calls]

    def baseline(self, key: Key) -> float:
        """The exporter's baseline wins over the local minimum rather than being compared with
        it: the smallest of hundreds of durations sits several noise units below the typical
        transfer, so on a noisy fabric every rank of a balanced job would read that gap as a
        lead of its own."""
        external = self._external.get(key)
        if external is not None:
            return external
        kept = self._durations.get(key)
        return min(kept) if kept else 0.0

    def merge(self, baselines: dict[Key, float]) -> None:
        """The node's baselines (the exporter sees every local rank), each replacing its key's."""
        self._external.update(baselines)

    def all(self) -> dict[Key, float]:
        return {key: self.baseline(key) for key in self._durations}


class LocalArrival:
    """Feeds the estimator from the drained collective rows; hands each flush's waits on to the
    record file when there is one (its `wait_s` column is this estimate)."""

    def __init__(self, record: RecordWriter | None = None) -> None:
        self.estimator = Baselines()
        self.record = record
        # Read by the pacing hook on the training thread: floats, each replaced whole. DDP's
        # transfer, and that of the collective most steps complete first (step_pacing.py).
        self.ddp_baseline_s = 0.0
        self.first_baseline_s = 0.0
        self._first_key: Key | None = None
        self._keys: dict[tuple[str, str, int], Key] = {}  # (op, group, bytes) -> key, memoised

    def drained(self, steps: list[tuple], collectives: list[tuple], clock_offset_ns: int) -> None:
        """The reporter's hook for each flush's rows, as queued."""
        wait_by_step = self.observe(collectives)
        if self.record is not None:
            self.record.write(steps, wait_by_step, clock_offset_ns)

    def observe(self, collectives: list[tuple]) -> dict[int, float]:
        """Feed collective rows (op, group, bytes, duration_ns, step); return each step's
        estimated wait at its collectives, in seconds."""
        keys = self._keys
        if len(keys) > MAX_MEMO_KEYS:  # bounded: keys are (op, group, size) and groups are capped
            keys.clear()
        calls = []
        sync_key = None
        first_of_step: dict[int, Key] = {}  # rows come in the order the calls completed
        for op, group, nbytes, dur, step in collectives:
            key = keys.get((op, group, nbytes))
            if key is None:
                key = keys[(op, group, nbytes)] = collective_key(op, group, float(nbytes))
            calls.append((key, dur / 1e9, step))
            if op == DDP_GRAD_SYNC:
                sync_key = key
            elif step not in first_of_step:
                first_of_step[step] = key
        waits = self.estimator.observe((key, dur) for key, dur, _step in calls)
        wait_by_step: dict[int, float] = {}
        for (_key, _dur, step), wait in zip(calls, waits, strict=True):
            wait_by_step[step] = wait_by_step.get(step, 0.0) + wait
        if sync_key is not None:
            self.ddp_baseline_s = self.estimator.baseline(sync_key)
        if first_of_step:
            ((self._first_key, _),) = Counter(first_of_step.values()).most_common(1)
        if self._first_key is not None:
            self.first_baseline_s = self.estimator.baseline(self._first_key)
        return wait_by_step

    def merge_reply(self, payload: bytes) -> None:
        """The reporter's hook for the exporter's answer: `{"baselines": {key text: seconds}}`."""
        reply = json.loads(payload)
        external = {}
        for text, value in (reply.get("baselines") or {}).items():
            key = parse_key_text(text)
            if key is not None and isinstance(value, (int, float)):
                external[key] = float(value)
        if external:
            self.estimator.merge(external)
            for key, value in external.items():
                if key[0] == DDP_GRAD_SYNC:
                    self.ddp_baseline_s = value
                if key == self._first_key:
                    self.first_baseline_s = value

    def baselines_text(self) -> dict[str, float]:
        return {key_text(k): v for k, v in self.estimator.all().items()}
