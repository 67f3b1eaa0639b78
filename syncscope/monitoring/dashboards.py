"""Syncscope's Grafana dashboards (and the list of their PromQL), built with grafana-foundation-sdk.

One source: panel thresholds come from the thresholds file and recorded-series names from
monitoring/rules.py, the same place the alerts come from. `syncscope dashboards --out DIR`
writes them; `syncscope generate` rewrites the checked-in copies under dashboards/
(the two dashboards and queries.json, every panel query with the optional series it needs).
The JSON is stable only with grafana-foundation-sdk==1769699379!11.6.0 (the Grafana 11.6 build).

Built for a job of a thousand ranks (docs/dashboards.md): the job overview opens on a triage
row (which ranks are late, on which node and GPU, why, since when, at what cost); `job` is a
single training job; `node` and `rank` narrow every per-rank panel; and no panel draws one
line per rank: per-rank panels draw the few ranks that stand out over the time range shown
(`topk`/`bottomk` at the range's end, so the same ranks throughout) against the job's median
and 10th-90th percentile band. `panel_queries()` gives every query with the variables filled
in, for a bench to count the series each returns.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    heatmap,
    prometheus,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from syncscope import catalog as M
from syncscope.catalog import STEP_WINDOW
from syncscope.monitoring import rules as R
from syncscope.monitoring.promql import sel
from syncscope.thresholds import load_config
from syncscope.wire import Phase

QUERIES_FILE = "queries.json"
TAGS = ["syncscope"]
GRID_WIDTH = 24

OVERVIEW_UID = "syncscope-job-overview"
FABRIC_UID = "syncscope-fabric-locality"

DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Panel selectors: Grafana variables plus the deployment's own rank selector from the config.
# `job` is single-valued (one training job at a time: the same rank of two jobs is two ranks);
# `node` and `rank` are multi-valued with All. All for `node` is ".*" so that a series without
# the label still matches.
JOB = 'job=~"$job"'
NODE = 'node=~"$node"'
RANK = 'rank=~"$rank"'
RATE = "$__rate_interval"
RANGE = "$__range"
NODE_ALL = ".*"
RANK_ALL = ".+"
BY_RANK = "job, node, rank"
# What a per-rank panel draws: the TOP ranks that stand out, and the job's spread.
TOP = 5
TRIAGE_ROWS = 5
BAND = ((0.1, "p10"), (0.5, "median"), (0.9, "p90"))
# The most series any panel query may return while no rank is selected (scale bench, tests).
MAX_SERIES = 30
ALERT_PREFIX = "Syncscope"
ANNOTATION_STEP = "15s"  # the shipped scrape interval
# Phases whose per-rank difference from the job's median says why a rank is late.
TRIAGE_PHASES = (Phase.DATA, Phase.FORWARD, Phase.BACKWARD, Phase.OPTIMIZER, Phase.COMM_EXPOSED)
PHASE_COLUMNS = {
    Phase.DATA: "Δ data",
    Phase.FORWARD: "Δ forward",
    Phase.BACKWARD: "Δ backward",
    Phase.OPTIMIZER: "Δ optimizer",
    Phase.COMM_EXPOSED: "Δ exposed comm",
}
# A dashboard link keeps the time range and the data source.
KEEP = "${__url_time_range}&${datasource:queryparam}"


def rec(name: str, *matchers: str) -> str:
    """A recorded series: its rule already applied the rank selector."""
    return f"{name}{{{', '.join((JOB, *matchers))}}}"


def indent(expr: str, by: int = 2) -> str:
    return "\n".join(" " * by + line if line else line for line in expr.splitlines())


# ---------------------------------------------------------------------------- panel helpers


def q(expr: str, legend: str = "", *, instant: bool = False, table_format: bool = False):
    query = prometheus.Dataquery().expr(expr).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    if instant:
        query = query.instant()
    if table_format:
        query = query.format(pm.PromQueryFormat.TABLE)
    return query


def steps(*levels: tuple[float, str], base: str = "green") -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps(
            [dm.Threshold(value=None, color=base)]
            + [dm.Threshold(value=v, color=c) for v, c in levels]
        )
    )


def alert_steps(cfg: Mapping[str, Any], alert: str) -> db.ThresholdsConfig:
    """Orange at the warning threshold, red at the critical one: the alert's own levels."""
    colours = {"warning": "orange", "critical": "red"}
    levels = cfg["alerts"][alert]["levels"]
    return steps(*((lv["threshold"], colours[lv["severity"]]) for lv in levels))


def value_map(*entries: tuple[float, str, str]) -> list[dm.ValueMapping]:
    """Value -> (text, colour). A state that needs attention (down, failing, fault) is red."""
    return [
        dm.ValueMap(
            options={
                f"{value:g}": dm.ValueMappingResult(text=text, color=colour, index=i)
                for i, (value, text, colour) in enumerate(entries)
            }
        )
    ]


def threshold_lines() -> common.GraphThresholdsStyleConfig:
    return common.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)


def with_targets(panel: Any, targets: Sequence[Any]) -> Any:
    for ref, target in zip("ABCDEFGHIJKLMNOP", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def prop(id_val: str, value: Any) -> dm.DynamicConfigValue:
    return dm.DynamicConfigValue(id_val=id_val, value=value)


def band_overrides(panel: Any) -> Any:
    """The job's 10th-90th percentile band filled grey, its median a dashed grey line."""
    grey = {"mode": "fixed", "fixedColor": "#8e8e8e"}
    panel = panel.override_by_name(
        "p90",
        [
            prop("color", grey),
            prop("custom.fillBelowTo", "p10"),
            prop("custom.fillOpacity", 15),
            prop("custom.lineWidth", 0),
        ],
    )
    panel = panel.override_by_name("p10", [prop("color", grey), prop("custom.lineWidth", 0)])
    return panel.override_by_name(
        "median",
        [prop("color", grey), prop("custom.lineStyle", {"fill": "dash", "dash": [10, 10]})],
    )


def ts(
    title: str,
    desc: str,
    targets: Sequence[Any],
    unit: str,
    *,
    thresholds=None,
    stack: bool = False,
    max_val: float | None = None,
    min_val: float | None = 0,
    band: bool = False,
) -> Any:
    panel = timeseries.Panel().title(title).description(desc).datasource(DS).unit(unit)
    if min_val is not None:
        panel = panel.min(min_val)
    panel = panel.legend(
        common.VizLegendOptions()
        .show_legend(True)
        .display_mode(cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
    )
    if max_val is not None:
        panel = panel.max(max_val)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).thresholds_style(threshold_lines())
    if stack:
        panel = panel.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(
            40
        )
    if band:
        panel = band_overrides(panel)
    return with_targets(panel, targets)


def stat_panel(
    title: str,
    desc: str,
    targets: Sequence[Any],
    unit: str,
    *,
    thresholds=None,
    mappings: list[dm.ValueMapping] | None = None,
    no_value: str | None = None,
) -> Any:
    panel = (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .color_mode(cm.BigValueColorMode.BACKGROUND if thresholds else cm.BigValueColorMode.NONE)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if thresholds is not None:
        panel = panel.thresholds(thresholds)
    if mappings:
        panel = panel.mappings(mappings)
    if no_value is not None:
        panel = panel.no_value(no_value)
    return with_targets(panel, targets)


def table_panel(
    title: str,
    desc: str,
    targets: Sequence[Any],
    *,
    unit: str = "short",
    thresholds=None,
    mappings: list[dm.ValueMapping] | None = None,
    hide: Iterable[str] = ("Time", "__name__"),
    rename: Mapping[str, str] | None = None,
    sort: tuple[str, bool] | None = None,
    columns: Mapping[str, Sequence[dm.DynamicConfigValue]] | None = None,
) -> Any:
    """A table of instant queries merged on their common labels (Grafana's merge), then sorted
    by ``sort`` (field, descending) and organized: ``hide`` dropped, ``rename`` renamed and
    ordered as listed; ``columns`` are per-column settings by their new name."""
    panel = table.Panel().title(title).description(desc).datasource(DS).unit(unit)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).cell_options(cm.TableColoredBackgroundCellOptions())
    if mappings:
        panel = panel.mappings(mappings)
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    if sort is not None:
        panel = panel.with_transformation(
            dm.DataTransformerConfig(
                id_val="sortBy",
                options={"fields": {}, "sort": [{"field": sort[0], "desc": sort[1]}]},
            )
        )
    options: dict[str, Any] = {"excludeByName": {name: True for name in hide}}
    if rename:
        options["renameByName"] = dict(rename)
        options["indexByName"] = {name: i for i, name in enumerate(rename)}
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="organize", options=options))
    for name, properties in (columns or {}).items():
        panel = panel.override_by_name(name, list(properties))
    return with_targets(panel, targets)


