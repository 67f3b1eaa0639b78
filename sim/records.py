"""Measured runs in and out: the agent's JSON-lines records, the exporter's state, Prometheus.

Everything is reduced to :class:`MeasuredRun`: per rank, per step, the step time, the seconds in
each phase (``syncscope.wire.PHASES``) and, when recorded, the wait for the last peer. One small
function per source, so a change of format touches one place.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from syncscope.wire import PHASES

FORMATS = ("auto", "jsonl", "state", "prometheus")


@dataclass
class RankSeries:
    """One rank's steps, in step order."""

    rank: int
    steps: np.ndarray  # step numbers
    step_s: np.ndarray
    phases: np.ndarray  # (steps, len(PHASES)) seconds
    wait_s: np.ndarray | None = None

    def phase(self, name: str) -> np.ndarray:
        return self.phases[:, PHASES.index(name)]

    @property
    def compute_s(self) -> np.ndarray:
        """The rank's own work: the step minus waiting/transfer and pacing.

        "other" (unaccounted time) stays in: it delayed this rank's arrival all the same.
        """
        return self.step_s - self.phase("comm_exposed") - self.phase("pacing")


@dataclass
class MeasuredRun:
    """A job as measured: its world size and the series of the ranks that reported."""

    world_size: int
    ranks: list[RankSeries]
    source: str = ""
    skipped_records: int = 0
    notes: list[str] = field(default_factory=list)

    def aligned(self) -> tuple[np.ndarray, list[RankSeries]]:
        """Steps every rank reported, and the series cut down to exactly those steps."""
        common = self.ranks[0].steps
        for r in self.ranks[1:]:
            common = np.intersect1d(common, r.steps)
        cut = []
        for r in self.ranks:
            keep = np.isin(r.steps, common)
            cut.append(
                RankSeries(
                    r.rank,
                    r.steps[keep],
                    r.step_s[keep],
                    r.phases[keep],
                    None if r.wait_s is None else r.wait_s[keep],
                )
            )
        return common, cut


