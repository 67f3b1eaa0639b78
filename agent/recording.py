"""The record file (the `record` setting): one JSON line per step, the input of `syncscope project`,
and one per event (startup, checkpoint save or load), which has an "event" key and no "step_s"."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, TextIO

from syncscope.wire import EVENT_STARTUP, PHASES, Phase

OTHER = Phase.OTHER.label
WORK_AT = len(PHASES) - 1  # a row's accumulated phases (all but `other`), then its work counts


class RecordWriter:
    """Appends each flush's step rows as JSON lines in seconds; `{rank}` in the path is replaced.

    Line-buffered, so that a rank killed mid-run leaves every flushed step readable.
    """

    def __init__(self, path: str, identity: Mapping[str, Any]) -> None:
        self.rank = identity["rank"]
        self.world_size = identity["world_size"]
        # Which incarnation of the rank a line is from: one file holds every restart's lines.
        self.incarnation = identity.get("incarnation")
        self.process_started_unix_s = identity.get("process_started_unix_s")
        self.path = path.replace("{rank}", str(self.rank))
        self._file: TextIO | None = open(self.path, "a", buffering=1)  # noqa: SIM115

    def write(
        self, steps: list[tuple], wait_by_step: Mapping[int, float], clock_offset_ns: int
    ) -> None:
        """Step rows as queued (step, end_ns, total_ns, *phase ns, samples, tokens); waits in
        seconds by step. A line has `samples` and `tokens` only where they are known."""
        if self._file is None:
            return  # a flush that outlived close(): the records still go to the exporter
        rank, world, write = self.rank, self.world_size, self._file.write
        for step, end_ns, total, *rest in steps:
            phase_ns = rest[:WORK_AT]
            phases = dict(zip(PHASES, (ns / 1e9 for ns in phase_ns), strict=False))
            phases[OTHER] = max(0, total - sum(phase_ns)) / 1e9
            line = {
                "rank": rank,
                "world_size": world,
                "step": step,
                "step_s": total / 1e9,
                "phases": phases,
                "wait_s": wait_by_step.get(step, 0.0),
                "end_unix_s": (end_ns + clock_offset_ns) / 1e9,
            }
            for key, value in zip(("samples", "tokens"), rest[WORK_AT:], strict=False):
                if value >= 0:
                    line[key] = value
            if self.incarnation is not None:
                line["incarnation"] = self.incarnation
            write(json.dumps(line) + "\n")

    def write_events(self, events: list[tuple], clock_offset_ns: int) -> None:
        """Event rows as queued (kind, step, end_ns, duration_ns): `step` is null outside every
        step; a startup line also says when the process started."""
        if self._file is None:
            return
        for kind, step, end_ns, duration in events:
            line: dict[str, Any] = {
                "rank": self.rank,
                "world_size": self.world_size,
                "event": kind,
                "step": step if step >= 0 else None,
                "duration_s": duration / 1e9,
                "end_unix_s": (end_ns + clock_offset_ns) / 1e9,
            }
            if kind == EVENT_STARTUP and self.process_started_unix_s is not None:
                line["process_started_unix_s"] = self.process_started_unix_s
            if self.incarnation is not None:
                line["incarnation"] = self.incarnation
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
