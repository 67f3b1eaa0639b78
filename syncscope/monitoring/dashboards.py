"""Syncscope's Grafana dashboards (and the list of their PromQL), built with grafana-foundation-sdk.

One source: panel thresholds come from the thresholds file and recorded-series names from
monitoring/rules.py, the same place the alerts come from. `syncscope dashboards --out DIR`
writes them; `syncscope generate` rewrites the checked-in copies under dashboards/
(the two dashboards and queries.json, every panel query with the optional series it needs).
The JSON is stable only with grafana-foundation-sdk==1769699379!11.6.0 (the Grafana 11.6 build).
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
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from syncscope import catalog as M
from syncscope.exporter.settings import STEP_WINDOW
from syncscope.monitoring import rules as R
from syncscope.monitoring.config import load_config

QUERIES_FILE = "queries.json"
TAGS = ["syncscope"]
GRID_WIDTH = 24

OVERVIEW_UID = "syncscope-job-overview"
FABRIC_UID = "syncscope-fabric-locality"

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
    steps_metric = sel(cfg, M.STEPS_TOTAL.name)
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
        .query(f"label_values({sel(cfg, M.STEPS_TOTAL.name, JOB)}, rank)")
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
    diagnosis = cfg["diagnosis"]["verdict_score"]
    phase = sel(cfg, M.PHASE_SECONDS_TOTAL.name, JOB, RANK)
    comm = sel(cfg, M.PHASE_SECONDS_TOTAL.name, JOB, RANK, 'phase="comm_exposed"')
    wait = sel(cfg, M.COLLECTIVE_WAIT_SECONDS_TOTAL.name, JOB, RANK)
    step_sum = sel(cfg, R.STEP_SECONDS_SUM, JOB, RANK)
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
                        [q(sel(cfg, M.STEP_TIME_CV.name, JOB, RANK), "rank {{rank}}")],
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
                        [q(sel(cfg, M.ARRIVAL_LEAD_SECONDS.name, JOB, RANK), "rank {{rank}}")],
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
                                sel(cfg, M.STRAGGLER_CAUSE.name, JOB),
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
                        q(sel(cfg, M.DIAGNOSIS.name, JOB), "{{mode}}", instant=True).ref_id("A")
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
                            f"max by (rank) ({sel(cfg, M.PACING_ACTIVE.name, JOB, RANK)})",
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
                                sel(cfg, M.PACING_CURRENT_DELAY_SECONDS.name, JOB, RANK),
                                "delay rank {{rank}}",
                            ),
                            q(
                                sel(cfg, M.PACING_THRESHOLD_SECONDS.name, JOB, RANK),
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
                                f"sum by (rank) (rate({sel(cfg, M.PACING_ENGAGEMENTS_TOTAL.name, JOB, RANK)}[{RATE}]))",
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
                                f"sum by (rank) (rate({sel(cfg, M.AGENT_RECORDS_DROPPED_TOTAL.name, JOB, RANK)}[{RATE}]))",
                                "dropped rank {{rank}}",
                            ),
                            q(
                                f"sum by (reason) (rate({M.EXPORTER_INGEST_REJECTED_TOTAL.name}[{RATE}]))",
                                "rejected {{reason}}",
                            ),
                            q(
                                f"sum(rate({M.EXPORTER_INGEST_RECORDS_TOTAL.name}[{RATE}]))",
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
                                f"min by (collector) ({M.EXPORTER_COLLECTOR_SUCCESS.name})",
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
                                f"max by (collector) ({M.EXPORTER_COLLECTOR_DURATION_SECONDS.name})",
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
        coll(M.COLLECTIVE_SECONDS_TOTAL.name),
        coll(M.COLLECTIVE_WAIT_SECONDS_TOTAL.name),
    )
    step_sum = coll(R.STEP_SECONDS_SUM)
    return [
        (
            "Fabric: slow link and contention",
            [
                (
                    8,
                    8,
                    ts(
                        "Link capacity by node",
                        "What each node's link is known to carry each way (negotiated speed, "
                        "or a shaping of it), as its ranks read it at start. In a synchronous "
                        "collective the job moves at the pace of the lowest.",
                        [q(rec(R.LINK_CAPACITY), "{{node}}")],
                        "Bps",
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "Slow link: capacity against the job's median node",
                        "Each node's link capacity over the median node's. Dashed line: the "
                        "SyncscopeSlowLink threshold; a node under it is the slow link.",
                        [q(rec(R.LINK_CAPACITY_RATIO), "{{node}}")],
                        "percentunit",
                        thresholds=steps((0.0, "red"), (0.5, "green"), base="red"),
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "Link utilisation while the job transfers",
                        "Each node's link throughput over the time the job spends in its "
                        "transfer, as a share of the link's capacity: the slow link sits near "
                        "100 % while the others idle.",
                        [q(rec(R.LINK_UTILIZATION), "{{node}}")],
                        "percentunit",
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
            ],
        ),
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
                        "Transfer per call (per step for DDP's gradient sync) over its own "
                        "10th percentile in the baseline window; calls other than DDP's only "
                        "while arrival skew is low. Dashed line: the SyncscopeFabricContention "
                        "threshold.",
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
                            f"max by (rank) ({coll(M.ARRIVAL_LEAD_SECONDS.name)})", "{{rank}}"
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
                                sel(cfg, M.GPU_INFO.name, JOB, RANK),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu(M.GPU_PCIE_LINK_WIDTH.name),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu(M.GPU_PCIE_LINK_MAX_WIDTH.name),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu(M.GPU_PCIE_LINK_GENERATION.name),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu(M.GPU_PCIE_LINK_MAX_GENERATION.name),
                                instant=True,
                                table_format=True,
                            ),
                            q(
                                gpu(M.GPU_NVLINK_ACTIVE_LINKS.name),
                                instant=True,
                                table_format=True,
                            ),
                            q(gpu(M.GPU_NUMA_MISMATCH.name), instant=True, table_format=True),
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
                        [q(gpu(M.GPU_SM_CLOCK_HERTZ.name), "rank {{rank}}")],
                        "hertz",
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "Temperature",
                        "GPU temperature by rank.",
                        [q(gpu(M.GPU_TEMPERATURE_CELSIUS.name), "rank {{rank}}")],
                        "celsius",
                    ),
                ),
                (
                    8,
                    8,
                    ts(
                        "Power",
                        "GPU power draw by rank.",
                        [q(gpu(M.GPU_POWER_WATTS.name), "rank {{rank}}")],
                        "watt",
                    ),
                ),
                (
                    24,
                    6,
                    table_panel(
                        "Throttle reasons",
                        "NVML clock-throttle reason bitmask by rank (0 = none).",
                        [q(gpu(M.GPU_THROTTLE_REASONS.name), instant=True, table_format=True)],
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
# DDP's own (the contention index has DDP's part too).
NEEDS_COLLECTIVES = {R.BUS_BANDWIDTH, R.TRANSFER_PER_CALL}
NEEDS = ("gpu", "pacing", "straggler", "rejections", "alerts", "collectives", "link")


def needs(expr: str, cfg: dict[str, Any]) -> list[str]:
    """What a query needs beyond a running job to return anything (the flags in queries.json).

    gpu / pacing / straggler / rejections: contract series that exist only with a GPU, with
    the pacing controller on, while the exporter names a straggler, or once it has rejected a
    record; alerts: ALERTS, only while an alert is pending or firing; collectives: collectives
    other than DDP's gradient sync; link: the ranks' link facts (agent/link.py).
    """
    conditions = R.series_conditions()
    deps = rule_dependencies(cfg)
    names = R.metric_names(expr)
    raw = set().union(*(deps.get(n, {n}) for n in names))
    found = {conditions.get(n, "always") for n in raw}
    if "ALERTS" in raw:
        found.add("alerts")
    if names & NEEDS_COLLECTIVES:
        found.add("collectives")
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


def render_files(cfg: dict[str, Any]) -> dict[str, str]:
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

_VARIABLE = re.compile(r"\$\{(\w+)\}|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace ``$name`` / ``${name}``; an unknown variable is an error, not a silent no-op."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in values:
            raise KeyError(f"no value for ${name} in {expr!r}")
        return values[name]

    return _VARIABLE.sub(one, expr)


def evaluable_queries(
    *,
    job: str = ".+",
    rank: str = ".+",
    rate_interval: str = "1m",
    have: Iterable[str] = (),
    cfg: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Every dashboard query with Grafana's variables filled in, for a real Prometheus to run.

    Each item is a query_list() entry plus ``promql`` and ``expected_data``. ``job`` and
    ``rank`` are regular expressions (the variables are used with ``=~``); ``rate_interval``
    stands in for ``$__rate_interval`` (at least 4 scrape intervals, as in Grafana).
    ``expected_data`` is true when every flag in ``needs`` is in ``have``: gpu, pacing,
    straggler, rejections (series that exist only with a GPU, the pacing controller, a
    diagnosed straggler, or after a rejected record), alerts (ALERTS: only while an alert is
    pending or firing), collectives (collectives other than DDP's gradient sync), link (the
    ranks' link facts, agent/link.py).
    """
    cfg = load_config() if cfg is None else cfg
    values = {"job": job, "rank": rank, "__rate_interval": rate_interval}
    have = set(have)
    out = []
    for query in query_list(dashboards(cfg), cfg):
        item = dict(query)
        item["promql"] = substitute(query["expr"], values)
        item["expected_data"] = set(query["needs"]) <= have
        out.append(item)
    return out
