"""The pooled per-step truth of a job from every rank's record file, and how syncscope's exported
estimates compare with it.

Every rank of a synchronous job leaves the gradient sync at the same moment, so at step k a
rank's time blocked there d(r, k) (its exposed gradient-sync time, and the delay pacing held it
back by before it) minus the smallest one of that step is how long it waited for the last peer:
W(r, k) = d(r, k) − min over ranks of d(·, k). Pooling all ranks'
records (``SYNCSCOPE_RECORD=dir/rank{rank}.jsonl``) gives that truth job-wide, which no single
node's exporter can see; `compare` sets it beside what the exporters and Prometheus report.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.rules import (
    LEAD,
    STRAGGLER_LAG,
    SYNC_AMPLIFICATION,
    TRANSFER_PER_STEP,
)
from syncscope.wire import Phase

EXPOSED = Phase.COMM_EXPOSED.label
PACING = Phase.PACING.label


@dataclass(frozen=True)
class Truth:
    """Per-rank means over the steps every rank recorded (seconds)."""

    steps: int  # steps used: recorded by every rank, after the skipped warm-up
    mean_wait_s: dict[int, float]  # W(r): mean of d(r, k) − min over ranks of d(·, k)
    mean_blocked_s: dict[int, float]  # mean d(r, k)
    mean_step_s: dict[int, float]
    amplification: float  # Σ W / Σ step time, over ranks and steps
    mean_transfer_s: float  # T: mean over steps of the smallest d(·, k)
    straggler: int | None  # the rank with the smallest mean d (None with fewer than 2 ranks)
    # With a window: the steps that ended in the last `window_s` before the job's end, and the
    # time to read Prometheus's rules at so that their windows cover the same steps.
    at_unix_s: float | None = None


def read_records(paths: Iterable[str]) -> dict[int, dict[int, dict[str, Any]]]:
    """{rank: {step: record}} from record files' step lines (event lines, which have an "event"
    key, are left out); a later line for the same step wins."""
    by_rank: dict[int, dict[int, dict[str, Any]]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                if not line.strip():
                    continue
                rec = json.loads(line)
                if "event" in rec:
                    continue
                by_rank.setdefault(int(rec["rank"]), {})[int(rec["step"])] = rec
    return by_rank


def blocked(phases: Mapping[str, Any]) -> float:
    """A step record's time blocked at the sync: exposed communication and pacing's delay (a
    record from before pacing was a phase has none)."""
    return float(phases[EXPOSED]) + float(phases.get(PACING, 0.0))


def record_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.jsonl")))


def pooled_truth(
    records: Mapping[int, Mapping[int, Mapping[str, Any]]],
    skip_steps: int = 0,
    window_s: float | None = None,
    settle_s: float = 2.0,
    rule_steps: Callable[[float], tuple[int, int] | None] | None = None,
    stages: Mapping[int, int] | None = None,
) -> Truth:
    """The truth over the steps all ranks recorded, without the first ``skip_steps`` of them
    (gloo connects and the allocator warms up there: one such step can outweigh a minute).

    ``window_s``: only the steps that ended in the last ``window_s`` seconds of the job, i.e.
    what a rule with that rate window covers when read ``settle_s`` after the job's end (the
    final reports scraped, the rules evaluated) at ``at_unix_s`` minus ``settle_s``. A rule's
    window and a whole run differ by more than the estimators do (the end of a run is not its
    middle), so the rules are judged against the steps they saw. ``rule_steps``: given the
    time the rules are read at, the steps (first, last + 1) their window's raw samples span
    (`rule_window_steps`); then exactly those steps, not the ones that ended in the window.
    ``stages``: rank -> pipeline stage, as the job laid its pipelines out; a rank's wait is
    then over the least blocked rank of its own stage (a pipeline's stages differ in work by
    design), the transfer the least blocked rank's of the job, and the straggler the least
    blocked rank of the stage whose ranks wait longest.
    """
    ranks = sorted(records)
    if not ranks:
        raise ValueError("no records")
    common = sorted(set.intersection(*(set(records[r]) for r in ranks)))[skip_steps:]
    at = None
    if window_s is not None and common:

        def end(k: int) -> float:
            return max(float(records[r][k]["end_unix_s"]) for r in ranks)

        job_end = end(common[-1])
        at = job_end + settle_s
        span = rule_steps(at) if rule_steps is not None else None
        if span is not None:
            common = [k for k in common if span[0] <= k < span[1]]
        else:
            common = [k for k in common if end(k) > at - window_s]
    if not common:
        raise ValueError("no step was recorded by every rank")
    transfer = 0.0
    wait = {r: 0.0 for r in ranks}
    blocked_total = {r: 0.0 for r in ranks}
    step_time = {r: 0.0 for r in ranks}
    stage = {r: (stages or {}).get(r, 0) for r in ranks}
    for k in common:
        d = {r: blocked(records[r][k]["phases"]) for r in ranks}
        floor = {s: min(d[r] for r in ranks if stage[r] == s) for s in set(stage.values())}
        transfer += min(floor.values())
        for r in ranks:
            wait[r] += d[r] - floor[stage[r]]
            blocked_total[r] += d[r]
            step_time[r] += float(records[r][k]["step_s"])
    n = len(common)
    total_step = sum(step_time.values())
    mean_blocked = {r: blocked_total[r] / n for r in ranks}
    mean_wait = {r: wait[r] / n for r in ranks}
    # The straggler: the least blocked rank of the stage whose ranks wait longest for theirs
    # (the job's least blocked rank where the job is no pipeline).
    worst = max(
        set(stage.values()), key=lambda s: max(mean_wait[r] for r in ranks if stage[r] == s)
    )
    in_worst = [r for r in ranks if stage[r] == worst]
    return Truth(
        steps=n,
        mean_wait_s=mean_wait,
        mean_blocked_s=mean_blocked,
        mean_step_s={r: step_time[r] / n for r in ranks},
        amplification=sum(wait.values()) / total_step if total_step > 0 else 0.0,
        mean_transfer_s=transfer / n,
        straggler=min(in_worst, key=mean_blocked.__getitem__) if len(in_worst) > 1 else None,
        at_unix_s=at,
    )


def truth_from_dir(
    directory: str,
    skip_steps: int = 0,
    window_s: float | None = None,
    rule_steps: Callable[[float], tuple[int, int] | None] | None = None,
) -> Truth:
    return pooled_truth(
        read_records(record_files(directory)), skip_steps, window_s, rule_steps=rule_steps
    )


def rule_window_steps(
    prom: Any, job: str, window: str
) -> Callable[[float], tuple[int, int] | None]:
    """For `pooled_truth`: the steps a rule read at time t over ``window`` sees, from the raw
    samples of rank 0's step counter in that window (rate() takes its first and last sample;
    every series of one exporter is scraped at the same instants)."""

    def steps(at: float) -> tuple[int, int] | None:
        found = prom.query(f'{M.STEPS_TOTAL.name}{{job="{job}",rank="0"}}[{window}]', at=at)
        values = found[0]["values"] if found else []
        if len(values) < 2:
            return None
        return int(float(values[0][1])), int(float(values[-1][1]))

    return steps


def _value(result: Sequence[Mapping[str, Any]]) -> float | None:
    return float(result[0]["value"][1]) if result else None


def compare(
    prom: Any, states: Sequence[Mapping[str, Any]], truth: Truth, job: str
) -> dict[str, Any]:
    """syncscope's estimates beside the truth, per rank and job-wide.

    ``prom``: a `syncscope.lab.servers.Prometheus` with syncscope's rules (or None); ``states``:
    each node's exporter ``/v1/state``, in node order. The exported lead of a rank is the
    ``syncscope_arrival_lead_seconds`` gauge's value (the state's ``arrival_lead_s``). The
    rules are read at ``truth.at_unix_s`` where the truth has a window, else now.
    """
    ranks: dict[int, dict[str, Any]] = {
        r: {
            "node": None,
            "exported_lead_s": None,
            "rule_lead_avg_s": None,
            "truth_wait_s": truth.mean_wait_s[r],
            "truth_blocked_s": truth.mean_blocked_s[r],
        }
        for r in truth.mean_wait_s
    }
    nodes = []
    for node, state in enumerate(states):
        data = state.get("jobs", {}).get(job) or {}
        diag = data.get("diagnosis") or {}
        modes = diag.get("modes") or {}
        for r in data.get("ranks", []):
            row = ranks.setdefault(r["rank"], {"truth_wait_s": None, "truth_blocked_s": None})
            row.update(node=node, exported_lead_s=r["arrival_lead_s"])
            if r.get("pacing"):
                row["paced_s"] = r["pacing"]["total_delay_s"]
        contention = modes.get("fabric_contention") or {}
        slow_link = modes.get("slow_link") or {}
        amplification = modes.get("sync_amplification") or {}
        nodes.append(
            {
                "node": node,
                "ranks": sorted(r["rank"] for r in data.get("ranks", [])),
                "straggler": (diag.get("straggler") or {}).get("rank"),
                "fabric_contention": contention.get("verdict"),
                "fabric_contention_score": contention.get("score"),
                "slow_link": slow_link.get("verdict"),
                "sync_amplification_score": amplification.get("score"),
            }
        )
    out: dict[str, Any] = {
        "job": job,
        "steps": truth.steps,
        "ranks": ranks,
        "nodes": nodes,
        "window": (
            f" (those the rules read at {truth.at_unix_s:.1f} cover)"
            if truth.at_unix_s is not None
            else ""
        ),
        "amplification": {"truth": truth.amplification, "rule": None},
        "transfer": {"truth": truth.mean_transfer_s, "rule": None},
        "straggler": {"truth": truth.straggler, "rule": None},
    }
    if prom is not None:
        sel = f'{{job="{job}"}}'

        def query(promql: str) -> list[dict[str, Any]]:
            return prom.query(promql, at=truth.at_unix_s)

        for row in query(LEAD + sel):
            ranks.setdefault(int(row["metric"]["rank"]), {})["rule_lead_avg_s"] = float(
                row["value"][1]
            )
        out["amplification"]["rule"] = _value(query(SYNC_AMPLIFICATION + sel))
        out["transfer"]["rule"] = _value(query(TRANSFER_PER_STEP + sel))
        named = query(STRAGGLER_LAG + sel)
        out["straggler"]["rule"] = int(named[0]["metric"]["rank"]) if named else None
    return out


def _ms(value: float | None) -> str:
    return f"{value * 1e3:8.1f}" if value is not None else f"{'-':>8}"


def format_comparison(c: Mapping[str, Any]) -> str:
    """The comparison as a table: exported and rule values beside the truth, in ms."""
    lines = [
        f"job {c['job']}: truth over {c['steps']} steps every rank recorded{c.get('window', '')}; "
        "in ms: lead = "
        f"exported syncscope_arrival_lead_seconds, rule avg = {LEAD},",
        "truth W = mean wait for the last rank, truth d = mean time blocked at the sync",
        f"{'rank':>4} {'node':>4} {'lead':>8} {'rule avg':>8} {'truth W':>8} {'truth d':>8}",
    ]
    for rank, row in sorted(c["ranks"].items()):
        node = row.get("node")
        lines.append(
            f"{rank:>4} {node if node is not None else '-':>4} {_ms(row.get('exported_lead_s'))} "
            f"{_ms(row.get('rule_lead_avg_s'))} {_ms(row.get('truth_wait_s'))} "
            f"{_ms(row.get('truth_blocked_s'))}"
        )
    amp = c["amplification"]
    rule_amp = f"{amp['rule']:.3f}" if amp["rule"] is not None else "-"
    lines.append(f"amplification: rule {rule_amp}, truth {amp['truth']:.3f} (Σ W / Σ step time)")
    transfer = c.get("transfer") or {}
    if transfer:
        lines.append(
            f"transfer per step (ms): rule {_ms(transfer['rule']).strip()}, "
            f"truth {_ms(transfer['truth']).strip()}"
        )
    lines.append(
        f"straggler: rule {c['straggler']['rule']}, truth {c['straggler']['truth']}, "
        + ", ".join(f"exporter of node {n['node']} {n['straggler']}" for n in c["nodes"])
    )
    for n in c["nodes"]:
        score = n["fabric_contention_score"]
        lines.append(
            f"node {n['node']} (ranks {n['ranks']}): fabric_contention verdict "
            f"{n['fabric_contention']} (score {score if score is not None else '-'}), "
            f"sync_amplification score {n['sync_amplification_score']}"
        )
    return "\n".join(lines)
