"""Generate syncscope's Grafana dashboards (and the list of their PromQL) with grafana-foundation-sdk.

One source: panel thresholds come from deploy/prometheus/thresholds.json and recorded series
names from deploy/prometheus/generate.py, the same place the alerts come from.

Outputs (committed; a test proves regenerating them changes nothing):
  dashboards/syncscope-job-overview.json
  dashboards/syncscope-fabric-locality.json
  dashboards/queries.json   every panel query, with the optional series it needs (see queries.py)

Usage: python dashboards/generate.py [--check]
Needs grafana-foundation-sdk==1769699379!11.6.0 (scripts/install-observability-tools).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    common,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RULES_MODULE_PATH = ROOT / "deploy" / "prometheus" / "generate.py"
QUERIES_PATH = HERE / "queries.json"
TAGS = ["syncscope"]
GRID_WIDTH = 24

OVERVIEW_UID = "syncscope-job-overview"
FABRIC_UID = "syncscope-fabric-locality"


def load_rules_module() -> ModuleType:
    """deploy/ is not a package; load the rules generator by path for its names and config."""
    spec = importlib.util.spec_from_file_location("syncscope_rules_generate", RULES_MODULE_PATH)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


R = load_rules_module()
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Panel selectors: Grafana variables plus the deployment's own rank selector from the config.
JOB = 'job=~"$job"'
RANK = 'rank=~"$rank"'
RATE = "$__rate_interval"


def sel(cfg: dict[str, Any], metric: str, *matchers: str) -> str:
    parts = [m for m in (cfg["selectors"]["rank"], *matchers) if m]
    return f"{metric}{{{', '.join(parts)}}}" if parts else metric


def rec(name: str, *matchers: str) -> str:
    """A recorded series: its rule already applied the rank selector."""
    return f"{name}{{{', '.join((JOB, *matchers))}}}"


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


def alert_steps(cfg: dict[str, Any], alert: str) -> db.ThresholdsConfig:
    """Orange at the warning threshold, red at the critical one: the alert's own levels."""
    colours = {"warning": "orange", "critical": "red"}
    levels = cfg["alerts"][alert]["levels"]
    return steps(*((lv["threshold"], colours[lv["severity"]]) for lv in levels))


def on_off(off: str, on: str, on_colour: str = "red") -> list[dm.ValueMapping]:
    return [
        dm.ValueMap(
            options={
                "0": dm.ValueMappingResult(text=off, color="green", index=0),
                "1": dm.ValueMappingResult(text=on, color=on_colour, index=1),
            }
        )
    ]


def threshold_lines() -> common.GraphThresholdsStyleConfig:
    return common.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)


def with_targets(panel: Any, targets: Sequence[Any]) -> Any:
    for ref, target in zip("ABCDEFGH", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def ts(
    title: str,
    desc: str,
    targets: Sequence[Any],
    unit: str,
    *,
    thresholds=None,
    stack: bool = False,
    max_val: float | None = None,
) -> Any:
    panel = timeseries.Panel().title(title).description(desc).datasource(DS).unit(unit).min(0)
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
    return with_targets(panel, targets)


def stat_panel(
    title: str,
    desc: str,
    targets: Sequence[Any],
    unit: str,
    *,
    thresholds=None,
    mappings: list[dm.ValueMapping] | None = None,
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
) -> Any:
    panel = table.Panel().title(title).description(desc).datasource(DS).unit(unit)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).cell_options(cm.TableColoredBackgroundCellOptions())
    if mappings:
        panel = panel.mappings(mappings)
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    panel = panel.with_transformation(
        dm.DataTransformerConfig(
            id_val="organize",
            options={"excludeByName": {name: True for name in hide}},
        )
    )
    return with_targets(panel, targets)


# ------------------------------------------------------------------------------ dashboards


def variables(cfg: dict[str, Any]) -> list[Any]:
    steps_metric = sel(cfg, "syncscope_steps_total")
    return [
        db.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        db.QueryVariable("job")
        .label("Job")
        .datasource(DS)
        .query(f"label_values({steps_metric}, job)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".+"),
        db.QueryVariable("rank")
        .label("Rank")
        .datasource(DS)
        .query(f"label_values({sel(cfg, 'syncscope_steps_total', JOB)}, rank)")
        .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dm.VariableSort.NUMERICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".+"),
    ]


