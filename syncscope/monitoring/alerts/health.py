"""Alerts of this area (promtool tests: deploy/prometheus/tests/health.test.yml)."""

from __future__ import annotations

from typing import Any

from syncscope import catalog as M
from syncscope.monitoring.alerts.base import AlertInput
from syncscope.monitoring.promql import (
    STEP_SECONDS_COUNT,
    THIS_JOB,
    listing,
    pct,
    rate,
    seconds,
    sel,
    template_query,
)
from syncscope.recorded import RANKS_REPORTING, STEPS_RATE
from syncscope.thresholds import required


def agent_dropping_records_text(alert: AlertInput) -> dict[str, Any]:
    cfg, threshold = alert.cfg, alert.threshold

    # Over the job's steps per rank (recorded): one pass over the ranks, not two.
    def drops(*matchers: str) -> str:
        steps = f"{STEPS_RATE}{{{', '.join(matchers)}}}" if matchers else STEPS_RATE
        return (
            "sum by (job, node, rank) "
            f"({rate(cfg, M.AGENT_RECORDS_DROPPED_TOTAL.name, *matchers)})"
            f" / on (job) group_left () {steps}"
        )

    worst = listing(
        f"topk(1, {drops(THIS_JOB)})",
        "rank {{ $s.Labels.rank }} on {{ $s.Labels.node }}, {{ $s.Value | humanizePercentage }}",
        "rank",
    )
    return {
        "expr": f"\ncount by (job) (\n    {drops()}\n  > {threshold}\n)\n",
        "summary": (
            "The syncscope agents of {{ $value }} rank(s) in job {{ $labels.job }} "
            "are dropping records."
        ),
        "description": (
            "{{ $value }} rank(s) of job {{ $labels.job }} drop more than "
            f"{pct(threshold)} as many step records as they deliver (worst: {worst}). The agent "
            "drops rather than block training when the exporter is slow or unreachable, so "
            "syncscope's view of these ranks is incomplete."
        ),
    }


def exporter_down_text(alert: AlertInput) -> dict[str, Any]:
    cfg, entry, level, threshold = alert.cfg, alert.entry, alert.level, alert.threshold
    exporter = cfg.selectors.exporter

    def up(*matchers: str) -> str:
        parts = [m for m in (exporter, *matchers) if m]
        return f"up{{{', '.join(parts)}}}" if parts else "up"

    # The share of exporters down per scrape job: a rolling restart of many nodes is one
    # small share at a time, not one alert per node.
    share = f"count by (job) ({up()} == 0) / count by (job) ({up()})"
    expr = f"{share} > {threshold}"
    if entry.none_scraped_severity == level.severity:
        # No exporter target at all: every exporter gone, or discovery broken.
        expr = f"\n  {share} > {threshold}\nor\n  absent({up()})\n"
    down = listing(f"{up(THIS_JOB)} == 0", "{{ $s.Labels.instance }}", "instance")
    n_down = f"{{{{ {template_query(f'count({up(THIS_JOB)} == 0)')} | first | value }}}}"
    n_all = f"{{{{ {template_query(f'count({up(THIS_JOB)})')} | first | value }}}}"
    return {
        "expr": expr,
        "summary": (
            "{{ if $labels.job }}{{ $value | humanizePercentage }} of the syncscope "
            "exporters of scrape job {{ $labels.job }} are down.{{ else }}Prometheus "
            "scrapes no syncscope exporter at all.{{ end }}"
        ),
        "description": (
            f"{{{{ if $labels.job }}}}Prometheus has failed to scrape {n_down} of the {n_all} "
            "syncscope exporters of scrape job {{ $labels.job }} "
            f"(threshold: more than {pct(threshold)}) for {entry.for_}: {down}. The ranks on those "
            "nodes are invisible.{{ else }}No scrape target matches "
            f"{up()} for {entry.for_}: every exporter is gone, or service discovery no longer "
            "finds them. syncscope sees no rank at all.{{ end }}"
        ),
    }


def rank_silent_text(alert: AlertInput) -> dict[str, Any]:
    cfg, entry, threshold = alert.cfg, alert.entry, alert.threshold
    ts = sel(cfg, M.RANK_LAST_REPORT_TIMESTAMP_SECONDS.name)
    ts_job = sel(cfg, M.RANK_LAST_REPORT_TIMESTAMP_SECONDS.name, THIS_JOB)
    lookback = required(entry.lookback, "lookback")
    # Silent: a rank of the job seen in the lookback (the exporter forgets a rank after
    # --expire-after, so its series may be gone) that has not reported within the
    # threshold, while another rank of the job has, and no rank of the job has stepped
    # within it. A job whose ranks all stop together (its end) has no rank reporting; an
    # exporter restart hides ranks, but the others keep stepping; a dead or frozen rank
    # stops its peers at the next collective while their agents keep reporting.
    silent = (
        f"max by (node, rank) (last_over_time({ts_job}[{lookback}]))"
        f" unless on (rank) (time() - {ts_job} <= {threshold})"
    )
    ranks = listing(silent, "{{ $s.Labels.rank }} (node {{ $s.Labels.node }})", "rank")
    return {
        # Counted, not listed: the ranks seen over the lookback (the recorded count's
        # maximum, one series per job) minus those reporting now; the job's steps from the
        # node histograms (a per-rank last_over_time over 1h would read every rank's
        # 240 samples every evaluation).
        "expr": f"""
  (
      max_over_time({RANKS_REPORTING}[{lookback}])
    - on (job)
      count by (job) (time() - {ts} <= {threshold})
  ) > 0
and on (job)
  (sum by (job) (increase({sel(cfg, STEP_SECONDS_COUNT)}[{seconds(threshold)}])) == 0)
""",
        "summary": (
            "{{ $value }} rank(s) of job {{ $labels.job }} stopped reporting, "
            "and the job stopped stepping."
        ),
        "description": (
            f"Rank(s) {ranks} of job {{{{ $labels.job }}}} sent no step record or heartbeat "
            f"for more than {threshold}s while the job's other ranks still report but have "
            f"completed no step in {threshold}s: the job waits for the silent ranks (a dead or "
            "frozen process, or a lost node)."
        ),
    }