def link(title: str, url: str) -> dict[str, Any]:
    return {"title": title, "url": url}


# --------------------------------------------------------------- per-rank views that scale

# A per-rank expression: window (None: the series' current value) and an evaluation modifier
# (" @ end()") -> PromQL with one series per rank, restricted by the matchers given.
PerRank = Callable[[str | None, str, Sequence[str]], str]


def gauge_per_rank(cfg: Mapping[str, Any], metric: str, *, recorded: bool = False) -> PerRank:
    """A per-rank gauge (or recorded per-rank series); over a window, its mean."""

    def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
        s = rec(metric, *matchers) if recorded else sel(cfg, metric, JOB, *matchers)
        inner = s if window is None else f"avg_over_time({s}[{window}]{at})"
        return f"max by ({BY_RANK}) ({inner})"

    return expr


def ratio_per_rank(
    cfg: Mapping[str, Any],
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


def phase_per_step(cfg: Mapping[str, Any], window: str, *matchers: str) -> str:
    """Each rank's seconds per step in the phases matched (labels job, node, rank)."""
    return ratio_per_rank(cfg, (M.PHASE_SECONDS_TOTAL.name, matchers), (M.STEPS_TOTAL.name, ()))(
        window, "", ()
    )


# ------------------------------------------------------------------------------ triage row


def lateness() -> str:
    """How much later than the job's earliest rank each selected rank reaches collectives, in
    seconds per step: the largest lead minus its own (the straggler's is the job's skew)."""
    return (
        f"max by (job) ({rec(R.LEAD_AVG)})\n- on (job) group_right ()\n  "
        f"{rec(R.LEAD_AVG, NODE, RANK)}"
    )


def late_rows(expr: str) -> str:
    """``expr`` for the triage table's rows only: the TRIAGE_ROWS latest ranks."""
    return f"{expr}\nand on (job, rank)\n  topk({TRIAGE_ROWS}, {indent(lateness(), 2).strip()})"


def on_straggler(expr: str, labels: str = "") -> str:
    """A per-job value shown on the straggler's row (the rank the straggler rules name)."""
    return f"0 * {rec(R.STRAGGLER_LAG)}\n+ on (job) group_left ({labels})\n  ({expr})"


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
    return f"sum by (job) ({rec(R.LEAD_AVG)})\n* on (job)\n  {rec(R.STEPS_RATE)}"


def triage_table(cfg: Mapping[str, Any]) -> Any:
    """The triage row's table: the latest ranks with their node, GPU, cause, phases against the
    job's median rank, alert age and cost (targets A..L merged on job and rank)."""
    straggler = cfg["alerts"]["SyncscopeStraggler"]["levels"][0]["threshold"]
    window = cfg["windows"]["straggler"]
    targets = _triage_targets(cfg, window)
    rename = _triage_rename()
    columns = _triage_columns(straggler)
    return table_panel(
        "Late ranks",
        f"The {TRIAGE_ROWS} ranks that reach collectives latest (of those selected), latest "
        f"first: node, GPU, the exporter's cause, how late (per step, averaged over "
        f"{window}; orange from the SyncscopeStraggler threshold), each phase's seconds per "
        "step against the job's median rank (the phase that is larger says why), since when "
        "the straggler alert is active, and what the straggler costs: the GPU-hours per hour "
        "the other ranks spend waiting for it. Click a rank for its detail, a node for its "
        "fabric and GPUs.",
        targets,
        hide=(
            "Time",
            "job",
            "__name__",
            "Value #C",
            "Value #D",
        ),
        rename=rename,
        sort=("Value #A", True),
        columns=columns,
    )


def _triage_targets(cfg: Mapping[str, Any], window: str) -> list[Any]:
    """A lateness, B of a step, C cause, D GPU, E last report, F.. phases, K alert, L cost."""
    median = "\n- on (job) group_left ()\n  quantile by (job) (0.5, {0})"
    targets = [
        q(f"topk({TRIAGE_ROWS}, {lateness()})", instant=True, table_format=True),
        q(
            late_rows(f"({lateness()})\n/ on (job) group_left ()\n  {rec(R.STEP_MEAN)}"),
            instant=True,
            table_format=True,
        ),
        q(
            late_rows(f"max by (job, rank, cause) ({sel(cfg, M.STRAGGLER_CAUSE.name, JOB)})"),
            instant=True,
            table_format=True,
        ),
        q(
            late_rows(f"max by (job, rank, name, pci_bus_id) ({sel(cfg, M.GPU_INFO.name, JOB)})"),
            instant=True,
            table_format=True,
        ),
        q(
            late_rows(
                "time() - max by (job, rank, local_rank) "
                f"({sel(cfg, M.RANK_LAST_REPORT_TIMESTAMP_SECONDS.name, JOB)})"
            ),
            instant=True,
            table_format=True,
        ),
    ]
    for phase in TRIAGE_PHASES:
        per_step = phase_per_step(cfg, window, f'phase="{phase.label}"')
        targets.append(
            q(
                late_rows(f"({per_step})" + median.format(f"({per_step})")),
                instant=True,
                table_format=True,
            )
        )
    targets += [
        q(
            late_rows(on_straggler(straggler_alert_age(), "alertstate")),
            instant=True,
            table_format=True,
        ),
        q(late_rows(on_straggler(idle_gpus_from_skew())), instant=True, table_format=True),
    ]
    return targets


def _triage_rename() -> dict[str, str]:
    phase_refs = "FGHIJ"[: len(TRIAGE_PHASES)]
    alert_ref, cost_ref = "KL"
    rename = {
        "rank": "Rank",
        "node": "Node",
        "name": "GPU",
        "pci_bus_id": "PCI bus",
        "local_rank": "Local rank",
        "cause": "Cause",
        "Value #A": "Late by",
        "Value #B": "Of a step",
        **{
            f"Value #{ref}": PHASE_COLUMNS[p]
            for ref, p in zip(phase_refs, TRIAGE_PHASES, strict=True)
        },
        "alertstate": "Alert",
        f"Value #{alert_ref}": "Alert for",
        f"Value #{cost_ref}": "Cost",
        "Value #E": "Last report",
    }
    return rename


def _triage_links() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A rank's and a node's links: to this dashboard and to Fabric and locality."""
    rank_links = [
        link(
            "Rank ${__value.raw}: this dashboard for that rank",
            f"/d/{OVERVIEW_UID}?var-job=${{job}}&var-rank=${{__value.raw}}&{KEEP}",
        ),
        link(
            "Rank ${__value.raw} on Fabric and locality",
            f"/d/{FABRIC_UID}?var-job=${{job}}&var-rank=${{__value.raw}}&{KEEP}",
        ),
    ]
    node_links = [
        link(
            "Node ${__value.raw} on Fabric and locality",
            f"/d/{FABRIC_UID}?var-job=${{job}}&var-node=${{__value.raw}}&{KEEP}",
        ),
        link(
            "Node ${__value.raw}: this dashboard for its ranks",
            f"/d/{OVERVIEW_UID}?var-job=${{job}}&var-node=${{__value.raw}}&{KEEP}",
        ),
    ]
    return rank_links, node_links


def _triage_columns(straggler: float) -> dict[str, list[dm.DynamicConfigValue]]:
    rank_links, node_links = _triage_links()
    seconds = [prop("unit", "s"), prop("decimals", 1)]
    columns: dict[str, list[dm.DynamicConfigValue]] = {
        "Rank": [prop("links", rank_links)],
        "Node": [prop("links", node_links)],
        "Late by": [
            *seconds,
            prop(
                "description",
                "Seconds per step this rank reaches collectives after the "
                "job's earliest rank (averaged over the straggler window).",
            ),
        ],
        "Of a step": [
            prop("unit", "percentunit"),
            prop(
                "thresholds",
                {
                    "mode": "absolute",
                    "steps": [
                        {"value": None, "color": "green"},
                        {"value": straggler, "color": "orange"},
                    ],
                },
            ),
            prop("custom.cellOptions", {"type": "color-background"}),
        ],
        **{
            PHASE_COLUMNS[p]: [
                *seconds,
                prop(
                    "description",
                    f"This rank's seconds per step in {p.label} minus the job's median rank's.",
                ),
            ]
            for p in TRIAGE_PHASES
        },
        "Alert": [
            prop(
                "mappings",
                [
                    {
                        "type": "value",
                        "options": {
                            "firing": {"text": "firing", "color": "red", "index": 0},
                            "pending": {"text": "pending", "color": "orange", "index": 1},
                        },
                    }
                ],
            ),
            prop("custom.cellOptions", {"type": "color-text"}),
        ],
        "Alert for": [
            prop("unit", "dtdurations"),
            prop("description", "Since when SyncscopeStraggler is active (pending or firing)."),
        ],
        "Cost": [
            prop("unit", "suffix: GPU-h/h"),
            prop("decimals", 2),
            prop(
                "description",
                "GPU-hours per hour the other ranks spend waiting for this "
                "one: their leads over it per step, summed, times steps per second.",
            ),
        ],
        "Last report": [prop("unit", "s"), prop("decimals", 0)],
    }
    return columns


def triage(cfg: Mapping[str, Any]) -> list[tuple[int, int, Any]]:
    return [
        (24, 8, triage_table(cfg)),
        (
            6,
            4,
            stat_panel(
                "Idle GPU-hours per hour",
                "GPUs idle waiting at collectives for the last peer, on average: the "
                "synchronization-amplification ratio times the world size (transient waits "
                "included). What the job loses, in GPU-hours per hour.",
                [q(f"{rec(R.SYNC_AMPLIFICATION)}\n* on (job)\n  {rec(R.WORLD_SIZE)}", "{{job}}")],
                "suffix: GPU-h/h",
                thresholds=steps((1, "orange")),
            ),
        ),
        (
            6,
            4,
            stat_panel(
                "Throughput against the last hour's best",
                "Steps per second now over the highest rate of the last hour: below 100 % the "
                "job runs slower than it did itself.",
                [
                    q(
                        f"{rec(R.STEPS_RATE)}\n/ on (job)\n  "
                        f"(max_over_time({rec(R.STEPS_RATE)}[1h]) > 0)",
                        "{{job}}",
                    )
                ],
                "percentunit",
                thresholds=steps((0.8, "orange"), (0.95, "green"), base="red"),
            ),
        ),
        (
            6,
            4,
            stat_panel(
                "Straggler alert active for",
                "Time since SyncscopeStraggler became active (pending or firing) for this job; "
                "the Late ranks table says which state it is in.",
                # One series whatever its state: pending then firing are two series of ALERTS,
                # and the stat would keep showing the pending one's last value.
                [
                    q(
                        "time() - max by (job) "
                        f'(ALERTS_FOR_STATE{{alertname="SyncscopeStraggler", {JOB}}})',
                        "{{job}}",
                    )
                ],
                "dtdurations",
                thresholds=steps(base="orange"),
                no_value="not active",
            ),
        ),
        (
            6,
            4,
            stat_panel(
                "Ranks reporting",
                "Ranks whose records reach an exporter, against the world size the ranks "
                "report. Fewer reporting: see SyncscopeRankSilent.",
                [
                    q(rec(R.RANKS_REPORTING), "reporting"),
                    q(rec(R.WORLD_SIZE), "world size"),
                ],
                "none",
            ),
        ),
    ]


# ------------------------------------------------------------------------------ dashboards


def variables(cfg: Mapping[str, Any]) -> list[Any]:
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
            f"label_values({R.STEPS_RATE}, job)",
            dm.VariableSort.ALPHABETICAL_ASC,
        )
        .multi(False)
        .include_all(False),
        query_var(
            "node",
            "Node",
            f"label_values({rec(R.SYNC_PER_STEP)}, node)",
            dm.VariableSort.ALPHABETICAL_ASC,
        )
        .multi(True)
        .include_all(True)
        .all_value(NODE_ALL)
        .current(everything),
        query_var(
            "rank",
            "Rank",
            f"label_values({rec(R.SYNC_PER_STEP, NODE)}, rank)",
            dm.VariableSort.NUMERICAL_ASC,
        )
        .multi(True)
        .include_all(True)
        .all_value(RANK_ALL)
        .current(everything),
    ]


# Annotations on both dashboards: Prometheus annotation queries (Grafana reads expr, step,
# titleFormat, textFormat, tagKeys from the annotation itself; the SDK writes only expr).
def annotation_specs(cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    step = ANNOTATION_STEP
    steps_total = sel(cfg, M.STEPS_TOTAL.name, JOB)
    start = f"{M.EXPORTER_START_TIME_SECONDS.name}{{{cfg['selectors']['exporter']}}}"
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


def job_overview(cfg: Mapping[str, Any]) -> list[tuple[str, list[tuple[int, int, Any]]]]:
    """Rows of (width, height, panel): triage first, then the paper's failure modes."""
    straggler = cfg["alerts"]["SyncscopeStraggler"]["levels"][0]["threshold"]
    diagnosis = cfg["diagnosis"]["verdict_score"]
    phases = M.PHASE_SECONDS_TOTAL.name
    busy = ratio_per_rank(
        cfg, (phases, ('phase!~"comm_exposed|pacing"',)), (M.STEPS_TOTAL.name, ())
    )
    exposed = ratio_per_rank(cfg, (phases, ('phase="comm_exposed"',)), (phases, ()))
    selected = sel(cfg, phases, JOB, NODE, RANK)
    selected_steps = sel(cfg, M.STEPS_TOTAL.name, JOB, NODE, RANK)
    by_phase = (
        f"sum by (phase) (rate({selected}[{RATE}]))\n/ on () group_left ()\n"
        f"  (sum(rate({selected_steps}[{RATE}])) > 0)"
    )
    every_rank_phase = (
        f"sum by ({BY_RANK}, phase) (rate({sel(cfg, phases, JOB)}[{RATE}]))\n"
        f"/ ignoring (phase) group_left ()\n"
        f"  (sum by ({BY_RANK}) (rate({sel(cfg, M.STEPS_TOTAL.name, JOB)}[{RATE}])) > 0)"
    )
    engagements = ratio_per_rank(
        cfg, (M.PACING_ENGAGEMENTS_TOTAL.name, ()), (M.STEPS_TOTAL.name, ())
    )
    dropped = ratio_per_rank(
        cfg, (M.AGENT_RECORDS_DROPPED_TOTAL.name, ()), (M.STEPS_TOTAL.name, ())
    )
    exporter = cfg["selectors"]["exporter"]
    return [
        _overview_triage_which_ranks_are_late(cfg),
        _overview_job_health(cfg, straggler=straggler),
        _overview_step_time_and_phases(
            cfg, busy=busy, exposed=exposed, by_phase=by_phase, every_rank_phase=every_rank_phase
        ),
        _overview_where_the_job_waits(cfg),
        _overview_synchronization(cfg, straggler=straggler, diagnosis=diagnosis),
        _overview_pacing(cfg, engagements=engagements),
        _overview_alerts_agents_and_exporters(cfg, dropped=dropped, exporter=exporter),
    ]


def _overview_triage_which_ranks_are_late(
    cfg: Mapping[str, Any],
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Triage: which ranks are late, where, why, since when, at what cost."""
    return ("Triage: which ranks are late, where, why, since when, at what cost", triage(cfg))


def _overview_job_health(
    cfg: Mapping[str, Any], *, straggler: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Job health."""
    return (
        "Job health",
        [
            (
                4,
                4,
                stat_panel(
                    "Throughput",
                    "Steps per second, averaged over the job's ranks.",
                    [q(rec(R.STEPS_RATE), "{{job}}")],
                    "suffix: steps/s",
                ),
            ),
            (
                4,
                4,
                stat_panel(
                    "Mean step time",
                    "Mean wall time of a step over all ranks.",
                    [q(rec(R.STEP_MEAN), "{{job}}")],
                    "s",
                ),
            ),
            (
                4,
                4,
                stat_panel(
                    "Step-time CV",
                    f"Coefficient of variation of step time over the last {STEP_WINDOW} steps, "
                    "noisiest rank. Orange/red at the SyncscopeStepTimeCVHigh levels.",
                    [q(rec(R.STEP_CV), "{{job}}")],
                    "none",
                    thresholds=alert_steps(cfg, "SyncscopeStepTimeCVHigh"),
                ),
            ),
            (
                4,
                4,
                stat_panel(
                    "Sync amplification",
                    "Share of rank time spent waiting at collectives for the "
                    "last peer (paper §3.3). Orange at the SyncscopeSyncAmplification threshold.",
                    [q(rec(R.SYNC_AMPLIFICATION), "{{job}}")],
                    "percentunit",
                    thresholds=alert_steps(cfg, "SyncscopeSyncAmplification"),
                ),
            ),
            (
                4,
                4,
                stat_panel(
                    "Exposed communication",
                    "Share of step time in communication that backward did not hide.",
                    [q(rec(R.COMM_EXPOSED_RATIO), "{{job}}")],
                    "percentunit",
                ),
            ),
            (
                4,
                4,
                stat_panel(
                    "Arrival skew",
                    "Latest minus earliest rank, as a share of the mean step (orange from "
                    "the SyncscopeStraggler threshold).",
                    [q(rec(R.SKEW_RATIO), "{{job}}")],
                    "percentunit",
                    thresholds=steps((straggler, "orange")),
                ),
            ),
        ],
    )


def _overview_step_time_and_phases_1(
    cfg: Mapping[str, Any], *, busy: Any, by_phase: Any, every_rank_phase: Any
) -> list[tuple[int, int, Any]]:
    """Overview row "Step time and phases", panels, part 1."""
    return [
        (
            12,
            8,
            ts(
                "Step time",
                "Mean and quantiles of step wall time, job-wide (every node's "
                "step-duration histogram pooled).",
                [
                    q(rec(R.STEP_MEAN), "mean"),
                    q(rec(R.STEP_QUANTILE), "p{{quantile}}"),
                ],
                "s",
            ),
        ),
        (
            12,
            8,
            ts(
                "Busy time per step: the slowest ranks",
                f"Each rank's seconds per step outside exposed communication and "
                f"pacing (its phases' sum less the time it waits), for the {TOP} "
                "selected ranks highest over the time range, against the job's median "
                "and 10th-90th percentile band. A straggler sits above the band.",
                ranks_that_stand_out(busy),
                "s",
                band=True,
            ),
        ),
        (
            8,
            8,
            ts(
                "Phase shares",
                "Share of step wall time per phase, job-wide; they add up to 1.",
                [q(rec(R.PHASE_RATIO), "{{phase}}")],
                "percentunit",
                stack=True,
                max_val=1,
            ),
        ),
        (
            8,
            8,
            ts(
                "Phases of the selected ranks",
                "Seconds per step in each phase, averaged over the selected ranks "
                "(pick a rank or a node above; All: the whole job).",
                [q(by_phase, "{{phase}}")],
                "s",
                stack=True,
            ),
        ),
        (
            8,
            8,
            ts(
                "Phases of the selected ranks against the job's median rank",
                "The selected ranks' seconds per step in each phase minus the job's "
                "median rank's: a straggler's slow phase is above zero, its exposed "
                "communication below (it waits least).",
                [
                    q(
                        f"{by_phase}\n- on (phase)\n  "
                        f"quantile by (phase) (0.5, {every_rank_phase})",
                        "{{phase}}",
                    )
                ],
                "s",
                min_val=None,
            ),
        ),
    ]


def _overview_step_time_and_phases_2(
    cfg: Mapping[str, Any], *, exposed: Any
) -> list[tuple[int, int, Any]]:
    """Overview row "Step time and phases", panels, part 2."""
    return [
        (
            12,
            8,
            ts(
                "Step-time CV: the noisiest ranks",
                f"The {TOP} selected ranks with the highest coefficient of variation "
                "over the time range, and the job's median and band. Dashed lines: "
                "the SyncscopeStepTimeCVHigh levels.",
                ranks_that_stand_out(gauge_per_rank(cfg, M.STEP_TIME_CV.name)),
                "none",
                thresholds=alert_steps(cfg, "SyncscopeStepTimeCVHigh"),
                band=True,
            ),
        ),
        (
            12,
            8,
            ts(
                "Exposed communication: the ranks that wait least",
                "Share of each rank's wall time in exposed communication, for the "
                f"{TOP} selected ranks lowest over the time range, and the job's median "
                "and band. The straggler has the least: the others wait for it.",
                ranks_that_stand_out(exposed, lowest=True),
                "percentunit",
                band=True,
            ),
        ),
    ]


def _overview_step_time_and_phases(
    cfg: Mapping[str, Any], *, busy: Any, exposed: Any, by_phase: Any, every_rank_phase: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Step time and phases."""
    return (
        "Step time and phases",
        [
            *_overview_step_time_and_phases_1(
                cfg, busy=busy, by_phase=by_phase, every_rank_phase=every_rank_phase
            ),
            *_overview_step_time_and_phases_2(cfg, exposed=exposed),
        ],
    )


def _overview_where_the_job_waits(
    cfg: Mapping[str, Any],
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Where the job waits: process groups and the wait chain."""
    return (
        "Where the job waits: process groups and the wait chain",
        [
            (
                12,
                8,
                ts(
                    "Rank-time lost per process group",
                    "Share of the job's rank-time each process group's collectives take "
                    "beyond the rank that spends least in them (groups by their mesh "
                    f"dimension: dp, tp, pp, shard, ...), over {cfg['windows']['straggler']}. "
                    "Where a tensor- or pipeline-parallel job loses its time.",
                    [q(rec(R.GROUP_WAIT), "{{group}}")],
                    "percentunit",
                    stack=True,
                ),
            ),
            (
                12,
                8,
                table_panel(
                    "Who waits for whom",
                    f"While a straggler is named: the {TRIAGE_ROWS} ranks that wait most, "
                    "the group each waits in most and the rank it waits for there (empty: "
                    "a rank its exporter does not see), seconds per step. Follow Waits for "
                    "to the straggler.",
                    [
                        q(
                            f"topk({TRIAGE_ROWS}, {sel(cfg, M.VICTIM_WAIT_SECONDS.name, JOB)})",
                            instant=True,
                            table_format=True,
                        )
                    ],
                    unit="s",
                    hide=("Time", "job", "__name__", "instance"),
                    rename={
                        "rank": "Rank",
                        "node": "Node",
                        "group": "Group",
                        "waits_for": "Waits for",
                        "Value": "Wait per step",
                    },
                    sort=("Value", True),
                ),
            ),
        ],
    )


def _overview_synchronization(
    cfg: Mapping[str, Any], *, straggler: Any, diagnosis: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Synchronization."""
    return (
        "Synchronization",
        [
            (
                12,
                8,
                ts(
                    "Amplification, exposed communication, pacing",
                    "Job-wide shares of rank time. Dashed line: the SyncscopeSyncAmplification threshold.",
                    [
                        q(rec(R.SYNC_AMPLIFICATION), "waiting for peers"),
                        q(rec(R.COMM_EXPOSED_RATIO), "exposed communication"),
                        q(rec(R.PACING_RATIO), "pacing delay"),
                    ],
                    "percentunit",
                    thresholds=alert_steps(cfg, "SyncscopeSyncAmplification"),
                ),
            ),
            (
                12,
                8,
                ts(
                    "Arrival lead: the latest ranks",
                    "How early each rank reaches collectives compared with the last one, "
                    f"job-wide (seconds per step, over {cfg['windows']['straggler']}), for the "
                    f"{TOP} selected ranks lowest over the time range, and the job's median "
                    "and band. The straggler sits at zero.",
                    ranks_that_stand_out(
                        gauge_per_rank(cfg, R.LEAD_AVG, recorded=True), lowest=True
                    ),
                    "s",
                    band=True,
                ),
            ),
            (
                12,
                8,
                ts(
                    "Arrival skew",
                    "Latest minus earliest rank, as a share of the mean step. Dashed "
                    "line: the SyncscopeStraggler threshold.",
                    [q(rec(R.SKEW_RATIO), "{{job}}")],
                    "percentunit",
                    thresholds=steps((straggler, "orange")),
                ),
            ),
            (
                12,
                8,
                bargauge.Panel()
                .title("Diagnosis")
                .description(
                    "The exporters' local score (0..1) for each failure mode of paper "
                    "§3.3, highest over the job's exporters."
                )
                .datasource(DS)
                .unit("percentunit")
                .min(0)
                .max(1)
                .thresholds(steps((diagnosis, "orange")))
                .with_target(
                    q(
                        f"max by (mode) ({sel(cfg, M.DIAGNOSIS.name, JOB)})",
                        "{{mode}}",
                        instant=True,
                    ).ref_id("A")
                ),
            ),
        ],
    )


def _overview_pacing(
    cfg: Mapping[str, Any], *, engagements: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Pacing."""
    return (
        "Pacing",
        [
            (
                8,
                8,
                ts(
                    "Ranks paced",
                    "Share of the job's ranks whose pacing controller is delaying them "
                    "now (paper §4.3, §5.3). Engaged without a break for long: see "
                    "SyncscopePacingEngagedLong.",
                    [
                        q(
                            f"{rec(R.PACING_ACTIVE)}\n/ on (job)\n  {rec(R.WORLD_SIZE)}",
                            "ranks paced",
                        )
                    ],
                    "percentunit",
                    max_val=1,
                ),
            ),
            (
                8,
                8,
                ts(
                    "Pacing delay: the most delayed ranks",
                    f"Current delay of the {TOP} selected ranks delayed most over the "
                    "time range, the job's median delay and median engage threshold.",
                    [
                        *ranks_that_stand_out(
                            gauge_per_rank(cfg, M.PACING_CURRENT_DELAY_SECONDS.name),
                            band=False,
                        ),
                        q(
                            "quantile by (job) (0.5, "
                            f"{sel(cfg, M.PACING_CURRENT_DELAY_SECONDS.name, JOB)})",
                            "median",
                        ),
                        q(
                            "quantile by (job) (0.5, "
                            f"{sel(cfg, M.PACING_THRESHOLD_SECONDS.name, JOB)})",
                            "median threshold",
                        ),
                    ],
                    "s",
                ),
            ),
            (
                8,
                8,
                ts(
                    "Pacing engagements per step",
                    f"Engagements per step of the {TOP} selected ranks engaging most "
                    "often over the time range, and the job's median and band.",
                    ranks_that_stand_out(engagements),
                    "short",
                    band=True,
                ),
            ),
        ],
    )


def _overview_alerts_agents_and_exporters_1(
    cfg: Mapping[str, Any], *, dropped: Any
) -> list[tuple[int, int, Any]]:
    """Overview row "Alerts, agents and exporters", panels, part 1."""
    return [
        (
            12,
            8,
            table_panel(
                "Active syncscope alerts",
                "Pending and firing syncscope alerts (ALERTS) and how long each has "
                "been active (ALERTS_FOR_STATE).",
                [
                    q(
                        f'ALERTS{{alertname=~"{ALERT_PREFIX}.+"}}',
                        instant=True,
                        table_format=True,
                    ),
                    q(
                        f'time() - ALERTS_FOR_STATE{{alertname=~"{ALERT_PREFIX}.+"}}',
                        instant=True,
                        table_format=True,
                    ),
                ],
                hide=("Time", "__name__", "Value #A"),
                rename={
                    "alertname": "Alert",
                    "severity": "Severity",
                    "alertstate": "State",
                    "job": "Job",
                    "Value #B": "Active for",
                },
                sort=("Value #B", True),
                columns={
                    "Active for": [prop("unit", "dtdurations")],
                    "State": [
                        prop(
                            "mappings",
                            [
                                {
                                    "type": "value",
                                    "options": {
                                        "firing": {"color": "red", "index": 0},
                                        "pending": {"color": "orange", "index": 1},
                                    },
                                }
                            ],
                        ),
                        prop("custom.cellOptions", {"type": "color-text"}),
                    ],
                },
            ),
        ),
        (
            12,
            8,
            ts(
                "Records dropped and rejected",
                f"Agent records dropped per step by the {TOP} selected ranks dropping "
                "most (exporter slow or unreachable), and records the exporters "
                "rejected and ingested per second.",
                [
                    *ranks_that_stand_out(dropped, "dropped/step rank {{rank}}", band=False),
                    q(
                        f"sum by (reason) (rate({M.EXPORTER_INGEST_REJECTED_TOTAL.name}[{RATE}]))",
                        "rejected/s {{reason}}",
                    ),
                    q(
                        f"sum(rate({M.EXPORTER_INGEST_RECORDS_TOTAL.name}[{RATE}]))",
                        "ingested/s",
                    ),
                ],
                "short",
            ),
        ),
    ]


def _overview_alerts_agents_and_exporters_2(
    cfg: Mapping[str, Any], *, exporter: Any
) -> list[tuple[int, int, Any]]:
    """Overview row "Alerts, agents and exporters", panels, part 2."""
    return [
        (
            8,
            6,
            table_panel(
                "Exporters",
                "Scrape success of the syncscope exporters, down ones first (at most "
                f"{MAX_SERIES} listed).",
                [
                    q(
                        f"bottomk({MAX_SERIES}, up{{{exporter}}})",
                        instant=True,
                        table_format=True,
                    )
                ],
                hide=("Time", "__name__", "job"),
                rename={"instance": "Exporter", "Value": "Scrape"},
                sort=("Value", False),
                mappings=value_map((0, "down", "red"), (1, "up", "green")),
                thresholds=steps((1, "green"), base="red"),
            ),
        ),
        (
            8,
            6,
            stat_panel(
                "Collectors succeeding",
                "Whether each exporter collector succeeded at the last scrape, on "
                "every exporter (failing: on at least one).",
                [
                    q(
                        f"min by (collector) ({M.EXPORTER_COLLECTOR_SUCCESS.name})",
                        "{{collector}}",
                    )
                ],
                "none",
                mappings=value_map((0, "failing", "red"), (1, "ok", "green")),
                thresholds=steps((1, "green"), base="red"),
            ),
        ),
        (
            8,
            6,
            ts(
                "Collector duration",
                "Time each exporter collector took at scrape time, slowest exporter.",
                [
                    q(
                        f"max by (collector) ({M.EXPORTER_COLLECTOR_DURATION_SECONDS.name})",
                        "{{collector}}",
                    )
                ],
                "s",
            ),
        ),
    ]


def _overview_alerts_agents_and_exporters(
    cfg: Mapping[str, Any], *, dropped: Any, exporter: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Overview row: Alerts, agents and exporters."""
    return (
        "Alerts, agents and exporters",
        [
            *_overview_alerts_agents_and_exporters_1(cfg, dropped=dropped),
            *_overview_alerts_agents_and_exporters_2(cfg, exporter=exporter),
        ],
    )


def fabric_locality(cfg: Mapping[str, Any]) -> list[tuple[str, list[tuple[int, int, Any]]]]:
    """Rows for the fabric and GPU-locality failure modes: bandwidth, contention, skew, topology."""
    node_coll = lambda m: sel(cfg, m, JOB, NODE)  # noqa: E731 - per node, per op and group
    seconds, wait = (
        node_coll(M.COLLECTIVE_SECONDS_TOTAL.name),
        node_coll(M.COLLECTIVE_WAIT_SECONDS_TOTAL.name),
    )
    by_node = "job, node"

    def per_node(name: str) -> PerRank:
        def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
            s = rec(name, *matchers)
            inner = s if window is None else f"avg_over_time({s}[{window}]{at})"
            return f"max by ({by_node}) ({inner})"

        return expr

    def per_group(name: str) -> PerRank:
        def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
            s = rec(name, *matchers)
            inner = s if window is None else f"avg_over_time({s}[{window}]{at})"
            return f"max by (job, op, group) ({inner})"

        return expr

    def groups(name: str, *, lowest: bool = False) -> list[Any]:
        return ranks_that_stand_out(
            per_group(name),
            "{{op}} {{group}}",
            k=10,
            lowest=lowest,
            band=False,
            by="job, op, group",
            matchers=(),
        )

    def nodes(name: str, *, lowest: bool = False) -> list[Any]:
        return ranks_that_stand_out(
            per_node(name), "{{node}}", lowest=lowest, by=by_node, matchers=(NODE,)
        )

    lead = gauge_per_rank(cfg, R.LEAD_AVG, recorded=True)
    waiting = ratio_lead_per_step()
    gpu_rank = lambda m: gauge_per_rank(cfg, m)  # noqa: E731
    # The Topology table's rows: 20 selected ranks with a GPU, those with locality faults
    # first (LOCALITY_FAULT has series only where a GPU has a fault: healthy ranks count 0).
    topology_rows = (
        f"topk(20,\n    sum by (job, rank) ({rec(R.LOCALITY_FAULT, NODE, RANK)})\n  or\n"
        f"    0 * max by (job, rank) ({sel(cfg, M.GPU_INFO.name, JOB, NODE, RANK)})\n  )"
    )

    def topology(metric: str) -> Any:
        return q(
            f"max by ({BY_RANK}) ({sel(cfg, metric, JOB, NODE, RANK)})\n"
            f"and on (job, rank)\n  {topology_rows}",
            instant=True,
            table_format=True,
        )

    info = (
        f"max by ({BY_RANK}, name, pci_bus_id, numa_node, nic, nic_distance) "
        f"({sel(cfg, M.GPU_INFO.name, JOB, NODE, RANK)})\nand on (job, rank)\n  {topology_rows}"
    )
    return [
        _fabric_slow_link_and_contention(cfg, nodes=nodes),
        _fabric_collectives(cfg, seconds=seconds, wait=wait, groups=groups),
        _fabric_arrival_skew(cfg, lead=lead, waiting=waiting),
        _fabric_gpu_locality(cfg, gpu_rank=gpu_rank, topology=topology, info=info),
    ]


def _fabric_slow_link_and_contention_1(
    cfg: Mapping[str, Any], *, nodes: Any
) -> list[tuple[int, int, Any]]:
    """Fabric row "Fabric: slow link and contention", panels, part 1."""
    return [
        (
            8,
            8,
            ts(
                "Link capacity: the slowest nodes",
                "What each node's link is known to carry each way (negotiated speed, "
                f"or a shaping of it), as its ranks read it at start: the {TOP} selected "
                "nodes lowest, and the job's median and band. In a synchronous "
                "collective the job moves at the pace of the lowest.",
                nodes(R.LINK_CAPACITY, lowest=True),
                "Bps",
                band=True,
            ),
        ),
        (
            8,
            8,
            ts(
                "Slow link: capacity against the job's median node",
                "Each node's link capacity over the median node's, for the "
                f"{TOP} selected nodes lowest. Dashed line: the SyncscopeSlowLink "
                "threshold; a node under it is the slow link.",
                nodes(R.LINK_CAPACITY_RATIO, lowest=True),
                "percentunit",
                thresholds=steps(
                    (cfg["alerts"]["SyncscopeSlowLink"]["levels"][0]["threshold"], "green"),
                    base="red",
                ),
                band=True,
            ),
        ),
        (
            8,
            8,
            ts(
                "Link utilisation while the job transfers: the busiest nodes",
                "Each node's link throughput over the time the job spends in its "
                "transfer, as a share of the link's capacity, for the "
                f"{TOP} selected nodes highest: the slow link sits near 100 % while "
                "the others idle.",
                nodes(R.LINK_UTILIZATION),
                "percentunit",
                band=True,
            ),
        ),
        (
            8,
            8,
            ts(
                "DDP bus bandwidth",
                "Gradient bytes per step over the job's transfer per step (the exposed "
                "sync after the last rank arrives), with nccl-tests' all-reduce factor "
                "2(n−1)/n.",
                [q(rec(R.DDP_BUS_BANDWIDTH), "{{job}}")],
                "Bps",
            ),
        ),
        (
            8,
            8,
            ts(
                "Transfer per step",
                "The job's transfer per step (after its last rank arrives), from the "
                "steps every node samples alike.",
                [q(rec(R.TRANSFER_PER_STEP), "{{job}}")],
                "s",
            ),
        ),
    ]


def _fabric_slow_link_and_contention_2(cfg: Mapping[str, Any]) -> list[tuple[int, int, Any]]:
    """Fabric row "Fabric: slow link and contention", panels, part 2."""
    return [
        (
            8,
            8,
            ts(
                "Transfer inflation (contention window)",
                "The recent transfer per step over its own 10th percentile in the "
                "baseline window: contention while it is above the dashed "
                "SyncscopeFabricContention threshold. A link slow from the start stays "
                "near 1 here and shows as the slow link instead.",
                [q(rec(R.TRANSFER_INFLATION), "{{job}}")],
                "none",
                thresholds=alert_steps(cfg, "SyncscopeFabricContention"),
            ),
        ),
    ]


def _fabric_slow_link_and_contention(
    cfg: Mapping[str, Any], *, nodes: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Fabric row: Fabric: slow link and contention."""
    return (
        "Fabric: slow link and contention",
        [
            *_fabric_slow_link_and_contention_1(cfg, nodes=nodes),
            *_fabric_slow_link_and_contention_2(cfg),
        ],
    )


def _fabric_collectives(
    cfg: Mapping[str, Any], *, seconds: Any, wait: Any, groups: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Fabric row: Collectives."""
    return (
        "Collectives",
        [
            (
                12,
                8,
                ts(
                    "Bus bandwidth by op: the slowest groups",
                    "Achieved bus bandwidth (nccl-tests convention) from bytes and the "
                    "transfer part of durations, for the 10 op/group pairs lowest over the "
                    "time range; DDP's gradient sync is exposed time only and not shown.",
                    groups(R.BUS_BANDWIDTH, lowest=True),
                    "Bps",
                ),
            ),
            (
                12,
                8,
                ts(
                    "Transfer vs wait by op",
                    "Rank-seconds per second in collectives on the selected nodes: "
                    "transfer (duration minus wait) and waiting for the last peer.",
                    [
                        q(
                            f"sum by (op) (rate({seconds}[{RATE}])) - sum by (op) (rate({wait}[{RATE}]))",
                            "{{op}} transfer",
                        ),
                        q(f"sum by (op) (rate({wait}[{RATE}]))", "{{op}} wait"),
                    ],
                    "s",
                    stack=True,
                ),
            ),
            (
                12,
                8,
                ts(
                    "Transfer time per call: the slowest groups",
                    "Transfer part of one call, job-wide, for the 10 op/group pairs "
                    "highest over the time range.",
                    groups(R.TRANSFER_PER_CALL),
                    "s",
                ),
            ),
            (
                12,
                8,
                ts(
                    "Contention index: the most contended groups",
                    "Transfer per call (per step for DDP's gradient sync) over its own "
                    "10th percentile in the baseline window, for the 10 op/group pairs "
                    "highest over the time range; calls other than DDP's only while arrival "
                    "skew is low. Dashed line: the SyncscopeFabricContention threshold.",
                    groups(R.CONTENTION),
                    "none",
                    thresholds=alert_steps(cfg, "SyncscopeFabricContention"),
                ),
            ),
        ],
    )


def _fabric_arrival_skew(
    cfg: Mapping[str, Any], *, lead: Any, waiting: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Fabric row: Arrival skew."""
    return (
        "Arrival skew",
        [
            (
                12,
                9,
                heatmap.Panel()
                .title("Arrival lead: the 20 latest ranks")
                .description(
                    "One row per rank for the 20 selected ranks that arrive latest over the "
                    "time range, colour = how early each reaches collectives; the "
                    "straggler's row stays cold (zero is drawn, not filtered out)."
                )
                .datasource(DS)
                .calculate(False)
                .filter_values(heatmap.FilterValueRange().le(-1e-9))
                .unit("s")
                .with_target(
                    ranks_that_stand_out(lead, "{{rank}}", k=20, lowest=True, band=False)[0].ref_id(
                        "A"
                    )
                ),
            ),
            (
                12,
                9,
                ts(
                    "Waiting for the last rank: who waits most",
                    "Each rank's collective time per step beyond the rank that waits least "
                    f"(its lead over the straggler), as a share of the mean step, for the "
                    f"{TOP} selected ranks highest, and the job's median and band.",
                    ranks_that_stand_out(waiting),
                    "percentunit",
                    band=True,
                ),
            ),
            (
                24,
                6,
                ts(
                    "Arrival skew",
                    "Latest minus earliest rank (seconds) over the straggler window.",
                    [q(rec(R.SKEW), "{{job}}")],
                    "s",
                ),
            ),
        ],
    )


def _fabric_gpu_locality_1(
    cfg: Mapping[str, Any], *, gpu_rank: Any, topology: Any, info: Any
) -> list[tuple[int, int, Any]]:
    """Fabric row "GPU locality", panels, part 1."""
    return [
        (
            16,
            8,
            table_panel(
                "Topology",
                "GPU, NIC, PCIe link (current vs max), NVLink and NUMA placement of the "
                "selected ranks, those with locality faults first (20 at most).",
                [
                    q(info, instant=True, table_format=True),
                    topology(M.GPU_PCIE_LINK_WIDTH.name),
                    topology(M.GPU_PCIE_LINK_MAX_WIDTH.name),
                    topology(M.GPU_PCIE_LINK_GENERATION.name),
                    topology(M.GPU_PCIE_LINK_MAX_GENERATION.name),
                    topology(M.GPU_NVLINK_ACTIVE_LINKS.name),
                    topology(M.GPU_NUMA_MISMATCH.name),
                ],
                hide=("Time", "__name__", "job", "Value #A"),
                rename={
                    "node": "Node",
                    "rank": "Rank",
                    "name": "GPU",
                    "pci_bus_id": "PCI bus",
                    "numa_node": "NUMA node",
                    "nic": "NIC",
                    "nic_distance": "NIC distance",
                    "Value #B": "PCIe width",
                    "Value #C": "max width",
                    "Value #D": "PCIe gen",
                    "Value #E": "max gen",
                    "Value #F": "NVLink links",
                    "Value #G": "NUMA mismatch",
                },
                columns={
                    "NUMA mismatch": [
                        prop(
                            "mappings",
                            value_map_json((0, "ok", "green"), (1, "mismatch", "red")),
                        ),
                        prop("custom.cellOptions", {"type": "color-text"}),
                    ]
                },
            ),
        ),
        (
            8,
            8,
            table_panel(
                "Locality faults",
                "Faults present (PCIe below max width or generation, or NUMA mismatch: "
                f"SyncscopeLocalityFault) on the selected ranks, faults first ({MAX_SERIES} "
                "rows at most).",
                [
                    q(
                        f"topk({MAX_SERIES}, {rec(R.LOCALITY_FAULT, NODE, RANK)})",
                        instant=True,
                        table_format=True,
                    )
                ],
                hide=("Time", "__name__", "job"),
                rename={"node": "Node", "rank": "Rank", "fault": "Fault", "Value": "State"},
                sort=("Value", True),
                thresholds=steps((1, "red")),
                mappings=value_map((0, "ok", "green"), (1, "fault", "red")),
            ),
        ),
        (
            8,
            8,
            ts(
                "SM clock: the slowest GPUs",
                f"Streaming-multiprocessor clock of the {TOP} selected ranks lowest, and "
                "the job's median and band.",
                ranks_that_stand_out(gpu_rank(M.GPU_SM_CLOCK_HERTZ.name), lowest=True),
                "hertz",
                band=True,
            ),
        ),
    ]


def _fabric_gpu_locality_2(cfg: Mapping[str, Any], *, gpu_rank: Any) -> list[tuple[int, int, Any]]:
    """Fabric row "GPU locality", panels, part 2."""
    return [
        (
            8,
            8,
            ts(
                "Temperature: the hottest GPUs",
                f"GPU temperature of the {TOP} selected ranks highest, and the job's "
                "median and band.",
                ranks_that_stand_out(gpu_rank(M.GPU_TEMPERATURE_CELSIUS.name)),
                "celsius",
                band=True,
            ),
        ),
        (
            8,
            8,
            ts(
                "Power: the GPUs drawing most",
                f"GPU power draw of the {TOP} selected ranks highest, and the job's "
                "median and band.",
                ranks_that_stand_out(gpu_rank(M.GPU_POWER_WATTS.name)),
                "watt",
                band=True,
            ),
        ),
        (
            24,
            6,
            table_panel(
                "Throttle reasons",
                "NVML clock-throttle reason bitmask (0 = none) of the selected ranks, "
                "highest first (20 at most).",
                [
                    q(
                        f"topk(20, max by ({BY_RANK}) "
                        f"({sel(cfg, M.GPU_THROTTLE_REASONS.name, JOB, NODE, RANK)}))",
                        instant=True,
                        table_format=True,
                    )
                ],
                hide=("Time", "__name__", "job"),
                rename={"node": "Node", "rank": "Rank", "Value": "Reasons"},
                sort=("Value", True),
                thresholds=steps((1, "orange")),
            ),
        ),
    ]


def _fabric_gpu_locality(
    cfg: Mapping[str, Any], *, gpu_rank: Any, topology: Any, info: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Fabric row: GPU locality."""
    return (
        "GPU locality",
        [
            *_fabric_gpu_locality_1(cfg, gpu_rank=gpu_rank, topology=topology, info=info),
            *_fabric_gpu_locality_2(cfg, gpu_rank=gpu_rank),
        ],
    )


def ratio_lead_per_step() -> PerRank:
    """Each rank's lead over the latest rank (recorded) as a share of the job's mean step."""

    def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
        lead = rec(R.LEAD_AVG, *matchers)
        if window is not None:
            lead = f"avg_over_time({lead}[{window}]{at})"
            return f"max by ({BY_RANK}) ({lead})"
        return f"max by ({BY_RANK}) ({lead})\n/ on (job) group_left ()\n  {rec(R.STEP_MEAN)}"

    return expr


def value_map_json(*entries: tuple[float, str, str]) -> list[dict[str, Any]]:
    """value_map() as plain JSON, for a per-column override."""
    return [
        {
            "type": "value",
            "options": {
                f"{value:g}": {"text": text, "color": colour, "index": i}
                for i, (value, text, colour) in enumerate(entries)
            },
        }
    ]


def layout(
    panels: Sequence[tuple[int, int, Any]], y0: int
) -> tuple[list[tuple[Any, dm.GridPos]], int]:
    """Place panels in order, each at the lowest free spot (leftmost on ties): a tall panel
    followed by short ones gets them stacked beside it. Returns the positions and the next y."""
    skyline = [y0] * GRID_WIDTH
    placed = []
    for w, h, panel in panels:
        x = min(range(GRID_WIDTH - w + 1), key=lambda i: (max(skyline[i : i + w]), i))
        y = max(skyline[x : x + w])
        placed.append((panel, dm.GridPos(h=h, w=w, x=x, y=y)))
        skyline[x : x + w] = [y + h] * w
    return placed, max(skyline)


def build_dashboard(
    uid: str,
    title: str,
    description: str,
    cfg: Mapping[str, Any],
    rows: Callable[[Mapping[str, Any]], list[tuple[str, list[tuple[int, int, Any]]]]],
    links_to: tuple[str, str],
) -> dict[str, Any]:
    dash = (
        db.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .time("now-1h", "now")
        .refresh("30s")
        .timezone("browser")
        .tooltip(dm.DashboardCursorSync.CROSSHAIR)
        .link(
            db.DashboardLink(links_to[1])
            .type(dm.DashboardLinkType.LINK)
            .url(f"/d/{links_to[0]}")
            .include_vars(True)
            .keep_time(True)
        )
    )
    for variable in variables(cfg):
        dash = dash.with_variable(variable)
    specs = annotation_specs(cfg)
    for spec in specs:
        dash = dash.annotation(
            db.AnnotationQuery()
            .name(spec["name"])
            .datasource(DS)
            .enable(True)
            .hide(False)
            .icon_color(spec["iconColor"])
            .expr(spec["expr"])
        )
    # Explicit layout: the SDK's automatic placement can run a row past 24 columns.
    y, panel_id = 0, 1
    for row_title, panels in rows(cfg):
        dash = dash.with_row(
            db.Row(row_title).id(panel_id).grid_pos(dm.GridPos(h=1, w=GRID_WIDTH, x=0, y=y))
        )
        panel_id, y = panel_id + 1, y + 1
        placed, y = layout(panels, y)
        for panel, pos in placed:
            dash = dash.with_panel(panel.id(panel_id).grid_pos(pos))
            panel_id += 1
    data = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    for variable in data["templating"]["list"]:
        # The SDK writes interval-variable defaults onto every variable; Grafana's schema has
        # no such keys, and they mean nothing on a query or datasource variable.
        if variable["type"] != "interval":
            for key in ("auto", "auto_count", "auto_min"):
                variable.pop(key, None)
    by_name = {spec["name"]: spec for spec in specs}
    for annotation in data["annotations"]["list"]:
        spec = by_name[annotation["name"]]
        annotation.pop("builtIn", None)
        annotation.update({key: spec[key] for key in ANNOTATION_EXTRAS})
    return data


def dashboards(cfg: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    overview = build_dashboard(
        OVERVIEW_UID,
        "syncscope / Job overview",
        "Which ranks of a synchronous training job are late, on which node, why and at what "
        "cost; then throughput, step time and its variability, phases, synchronization "
        "amplification, pacing and syncscope's own health.",
        cfg,
        job_overview,
        (FABRIC_UID, "Fabric and locality"),
    )
    fabric = build_dashboard(
        FABRIC_UID,
        "syncscope / Fabric and locality",
        "Links by node, collective bus bandwidth, transfer vs wait, contention, arrival skew "
        "and GPU topology.",
        cfg,
        fabric_locality,
        (OVERVIEW_UID, "Job overview"),
    )
    return {OVERVIEW_UID: overview, FABRIC_UID: fabric}


# ------------------------------------------------------------------------------ query list


def rule_dependencies(cfg: Mapping[str, Any]) -> dict[str, set[str]]:
    """Recorded series -> the raw contract metrics it is computed from (transitively)."""
    direct: dict[str, set[str]] = {}
    for rule in R.recording_rules(cfg):
        direct.setdefault(rule["record"], set()).update(R.metric_names(rule["expr"]))
    resolved: dict[str, set[str]] = {}

    def resolve(name: str) -> set[str]:
        if name not in direct:
            return {name}
        if name not in resolved:
            resolved[name] = set().union(*(resolve(d) for d in direct[name] if d != name))
        return resolved[name]

    return {name: resolve(name) for name in direct}


# Recorded series that exclude DDP's gradient sync: empty for a job whose only collective is
# DDP's own (the contention index has DDP's part too).
NEEDS_COLLECTIVES = {R.BUS_BANDWIDTH, R.TRANSFER_PER_CALL}
NEEDS = ("gpu", "pacing", "straggler", "rejections", "alerts", "collectives", "link")
_ALERT_SERIES = re.compile(r"\bALERTS(_FOR_STATE)?\b")


def needs(expr: str, cfg: Mapping[str, Any]) -> list[str]:
    """What a query needs beyond a running job to return anything (the flags in queries.json).

    gpu / pacing / straggler / rejections: contract series that exist only with a GPU, with
    the pacing controller on, while the exporter names a straggler, or once it has rejected a
    record; alerts: ALERTS or ALERTS_FOR_STATE, only while an alert is pending or firing;
    collectives: collectives other than DDP's gradient sync; link: the ranks' link facts
    (agent/link.py).
    """
    conditions = R.series_conditions()
    deps = rule_dependencies(cfg)
    names = R.metric_names(expr)
    raw = set().union(*(deps.get(n, {n}) for n in names))
    found = {conditions.get(n, "always") for n in raw}
    if "ALERTS" in raw or _ALERT_SERIES.search(expr):
        found.add("alerts")
    if names & NEEDS_COLLECTIVES:
        found.add("collectives")
    return [flag for flag in NEEDS if flag in found]


def query_list(dashes: dict[str, dict[str, Any]], cfg: Mapping[str, Any]) -> list[dict[str, Any]]:
    out = []
    for uid, dash in dashes.items():
        for panel in dash["panels"]:
            for target in panel.get("targets", []):
                out.append(
                    {
                        "dashboard": uid,
                        "panel_id": panel["id"],
                        "panel": panel["title"],
                        "ref_id": target["refId"],
                        "expr": target["expr"],
                        "instant": bool(target.get("instant")),
                        "needs": needs(target["expr"], cfg),
                    }
                )
    return out


def render_files(cfg: Mapping[str, Any]) -> dict[str, str]:
    """File name -> text: each dashboard as ``<uid>.json`` and the query list."""
    dashes = dashboards(cfg)
    files = {
        f"{uid}.json": json.dumps(d, indent=2, sort_keys=True) + "\n" for uid, d in dashes.items()
    }
    files[QUERIES_FILE] = json.dumps(query_list(dashes, cfg), indent=2) + "\n"
    return files


def write_dashboards(out_dir: Path | str, overrides: Mapping[str, Any] | None = None) -> list[Path]:
    """Write the dashboards and queries.json into out_dir; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in render_files(load_config(overrides)).items():
        path = out / name
        path.write_text(text)
        written.append(path)
    return written


# ----------------------------------------------------------------- queries with variables set

_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace ``$name`` / ``${name}``; an unknown variable is an error, not a silent no-op."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


# What Grafana's Prometheus data source escapes in a single value interpolated into a
# regular-expression matcher (prometheusSpecialRegexEscape).
_REGEX_SPECIAL = re.compile(r"[$^*{}\[\]'+?.()|]")


def exact_value(value: str) -> str:
    """A variable's single value as Grafana writes it into a ``=~"…"`` matcher, matching that
    value only: a backslash and the regular-expression metacharacters escaped, each escape
    doubled for PromQL's string literal. Not re.escape: it also escapes ``-`` (``remote-job``
    becomes ``remote\\-job``), and ``\\-`` is no escape a PromQL string may hold (400)."""
    value = value.replace("\\", "\\\\\\\\")
    value = _REGEX_SPECIAL.sub(lambda m: "\\\\" + m.group(0), value)
    return value.replace('"', '\\"')


def variable_values(
    *,
    job: str = ".+",
    node: str = NODE_ALL,
    rank: str = RANK_ALL,
    rate_interval: str = "1m",
    range_: str = "1h",
) -> dict[str, str]:
    """Values for every variable the panel queries use (regular expressions for the label
    variables; ``range_`` stands for ``$__range``, the dashboard's time range)."""
    return {
        "job": job,
        "node": node,
        "rank": rank,
        "__rate_interval": rate_interval,
        "__range": range_,
    }


def evaluable_queries(
    *,
    job: str = ".+",
    rank: str = RANK_ALL,
    node: str = NODE_ALL,
    rate_interval: str = "1m",
    range_: str = "1h",
    have: Iterable[str] = (),
    cfg: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every dashboard query with Grafana's variables filled in, for a real Prometheus to run.

    Each item is a query_list() entry plus ``promql`` and ``expected_data``. ``job``, ``node``
    and ``rank`` are regular expressions (the variables are used with ``=~``); ``rate_interval``
    stands in for ``$__rate_interval`` (at least 4 scrape intervals, as in Grafana) and
    ``range_`` for ``$__range`` (the time range the per-rank panels pick their ranks over).
    ``expected_data`` is true when every flag in ``needs`` is in ``have``: gpu, pacing,
    straggler, rejections (series that exist only with a GPU, the pacing controller, a
    diagnosed straggler, or after a rejected record), alerts (ALERTS: only while an alert is
    pending or firing), collectives (collectives other than DDP's gradient sync), link (the
    ranks' link facts, agent/link.py).
    """
    cfg = load_config() if cfg is None else cfg
    values = variable_values(
        job=job, node=node, rank=rank, rate_interval=rate_interval, range_=range_
    )
    have = set(have)
    out = []
    for query in query_list(dashboards(cfg), cfg):
        item = dict(query)
        item["promql"] = substitute(query["expr"], values)
        item["expected_data"] = set(query["needs"]) <= have
        out.append(item)
    return out


def panel_queries(
    cfg: Mapping[str, Any] | None = None,
    *,
    job: str,
    rank: str | None = None,
    node: str | None = None,
    rate_interval: str = "1m",
    range_: str = "1h",
    have: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Every panel's queries for one training job, as Grafana would run them with ``job``
    selected and ``rank`` / ``node`` selected (exact values) or All (None).

    For a scale bench: with no rank selected, every query should return at most MAX_SERIES
    series however many ranks the job has (instant queries: the result; range queries: the
    distinct series over the range)."""
    return evaluable_queries(
        job=exact_value(job),
        rank=RANK_ALL if rank is None else exact_value(rank),
        node=NODE_ALL if node is None else exact_value(node),
        rate_interval=rate_interval,
        range_=range_,
        have=have,
        cfg=cfg,
    )


def annotation_queries(cfg: Mapping[str, Any] | None = None, **values: str) -> list[dict[str, Any]]:
    """The dashboards' annotation queries (name, expr, step, ...) with ``promql`` filled in
    from variable_values(**values)."""
    cfg = load_config() if cfg is None else cfg
    filled = variable_values(**values)
    return [{**spec, "promql": substitute(spec["expr"], filled)} for spec in annotation_specs(cfg)]