def job_overview(cfg: dict[str, Any]) -> list[tuple[str, list[tuple[int, int, Any]]]]:
    """Rows of (width, height, panel): the job's headline numbers and the paper's failure modes."""
    a = cfg["alerts"]
    straggler = a["SyncscopeStraggler"]["levels"][0]["threshold"]
    diagnosis = cfg["dashboards"]["diagnosis_score_threshold"]
    phase = sel(cfg, "syncscope_phase_seconds_total", JOB, RANK)
    comm = sel(cfg, "syncscope_phase_seconds_total", JOB, RANK, 'phase="comm_exposed"')
    wait = sel(cfg, "syncscope_collective_wait_seconds_total", JOB, RANK)
    step_sum = sel(cfg, "syncscope_step_duration_seconds_sum", JOB, RANK)
    return [
        (
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
                        "Coefficient of variation of step time over the last 100 steps, "
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
                        "Ranks reporting",
                        "Ranks whose records reach an exporter, against the world "
                        "size the ranks report. Fewer reporting: see SyncscopeRankSilent.",
                        [
                            q(rec(R.RANKS_REPORTING), "reporting"),
                            q(rec(R.WORLD_SIZE), "world size"),
                        ],
                        "none",
                    ),
                ),
            ],
        ),
        (
            "Step time and phases",
            [
                (
                    12,
                    8,
                    ts(
                        "Step time",
                        "Mean and quantiles of step wall time, job-wide.",
                        [
                            q(rec(R.STEP_MEAN), "mean {{job}}"),
                            q(rec(R.STEP_QUANTILE), "p{{quantile}} {{job}}"),
                        ],
                        "s",
                    ),
                ),
                (
                    12,
                    8,
                    ts(
                        "Step-time CV by rank",
                        "Dashed lines: the SyncscopeStepTimeCVHigh levels.",
                        [q(sel(cfg, "syncscope_step_time_cv", JOB, RANK), "rank {{rank}}")],
                        "none",
                        thresholds=alert_steps(cfg, "SyncscopeStepTimeCVHigh"),
                    ),
                ),
                (
                    12,
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
                    12,
                    8,
                    ts(
                        "Exposed communication by rank",
                        "Share of each rank's wall time in exposed "
                        "communication. The straggler has the least: the others wait for it.",
                        [
                            q(
                                f"sum by (rank) (rate({comm}[{RATE}])) / sum by (rank) (rate({phase}[{RATE}]))",
                                "rank {{rank}}",
                            )
                        ],
                        "percentunit",
                    ),
                ),
            ],
        ),
        (
            "Synchronization",
            [
                (
                    12,
                    8,
                    ts(
                        "Amplification, exposed communication, pacing",
                        "Job-wide shares of rank time. Dashed line: the SyncscopeSyncAmplification threshold.",
                        [
                            q(rec(R.SYNC_AMPLIFICATION), "waiting for peers {{job}}"),
                            q(rec(R.COMM_EXPOSED_RATIO), "exposed communication {{job}}"),
                            q(rec(R.PACING_RATIO), "pacing delay {{job}}"),
                        ],
                        "percentunit",
                        thresholds=alert_steps(cfg, "SyncscopeSyncAmplification"),
                    ),
                ),
                (
                    12,
                    8,
                    ts(
                        "Arrival lead by rank",
                        "How early each rank reaches collectives compared with the "
                        "last one (rolling mean). The straggler sits at zero.",
                        [q(sel(cfg, "syncscope_arrival_lead_seconds", JOB, RANK), "rank {{rank}}")],
                        "s",
                    ),
                ),
                (
                    8,
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
                    8,
                    8,
                    table_panel(
                        "Straggler",
                        "The rank that arrives last (smallest lead over the straggler "
                        "window), its lag as a share of a step and in seconds, and the exporter's cause.",
                        [
                            q(rec(R.STRAGGLER_RATIO), instant=True, table_format=True),
                            q(rec(R.STRAGGLER_LAG), instant=True, table_format=True),
                            q(
                                sel(cfg, "syncscope_straggler_cause", JOB),
                                instant=True,
                                table_format=True,
                            ),
                        ],
                        unit="percentunit",
                        thresholds=steps((straggler, "orange")),
                    ),
                ),
                (
                    8,
                    8,
                    bargauge.Panel()
                    .title("Diagnosis")
                    .description(
                        "The exporter's local score (0..1) for each failure mode of paper §3.3."
                    )
                    .datasource(DS)
                    .unit("percentunit")
                    .min(0)
                    .max(1)
                    .thresholds(steps((diagnosis, "orange")))
                    .with_target(
                        q(sel(cfg, "syncscope_diagnosis", JOB), "{{mode}}", instant=True).ref_id(
                            "A"
                        )
                    ),
                ),
            ],
        ),
        (
            "Pacing",
            [
                (
                    12,
                    8,
                    statetimeline.Panel()
                    .title("Pacing engaged")
                    .description(
                        "Whether each rank's pacing controller is delaying it (paper §4.3, §5.3). "
                        "Engaged without a break for long: see SyncscopePacingEngagedLong."
                    )
                    .datasource(DS)
                    .mappings(on_off("idle", "pacing", "orange"))
                    .with_target(
                        q(
                            f"max by (rank) ({sel(cfg, 'syncscope_pacing_active', JOB, RANK)})",
                            "rank {{rank}}",
                        ).ref_id("A")
                    ),
                ),
                (
                    12,
                    8,
                    ts(
                        "Pacing delay and threshold",
                        "Current delay per rank and the wait variability "
                        "threshold above which its controller engages.",
                        [
                            q(
                                sel(cfg, "syncscope_pacing_current_delay_seconds", JOB, RANK),
                                "delay rank {{rank}}",
                            ),
                            q(
                                sel(cfg, "syncscope_pacing_threshold_seconds", JOB, RANK),
                                "threshold rank {{rank}}",
                            ),
                        ],
                        "s",
                    ),
                ),
                (
                    24,
                    6,
                    ts(
                        "Pacing engagements and time spent waiting",
                        "Engagements per second by rank, and the "
                        "share of each rank's time spent waiting for peers (what pacing trades off).",
                        [
                            q(
                                f"sum by (rank) (rate({sel(cfg, 'syncscope_pacing_engagements_total', JOB, RANK)}[{RATE}]))",
                                "engagements/s rank {{rank}}",
                            ),
                            q(
                                f"sum by (rank) (rate({wait}[{RATE}])) / sum by (rank) (rate({step_sum}[{RATE}]))",
                                "waiting rank {{rank}}",
                            ),
                        ],
                        "short",
                    ),
                ),
            ],
        ),
        (
            "Alerts, agents and exporters",
            [
                (
                    12,
                    8,
                    table_panel(
                        "Active syncscope alerts",
                        "Pending and firing syncscope alerts (the ALERTS series).",
                        [q('ALERTS{alertname=~"Syncscope.+"}', instant=True, table_format=True)],
                        hide=("Time", "__name__", "Value"),
                    ),
                ),
                (
                    12,
                    8,
                    ts(
                        "Records dropped and rejected",
                        "Agent records dropped per rank (exporter slow or "
                        "unreachable) and records the exporters rejected, by reason.",
                        [
                            q(
                                f"sum by (rank) (rate({sel(cfg, 'syncscope_agent_records_dropped_total', JOB, RANK)}[{RATE}]))",
                                "dropped rank {{rank}}",
                            ),
                            q(
                                f"sum by (reason) (rate(syncscope_exporter_ingest_rejected_total[{RATE}]))",
                                "rejected {{reason}}",
                            ),
                            q(
                                f"sum(rate(syncscope_exporter_ingest_records_total[{RATE}]))",
                                "ingested",
                            ),
                        ],
                        "short",
                    ),
                ),
                (
                    8,
                    6,
                    stat_panel(
                        "Exporters up",
                        "Scrape success of every syncscope exporter.",
                        [q(f"up{{{cfg['selectors']['exporter']}}}", "{{instance}}")],
                        "none",
                        mappings=on_off("down", "up", "green"),
                        thresholds=steps((1, "green"), base="red"),
                    ),
                ),
                (
                    8,
                    6,
                    stat_panel(
                        "Collectors succeeding",
                        "Whether each exporter collector succeeded at the last scrape.",
                        [
                            q(
                                "min by (collector) (syncscope_exporter_collector_success)",
                                "{{collector}}",
                            )
                        ],
                        "none",
                        mappings=on_off("failing", "ok", "green"),
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
                                "max by (collector) (syncscope_exporter_collector_duration_seconds)",
                                "{{collector}}",
                            )
                        ],
                        "s",
                    ),
                ),
            ],
        ),
    ]