def _finite(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return None
    return v if math.isfinite(v) and v >= 0 else None


def _build_run(
    rows: Iterable[dict[str, Any]], world_size: int | None, source: str, skipped: int = 0
) -> MeasuredRun:
    """Group step dicts ({rank, step, step_s, phases, wait_s}) into per-rank series."""
    by_rank: dict[int, list[tuple[int, float, list[float], float | None]]] = {}
    sizes: set[int] = set()
    for row in rows:
        if isinstance(row, dict) and "event" in row:
            continue  # the record file's event lines (startup, checkpoints) are no steps
        try:
            rank = int(row["rank"])
            step = int(row.get("step", -1))
            step_s = _finite(row.get("step_s", row.get("duration_s")))
            raw_phases = row.get("phases") or {}
            phases = [_finite(raw_phases.get(name, 0.0)) for name in PHASES]
        except (KeyError, TypeError, ValueError, AttributeError):
            skipped += 1
            continue
        if step_s is None or any(p is None for p in phases):
            skipped += 1
            continue
        wait = row.get("wait_s", row.get("waits"))
        wait_s = _finite(wait) if wait is not None else None
        if "world_size" in row:
            sizes.add(int(row["world_size"]))
        by_rank.setdefault(rank, []).append((step, step_s, phases, wait_s))  # type: ignore[arg-type]
    if not by_rank:
        raise ValueError(f"{source}: no usable step records")
    series = []
    for rank in sorted(by_rank):
        entries = by_rank[rank]
        if all(e[0] < 0 for e in entries):  # no step numbers: keep the order given
            entries = [(i, *e[1:]) for i, e in enumerate(entries)]
        entries.sort(key=lambda e: e[0])
        waits = [e[3] for e in entries]
        series.append(
            RankSeries(
                rank=rank,
                steps=np.array([e[0] for e in entries]),
                step_s=np.array([e[1] for e in entries]),
                phases=np.array([e[2] for e in entries], dtype=float),
                wait_s=None if any(w is None for w in waits) else np.array(waits, dtype=float),
            )
        )
    if world_size is None:
        world_size = max(sizes) if sizes else len(series)
    notes = []
    if len(sizes) > 1:
        notes.append(f"records carry several world sizes {sorted(sizes)}; using {world_size}")
    return MeasuredRun(world_size, series, source, skipped, notes)


def load_jsonl(path: str | Path) -> MeasuredRun:
    """The agent's ``record=`` file: one JSON object per line (malformed lines are counted)."""
    bad = 0

    def rows() -> Iterator[dict[str, Any]]:
        nonlocal bad
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError:
                    bad += 1
                    continue
                if isinstance(obj, dict):
                    yield obj
                else:
                    bad += 1

    run = _build_run(rows(), None, str(path))
    run.skipped_records += bad
    return run


def from_exporter_state(
    state: dict[str, Any], source: str = "exporter state", job: str | None = None
) -> MeasuredRun:
    """The exporter's ``GET /v1/state?recent=N``: ``{"jobs": {name: {"ranks": [...]}}}``.

    Each rank has ``rank``, ``world_size`` and ``recent_steps`` (``{step, step_s, phases,
    wait_s}``). With several jobs, ``job`` picks one (default: the only one, else an error).
    """
    jobs = state.get("jobs", {})
    if job is None:
        if len(jobs) > 1:
            raise ValueError(f"{source}: several jobs ({', '.join(sorted(jobs))}); pick one")
        job = next(iter(jobs), None)
    ranks = jobs.get(job, {}).get("ranks", []) if job is not None else []
    rows = []
    sizes = []
    for entry in ranks:
        sizes.append(int(entry["world_size"]))
        for step in entry.get("recent_steps", []):
            rows.append({"rank": entry["rank"], **step})
    if not rows and ranks:
        raise ValueError(f"{source}: no steps in the state; fetch it with ?recent=300")
    return _build_run(rows, max(sizes) if sizes else None, source)


def from_prometheus(result: dict[str, Any], source: str = "prometheus") -> MeasuredRun:
    """A Prometheus range-query response (``resultType: matrix``) with per-step seconds.

    Each series needs a ``rank`` label and a ``phase`` label naming one of the phases, or
    ``step`` for the step time, or ``wait`` for the wait. Samples at the same timestamp form one
    "step" (they are averages over the query's rate window, so the fit sees smoothed values:
    jitter and tails come out too small; prefer JSON-lines where possible).
    """
    data = result.get("data", result)
    if data.get("resultType") != "matrix":
        raise ValueError(f"{source}: expected a range query (resultType matrix)")
    table: dict[tuple[int, float], dict[str, Any]] = {}
    for series in data.get("result", []):
        labels = series.get("metric", {})
        if "rank" not in labels:
            continue
        rank, what = int(labels["rank"]), labels.get("phase", "step")
        for ts, value in series.get("values", []):
            row = table.setdefault((rank, float(ts)), {"rank": rank, "phases": {}})
            v = float(value)
            if what == "step":
                row["step_s"] = v
            elif what == "wait":
                row["wait_s"] = v
            elif what in PHASES:
                row["phases"][what] = v
    rows = []
    times = sorted({ts for _, ts in table})
    index = {ts: i for i, ts in enumerate(times)}
    for (_rank, ts), row in sorted(table.items()):
        if "step_s" not in row:
            row["step_s"] = sum(row["phases"].values())
        rows.append({**row, "step": index[ts]})
    return _build_run(rows, None, source)


def load_run(path: str | Path, fmt: str = "auto") -> MeasuredRun:
    """Load a measured run from a file; ``auto`` tells the formats apart by their content."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}")
    path = Path(path)
    if fmt == "auto":
        fmt = _sniff(path)
    if fmt == "jsonl":
        return load_jsonl(path)
    obj = json.loads(path.read_text(encoding="utf-8"))
    if fmt == "prometheus":
        return from_prometheus(obj, str(path))
    return from_exporter_state(obj, str(path))


def _sniff(path: Path) -> str:
    with open(path, encoding="utf-8") as fh:
        first = fh.readline()
    try:
        head = json.loads(first)
    except json.JSONDecodeError:
        head = None  # a pretty-printed document, or a JSON-lines file with a bad first line
    if isinstance(head, dict) and "rank" in head:
        return "jsonl"
    if head is None:
        try:
            obj = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            return "jsonl"
    else:
        obj = head
    return (
        "prometheus"
        if isinstance(obj, dict) and ("data" in obj or "resultType" in obj)
        else "state"
    )


def step_records(run: MeasuredRun) -> Iterator[dict[str, Any]]:
    """The run as the agent's JSON-lines records (one dict per rank-step)."""
    for r in run.ranks:
        for k in range(len(r.steps)):
            yield {
                "rank": r.rank,
                "world_size": run.world_size,
                "step": int(r.steps[k]),
                "step_s": float(r.step_s[k]),
                "phases": {name: float(r.phases[k, i]) for i, name in enumerate(PHASES)},
                "wait_s": 0.0 if r.wait_s is None else float(r.wait_s[k]),
            }


def write_jsonl(path: str | Path, run: MeasuredRun) -> int:
    """Write a run in the agent's record format; returns the number of lines."""
    count = 0
    with open(path, "w", encoding="utf-8") as fh:
        for record in step_records(run):
            fh.write(json.dumps(record) + "\n")
            count += 1
    return count


def run_from_simulation(sim: Any, steps: int, warmup_steps: int = 0) -> MeasuredRun:
    """Simulate ``steps`` steps and return them as the agent would have recorded them.

    ``sim`` is a :class:`syncscope.sim.engine.Simulator`; every rank reports every step.
    """
    for _ in sim.iter_chunks(warmup_steps):
        pass
    step_s, phases, waits, numbers = [], [], [], []
    for chunk in sim.iter_chunks(steps, keep_ranks=True):
        step_s.append(chunk.step_s)
        phases.append(chunk.rank_phase_s)
        waits.append(chunk.waits)
        numbers.append(chunk.first_step + np.arange(len(chunk)))
    all_steps = np.concatenate(numbers)
    all_step_s = np.concatenate(step_s)
    all_phases = np.concatenate(phases)  # (steps, ranks, phases)
    all_waits = np.concatenate(waits)
    ranks = [
        RankSeries(
            rank=i,
            steps=all_steps,
            step_s=all_step_s.copy(),
            phases=np.ascontiguousarray(all_phases[:, i, :]),
            wait_s=np.ascontiguousarray(all_waits[:, i]),
        )
        for i in range(sim.ranks)
    ]
    return MeasuredRun(sim.ranks, ranks, source=f"simulated {sim.params.name} x{sim.nodes}")
