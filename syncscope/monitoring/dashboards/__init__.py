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
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import dashboard as dm

from syncscope import recorded
from syncscope.monitoring import rules
from syncscope.monitoring.dashboards.common import (  # noqa: F401 - the package's API
    _ALERT_SERIES,
    _REGEX_SPECIAL,
    _VARIABLE,
    ALERT_PREFIX,
    ANNOTATION_STEP,
    BAND,
    BY_RANK,
    DS,
    FABRIC_UID,
    GRID_WIDTH,
    JOB,
    KEEP,
    MAX_SERIES,
    NODE,
    NODE_ALL,
    OVERVIEW_UID,
    PHASE_COLUMNS,
    QUERIES_FILE,
    RANGE,
    RANK,
    RANK_ALL,
    RATE,
    TAGS,
    TOP,
    TRIAGE_PHASES,
    TRIAGE_ROWS,
)
from syncscope.monitoring.dashboards.fabric import fabric_locality
from syncscope.monitoring.dashboards.overview import job_overview
from syncscope.monitoring.dashboards.panels import (  # noqa: F401 - the package's API
    Row,
    Tile,
    alert_steps,
    alert_threshold,
    band_overrides,
    layout,
    link,
    prop,
    q,
    stat_panel,
    steps,
    table_panel,
    threshold_lines,
    ts,
    value_map,
    value_map_json,
    with_targets,
)
from syncscope.monitoring.dashboards.queries import (  # noqa: F401 - the package's API
    PerRank,
    gauge_per_rank,
    idle_gpus_from_skew,
    indent,
    late_rows,
    lateness,
    on_straggler,
    phase_per_step,
    ranks_that_stand_out,
    ratio_lead_per_step,
    ratio_per_rank,
    rec,
    straggler_alert_age,
)
from syncscope.monitoring.dashboards.templating import (
    ANNOTATION_EXTRAS,
    annotation_specs,
    variables,
)
from syncscope.monitoring.dashboards.triage import triage, triage_table  # noqa: F401 - the package's API
from syncscope.thresholds import Thresholds, load_config


def build_dashboard(
    uid: str,
    title: str,
    description: str,
    cfg: Thresholds,
    rows: Callable[[Thresholds], list[Row]],
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
    for row in rows(cfg):
        dash = dash.with_row(
            db.Row(row.title).id(panel_id).grid_pos(dm.GridPos(h=1, w=GRID_WIDTH, x=0, y=y))
        )
        panel_id, y = panel_id + 1, y + 1
        placed, y = layout(row.tiles, y)
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


def dashboards(cfg: Thresholds) -> dict[str, dict[str, Any]]:
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


def rule_dependencies(cfg: Thresholds) -> dict[str, set[str]]:
    """Recorded series -> the raw contract metrics it is computed from (transitively)."""
    direct: dict[str, set[str]] = {}
    for rule in rules.recording_rules(cfg):
        direct.setdefault(rule["record"], set()).update(rules.metric_names(rule["expr"]))
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
NEEDS_COLLECTIVES = {recorded.BUS_BANDWIDTH, recorded.TRANSFER_PER_CALL}
NEEDS = (
    "gpu",
    "gpu_fault",
    "pacing",
    "straggler",
    "rejections",
    "alerts",
    "collectives",
    "link",
    "work",
    "rapl",
    "price",
    "phase_sampling",
)


def needs(expr: str, cfg: Thresholds) -> list[str]:
    """What a query needs beyond a running job to return anything (the flags in queries.json).

    gpu / gpu_fault / pacing / straggler / rejections: contract series that exist only with a
    GPU, where a GPU has had a fault, with the pacing controller on, while the exporter names a
    straggler, or once it has rejected a record; alerts: ALERTS or ALERTS_FOR_STATE, only while
    an alert is pending or firing; collectives: collectives other than DDP's gradient sync;
    link: the ranks' link facts (agent/link.py); work: ranks whose samples or tokens are known;
    rapl: an exporter that reads its host's CPU package energy (a query reading energy of
    either source lists both); price: exporters given a GPU-hour's price; phase_sampling: ranks
    that time their phases in 1 step of N > 1.
    """
    conditions = rules.series_conditions()
    deps = rule_dependencies(cfg)
    names = rules.metric_names(expr)
    raw = set().union(*(deps.get(n, {n}) for n in names))
    found = {conditions.get(n, "always") for n in raw}
    if "ALERTS" in raw or _ALERT_SERIES.search(expr):
        found.add("alerts")
    if names & NEEDS_COLLECTIVES:
        found.add("collectives")
    return [flag for flag in NEEDS if flag in found]


def query_list(dashes: dict[str, dict[str, Any]], cfg: Thresholds) -> list[dict[str, Any]]:
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


def render_files(cfg: Thresholds) -> dict[str, str]:
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


def substitute(expr: str, values: Mapping[str, str]) -> str:
    """Replace ``$name`` / ``${name}``; an unknown variable is an error, not a silent no-op."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


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
    interval: str = "1m",
) -> dict[str, str]:
    """Values for every variable the panel queries use (regular expressions for the label
    variables; ``range_`` stands for ``$__range``, the dashboard's time range, ``interval`` for
    ``$__interval``, the step between a panel's points)."""
    return {
        "job": job,
        "node": node,
        "rank": rank,
        "__rate_interval": rate_interval,
        "__range": range_,
        "__interval": interval,
    }


def evaluable_queries(
    *,
    job: str = ".+",
    rank: str = RANK_ALL,
    node: str = NODE_ALL,
    rate_interval: str = "1m",
    range_: str = "1h",
    have: Iterable[str] = (),
    cfg: Thresholds | None = None,
) -> list[dict[str, Any]]:
    """Every dashboard query with Grafana's variables filled in, for a real Prometheus to run.

    Each item is a query_list() entry plus ``promql`` and ``expected_data``. ``job``, ``node``
    and ``rank`` are regular expressions (the variables are used with ``=~``); ``rate_interval``
    stands in for ``$__rate_interval`` (at least 4 scrape intervals, as in Grafana) and
    ``range_`` for ``$__range`` (the time range the per-rank panels pick their ranks over).
    ``expected_data`` is true when every flag in ``needs`` is in ``have``: gpu, gpu_fault,
    pacing, straggler, rejections (series that exist only with a GPU, a GPU fault, the pacing
    controller, a diagnosed straggler, or after a rejected record), alerts (ALERTS: only while
    an alert is pending or firing), collectives (collectives other than DDP's gradient sync),
    link (the ranks' link facts, agent/link.py).
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
    cfg: Thresholds | None = None,
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


def annotation_queries(cfg: Thresholds | None = None, **values: str) -> list[dict[str, Any]]:
    """The dashboards' annotation queries (name, expr, step, ...) with ``promql`` filled in
    from variable_values(**values)."""
    cfg = load_config() if cfg is None else cfg
    filled = variable_values(**values)
    return [{**spec, "promql": substitute(spec["expr"], filled)} for spec in annotation_specs(cfg)]