def fabric_locality(cfg: dict[str, Any]) -> list[tuple[str, list[tuple[int, int, Any]]]]:
    """Rows for the fabric and GPU-locality failure modes: bandwidth, contention, skew, topology."""
    coll = lambda m: sel(cfg, m, JOB, RANK)  # noqa: E731 - a local shorthand
    gpu = lambda m: f"max by (rank) ({sel(cfg, m, JOB, RANK)})"  # noqa: E731
    seconds, wait = (
        coll("syncscope_collective_seconds_total"),
        coll("syncscope_collective_wait_seconds_total"),
    )
    step_sum = coll("syncscope_step_duration_seconds_sum")
    return [
        (
            "Collectives",
            [
                (
                    12,
                    8,
                    ts(
                        "Bus bandwidth by op",
                        "Achieved bus bandwidth (nccl-tests convention) from bytes "
                        "and the transfer part of durations; DDP's gradient sync is exposed time only and "
                        "not shown.",
                        [q(rec(R.BUS_BANDWIDTH), "{{op}} {{group}}")],
                        "Bps",
                    ),
                ),
                (
                    12,
                    8,
                    ts(
                        "Transfer vs wait by op",
                        "Rank-seconds per second in collectives: transfer "
                        "(duration minus wait) and waiting for the last peer.",
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
                        "Transfer time per call",
                        "Transfer part of one call, job-wide, by op and group.",
                        [q(rec(R.TRANSFER_PER_CALL), "{{op}} {{group}}")],
                        "s",
                    ),
                ),
                (
                    12,
                    8,
                    ts(
                        "Contention index",
                        "Transfer time per call over its best in the baseline window, "
                        "only while arrival skew is low. Dashed line: the SyncscopeFabricContention threshold.",
                        [q(rec(R.CONTENTION), "{{op}} {{group}}")],
                        "none",
                        thresholds=alert_steps(cfg, "SyncscopeFabricContention"),
                    ),
                ),
            ],
        ),
        (
            "Arrival skew",
            [
                (
                    12,
                    9,
                    heatmap.Panel()
                    .title("Arrival lead by rank")
                    .description(
                        "One row per rank, colour = how early it reaches collectives; the straggler's row "
                        "stays cold."
                    )
                    .datasource(DS)
                    .calculate(False)
                    .unit("s")
                    .with_target(
                        q(
                            f"max by (rank) ({coll('syncscope_arrival_lead_seconds')})", "{{rank}}"
                        ).ref_id("A")
                    ),
                ),
                (
                    12,
                    9,
                    ts(
                        "Waiting for peers by rank",
                        "Share of each rank's wall time spent waiting at "
                        "collectives for the last peer.",
                        [
                            q(
                                f"sum by (rank) (rate({wait}[{RATE}])) / sum by (rank) (rate({step_sum}[{RATE}]))",
                                "rank {{rank}}",
                            )
                        ],
                        "percentunit",
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
        ),
        (
            "GPU locality",
            [
                (
                    16,
                    8,
                    table_panel(
                        "Topology",
                        "GPU, PCIe link (current vs max), NVLink and NUMA placement per rank.",
                        [
                            q(
                                sel(cfg, "syncscope_gpu_info", JOB, RANK),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu("syncscope_gpu_pcie_link_width"),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu("syncscope_gpu_pcie_link_max_width"),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu("syncscope_gpu_pcie_link_generation"),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu("syncscope_gpu_pcie_link_max_generation"),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu("syncscope_gpu_nvlink_active_links"),
                                instant=True,
                                table_format=True,
                            ),
                            q(gpu("syncscope_gpu_numa_mismatch"), instant=True, table_format=True),
                        ],
                        hide=("Time", "__name__", "Value #A"),
                    ),
                ),
                (
                    8,
                    8,
                    table_panel(
                        "Locality faults",
                        "1 = the fault is present: PCIe below max width or generation, "
                        "or NUMA mismatch (SyncscopeLocalityFault).",
                        [q(rec(R.LOCALITY_FAULT, RANK), instant=True, table_format=True)],
                        thresholds=steps((1, "red")),
                        mappings=on_off("ok", "fault"),
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "SM clock",
                        "Streaming-multiprocessor clock by rank.",
                        [q(gpu("syncscope_gpu_sm_clock_hertz"), "rank {{rank}}")],
                        "hertz",
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "Temperature",
                        "GPU temperature by rank.",
                        [q(gpu("syncscope_gpu_temperature_celsius"), "rank {{rank}}")],
                        "celsius",
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "Power",
                        "GPU power draw by rank.",
                        [q(gpu("syncscope_gpu_power_watts"), "rank {{rank}}")],
                        "watt",
                    ),
                ),
                (
                    24,
                    6,
                    table_panel(
                        "Throttle reasons",
                        "NVML clock-throttle reason bitmask by rank (0 = none).",
                        [q(gpu("syncscope_gpu_throttle_reasons"), instant=True, table_format=True)],
                        thresholds=steps((1, "orange")),
                    ),
                ),
            ],
        ),
    ]


def build_dashboard(
    uid: str,
    title: str,
    description: str,
    cfg: dict[str, Any],
    rows: Callable[[dict[str, Any]], list[tuple[str, list[tuple[int, int, Any]]]]],
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
    # Explicit layout: the SDK's automatic placement can run a row past 24 columns.
    y, panel_id = 0, 1
    for row_title, panels in rows(cfg):
        dash = dash.with_row(
            db.Row(row_title).id(panel_id).grid_pos(dm.GridPos(h=1, w=GRID_WIDTH, x=0, y=y))
        )
        panel_id, y = panel_id + 1, y + 1
        x, line_h = 0, 0
        for w, h, panel in panels:
            if x + w > GRID_WIDTH:
                x, y, line_h = 0, y + line_h, 0
            dash = dash.with_panel(panel.id(panel_id).grid_pos(dm.GridPos(h=h, w=w, x=x, y=y)))
            panel_id, x, line_h = panel_id + 1, x + w, max(line_h, h)
        y += line_h
    data = json.loads(json.dumps(dash.build(), cls=JSONEncoder))
    for variable in data["templating"]["list"]:
        # The SDK writes interval-variable defaults onto every variable; Grafana's schema has
        # no such keys, and they mean nothing on a query or datasource variable.
        if variable["type"] != "interval":
            for key in ("auto", "auto_count", "auto_min"):
                variable.pop(key, None)
    return data


def dashboards(cfg: dict[str, Any]) -> dict[str, dict[str, Any]]:
    overview = build_dashboard(
        OVERVIEW_UID,
        "syncscope / Job overview",
        "Throughput, step time and its variability, phase shares, synchronization amplification, "
        "the straggler, pacing and alerts of synchronous training jobs.",
        cfg,
        job_overview,
        (FABRIC_UID, "Fabric and locality"),
    )
    fabric = build_dashboard(
        FABRIC_UID,
        "syncscope / Fabric and locality",
        "Collective bus bandwidth, transfer vs wait, contention, arrival skew by rank and GPU topology.",
        cfg,
        fabric_locality,
        (OVERVIEW_UID, "Job overview"),
    )
    return {OVERVIEW_UID: overview, FABRIC_UID: fabric}


# ------------------------------------------------------------------------------ query list


def rule_dependencies(cfg: dict[str, Any]) -> dict[str, set[str]]:
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
# DDP's own, and the contention index also only exists while arrival skew is low.
NEEDS_COLLECTIVES = {R.BUS_BANDWIDTH, R.TRANSFER_PER_CALL, R.CONTENTION}
NEEDS_LOW_SKEW = {R.CONTENTION}
NEEDS = ("gpu", "pacing", "straggler", "rejections", "alerts", "collectives", "low_skew")


def needs(expr: str, cfg: dict[str, Any]) -> list[str]:
    """What a query needs beyond a running job to return anything (the flags in queries.json).

    gpu / pacing / straggler / rejections: contract series that exist only with a GPU, with
    the pacing controller on, while the exporter names a straggler, or once it has rejected a
    record; alerts: ALERTS, only while an alert is pending or firing; collectives: collectives
    other than DDP's gradient sync; low_skew: the contention index, only while arrival skew is
    below its gate.
    """
    conditions = R.load_contract()
    deps = rule_dependencies(cfg)
    names = R.metric_names(expr)
    raw = set().union(*(deps.get(n, {n}) for n in names))
    found = {conditions.get(n, "always") for n in raw}
    if "ALERTS" in raw:
        found.add("alerts")
    if names & NEEDS_COLLECTIVES:
        found.add("collectives")
    if names & NEEDS_LOW_SKEW:
        found.add("low_skew")
    return [flag for flag in NEEDS if flag in found]


def query_list(dashes: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> list[dict[str, Any]]:
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


def outputs() -> dict[Path, str]:
    cfg = R.load_config()
    dashes = dashboards(cfg)
    files = {
        HERE / f"{uid}.json": json.dumps(d, indent=2, sort_keys=True) + "\n"
        for uid, d in dashes.items()
    }
    files[QUERIES_PATH] = json.dumps(query_list(dashes, cfg), indent=2) + "\n"
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 if the committed JSON is stale"
    )
    args = parser.parse_args(argv)
    files = outputs()
    if args.check:
        stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"stale: {p}", file=sys.stderr)
        return 1 if stale else 0
    for p, text in files.items():
        p.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
