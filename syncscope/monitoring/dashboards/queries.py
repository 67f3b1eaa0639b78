"""The PromQL the panels run, as named functions: per-rank series bounded to the ranks that stand out, lateness, phases per step, the straggler's cost."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from syncscope import catalog as M
from syncscope import recorded
from syncscope.monitoring.dashboards.common import (
    BAND,
    BY_RANK,
    INTERVAL,
    JOB,
    NODE,
    RANGE,
    RANK,
    RATE,
    TOP,
    TRIAGE_ROWS,
)
from syncscope.monitoring.dashboards.panels import q
from syncscope.monitoring.promql import sel
from syncscope.thresholds import Thresholds


def rec(name: str, *matchers: str) -> str:
    """A recorded series: its rule already applied the rank selector."""
    return f"{name}{{{', '.join((JOB, *matchers))}}}"


def indent(expr: str, by: int = 2) -> str:
    return "\n".join(" " * by + line if line else line for line in expr.splitlines())


# A per-rank expression: window (None: the series' current value) and an evaluation modifier
# (" @ end()") -> PromQL with one series per rank, restricted by the matchers given.
PerRank = Callable[[str | None, str, Sequence[str]], str]


def gauge_per_rank(cfg: Thresholds, metric: str, *, recorded: bool = False) -> PerRank:
    """A per-rank gauge (or recorded per-rank series); over a window, its mean."""

    def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
        s = rec(metric, *matchers) if recorded else sel(cfg, metric, JOB, *matchers)
        inner = s if window is None else f"avg_over_time({s}[{window}]{at})"
        return f"max by ({BY_RANK}) ({inner})"

    return expr


def ratio_per_rank(
    cfg: Thresholds,
    num: tuple[str, Sequence[str]],
    den: tuple[str, Sequence[str]],
) -> PerRank:
    """Rate of one per-rank counter over another's (each (metric, extra matchers))."""

    def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
        w = window or RATE

        def rate(metric: str, extra: Sequence[str]) -> str:
            s = sel(cfg, metric, JOB, *matchers, *extra)
            return f"sum by ({BY_RANK}) (rate({s}[{w}]{at}))"

        return f"{rate(*num)}\n/\n  ({rate(*den)} > 0)"

    return expr


def ranks_that_stand_out(
    per_rank: PerRank,
    legend: str = "rank {{rank}} · {{node}}",
    *,
    k: int = TOP,
    lowest: bool = False,
    band: bool = True,
    by: str = BY_RANK,
    matchers: Sequence[str] = (NODE, RANK),
) -> list[Any]:
    """Targets: the k selected ranks highest (or lowest) on average over the time range shown,
    chosen once at the range's end so that the same k are drawn throughout, and the job's
    median and 10th-90th percentile band (all its ranks)."""
    pick = "bottomk" if lowest else "topk"
    lines = (
        f"{per_rank(None, '', matchers)}\nand on ({by})\n"
        f"  {pick}({k}, {per_rank(RANGE, ' @ end()', matchers)})"
    )
    targets = [q(lines, legend)]
    if band:
        whole = per_rank(None, "", ())
        targets += [q(f"quantile by (job) ({p}, {whole})", name) for p, name in BAND]
    return targets


def phase_per_step(cfg: Thresholds, window: str, *matchers: str) -> str:
    """Each rank's seconds per step in the phases matched (labels job, node, rank)."""
    return ratio_per_rank(cfg, (M.PHASE_SECONDS_TOTAL.name, matchers), (M.STEPS_TOTAL.name, ()))(
        window, "", ()
    )


# ------------------------------------------------------------------------------ triage row


def lateness() -> str:
    """How much later than the job's earliest rank each selected rank reaches collectives, in
    seconds per step: the largest lead minus its own (the straggler's is the job's skew)."""
    return f"max by (job) ({rec(recorded.LEAD)})\n- on (job) group_right ()\n  {rec(recorded.LEAD, NODE, RANK)}"


def late_rows(expr: str) -> str:
    """``expr`` for the triage table's rows only: the TRIAGE_ROWS latest ranks."""
    return f"{expr}\nand on (job, rank)\n  topk({TRIAGE_ROWS}, {indent(lateness(), 2).strip()})"


def on_straggler(expr: str, labels: str = "") -> str:
    """A per-job value shown on the straggler's row (the rank the straggler rules name)."""
    return f"0 * {rec(recorded.STRAGGLER_LAG)}\n+ on (job) group_left ({labels})\n  ({expr})"


def straggler_alert_age() -> str:
    alert = f'alertname="SyncscopeStraggler", {JOB}'
    return (
        f"(time() - max by (job) (ALERTS_FOR_STATE{{{alert}}}))\n"
        f"* on (job) group_left (alertstate)\n  max by (job, alertstate) (ALERTS{{{alert}}})"
    )


def idle_gpus_from_skew() -> str:
    """Rank-seconds per second the job's ranks wait for its latest one (persistent skew):
    each rank's lead over the latest rank per step, summed, times steps per second. A rank
    waiting is a GPU idle, so this is idle GPU-hours per hour."""
    return f"sum by (job) ({rec(recorded.LEAD)})\n* on (job)\n  {rec(recorded.STEPS_RATE)}"


def ratio_lead_per_step() -> PerRank:
    """Each rank's lead over the latest rank (recorded) as a share of the job's mean step."""

    def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
        lead = rec(recorded.LEAD, *matchers)
        if window is not None:
            lead = f"avg_over_time({lead}[{window}]{at})"
            return f"max by ({BY_RANK}) ({lead})"
        return f"max by ({BY_RANK}) ({lead})\n/ on (job) group_left ()\n  {rec(recorded.STEP_MEAN)}"

    return expr


# ------------------------------------------------------------------------------ work and energy


def energy_by_source() -> list[tuple[str, str]]:
    """(query, legend) of the job's joules per second from each source: its GPUs' counters and
    its nodes' CPU packages (each present only where measured)."""
    return [
        (rec(recorded.GPU_ENERGY_RATE), "GPUs"),
        (rec(recorded.CPU_ENERGY_RATE), "CPU packages"),
    ]


def joules_per(work: str) -> str:
    """Joules per sample (``work`` = the recorded samples rate) or per token over each point's
    interval: the recorded energy rate's sum over the interval over the work rate's. Two series
    per job at the slow rules' interval, so a range of days stays cheap; every minute weighs
    by its work, and energy spent while the job processed nothing counts against the work
    around it."""
    energy = f"sum_over_time({rec(recorded.ENERGY_RATE)}[{INTERVAL}])"
    return f"{energy}\n/ on (job)\n  (sum_over_time({rec(work)}[{INTERVAL}]) > 0)"


# ------------------------------------------------------------------------------ goodput


def badput_shares() -> str:
    """Each badput category's share of the rank-seconds since the job started (recorded)."""
    return rec(recorded.BADPUT_RATIO)


def gpu_hours(lost: bool = False) -> str:
    """Rank-hours (GPU-hours, one GPU a rank) since the job's first process started; with
    ``lost``, those not spent on productive steps that counted (1 - goodput)."""
    hours = f"{rec(recorded.RANK_SECONDS)} / 3600"
    return f"{hours}\n* on (job)\n  (1 - {rec(recorded.GOODPUT)})" if lost else hours
