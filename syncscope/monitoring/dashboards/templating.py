"""The dashboards' template variables and annotations."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import dashboard as dm

from syncscope import catalog as M
from syncscope import recorded
from syncscope.monitoring.dashboards.common import (
    ALERT_PREFIX,
    ANNOTATION_STEP,
    DS,
    JOB,
    NODE,
    NODE_ALL,
    RANK_ALL,
)
from syncscope.monitoring.dashboards.queries import rec
from syncscope.monitoring.promql import sel
from syncscope.thresholds import Thresholds


def variables(cfg: Thresholds) -> list[Any]:
    def query_var(name: str, label: str, query: str, sort: dm.VariableSort) -> Any:
        return (
            db.QueryVariable(name)
            .label(label)
            .datasource(DS)
            .query(query)
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(sort)
        )

    everything = dm.VariableOption(selected=True, text=["All"], value=["$__all"])
    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        # One training job: per-rank panels must not merge rank 3 of two jobs.
        query_var(
            "job",
            "Job",
            f"label_values({recorded.STEPS_RATE}, job)",
            dm.VariableSort.ALPHABETICAL_ASC,
        )
        .multi(False)
        .include_all(False),
        query_var(
            "node",
            "Node",
            f"label_values({rec(recorded.SYNC_PER_STEP)}, node)",
            dm.VariableSort.ALPHABETICAL_ASC,
        )
        .multi(True)
        .include_all(True)
        .all_value(NODE_ALL)
        .current(everything),
        query_var(
            "rank",
            "Rank",
            f"label_values({rec(recorded.SYNC_PER_STEP, NODE)}, rank)",
            dm.VariableSort.NUMERICAL_ASC,
        )
        .multi(True)
        .include_all(True)
        .all_value(RANK_ALL)
        .current(everything),
    ]


# Annotations on both dashboards: Prometheus annotation queries (Grafana reads expr, step,
# titleFormat, textFormat, tagKeys from the annotation itself; the SDK writes only expr).
def annotation_specs(cfg: Thresholds) -> list[dict[str, Any]]:
    step = ANNOTATION_STEP
    steps_total = sel(cfg, M.STEPS_TOTAL.name, JOB)
    start = f"{M.EXPORTER_START_TIME_SECONDS.name}{{{cfg.selectors.exporter}}}"
    return [
        {
            "name": "Syncscope alerts firing",
            "iconColor": "red",
            "expr": f'ALERTS{{alertname=~"{ALERT_PREFIX}.+", alertstate="firing", {JOB}}}',
            "step": step,
            "titleFormat": "{{alertname}}",
            "textFormat": "{{alertname}} ({{severity}}) firing for job {{job}}",
            "tagKeys": "alertname,severity",
        },
        {
            "name": "Job start",
            "iconColor": "blue",
            # A rank's step counter that exists now and did not one annotation step ago (one
            # event per start at that step): the job's ranks (re)starting once their old
            # series went stale.
            "expr": f"count by (job) ({steps_total} unless {steps_total} offset {step})",
            "step": step,
            "titleFormat": "Job {{job}} started",
            "textFormat": "The ranks of job {{job}} began reporting",
            "tagKeys": "job",
        },
        {
            "name": "Exporter restarts",
            "iconColor": "purple",
            "expr": (
                f"count(changes({start}[{step}]) > 0 or ({start} unless {start} offset {step}))"
            ),
            "step": step,
            "titleFormat": "syncscope exporter (re)started",
            "textFormat": "An exporter started: its ranks' series may restart",
            "tagKeys": "",
        },
    ]


ANNOTATION_EXTRAS = ("expr", "step", "titleFormat", "textFormat", "tagKeys")
