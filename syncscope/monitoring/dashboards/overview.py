"""The job overview dashboard: job_overview() lists its rows; each function below gives the
tiles of one kind of panel in them."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
)
from grafana_foundation_sdk.models import common as cm

from syncscope import catalog as M
from syncscope import recorded
from syncscope.catalog import STEP_WINDOW
from syncscope.monitoring.dashboards.common import (
    ALERT_PREFIX,
    BY_RANK,
    DS,
    JOB,
    MAX_SERIES,
    NODE,
    RANK,
    RATE,
    TOP,
    TRIAGE_ROWS,
)
from syncscope.monitoring.dashboards.panels import (
    Row,
    Tile,
    alert_steps,
    alert_threshold,
    prop,
    q,
    stat_panel,
    steps,
    table_panel,
    ts,
    value_map,
)
from syncscope.monitoring.dashboards.queries import (
    badput_shares,
    energy_by_source,
    gauge_per_rank,
    gpu_hours,
    joules_per,
    ranks_that_stand_out,
    ratio_per_rank,
    rec,
)
from syncscope.monitoring.dashboards.triage import triage
from syncscope.monitoring.promql import sel
from syncscope.thresholds import Thresholds


def job_overview(cfg: Thresholds) -> list[Row]:
    """The job overview's rows: triage first, then the paper's failure modes."""
    return [
        Row("Triage: which ranks are late, where, why, since when, at what cost", triage(cfg)),
        Row("Job health", _job_health(cfg)),
        Row("Work done and the energy it takes", _work_and_energy(cfg)),
        Row("Goodput and cost", [*_goodput(cfg), *_cost(cfg.intervals.slow_rules)]),
        Row("Trends over days", _trends(cfg)),
        Row(
            "Step time and phases",
            [
                *_step_time(cfg),
                *_job_phases(cfg),
                *_selected_ranks_phases(cfg),
                *_noisy_ranks_and_ranks_that_wait_least(cfg),
            ],
        ),
        Row(
            "Where the job waits: process groups and the wait chain",
            _process_groups_and_wait_chain(cfg),
        ),
        Row("Synchronization", [*_synchronization(cfg), _diagnosis(cfg)]),
        Row("Pacing", _pacing(cfg)),
        Row(
            "Alerts, agents and exporters",
            [_active_alerts(), _agent_records(cfg), *_exporters(cfg)],
        ),
    ]


def _job_health(cfg: Thresholds) -> list[Tile]:
    """The job's headline numbers: throughput, step time and its variability, waiting, skew."""
    straggler = alert_threshold(cfg, "SyncscopeStraggler")
    return [
        Tile(
            4,
            4,
            stat_panel(
                "Throughput",
                "Steps per second, averaged over the job's ranks.",
                [q(rec(recorded.STEPS_RATE), "{{job}}")],
                "suffix: steps/s",
            ),
        ),
        Tile(
            4,
            4,
            stat_panel(
                "Mean step time",
                "Mean wall time of a step over all ranks.",
                [q(rec(recorded.STEP_MEAN), "{{job}}")],
                "s",
            ),
        ),
        Tile(
            4,
            4,
            stat_panel(
                "Step-time CV",
                f"Coefficient of variation of step time over the last {STEP_WINDOW} steps, "
                "noisiest rank. Orange/red at the SyncscopeStepTimeCVHigh levels.",
                [q(rec(recorded.STEP_CV), "{{job}}")],
                "none",
                thresholds=alert_steps(cfg, "SyncscopeStepTimeCVHigh"),
            ),
        ),
        Tile(
            4,
            4,
            stat_panel(
                "Sync amplification",
                "Share of rank time spent waiting at collectives for the "
                "last peer (paper §3.3). Orange at the SyncscopeSyncAmplification threshold.",
                [q(rec(recorded.SYNC_AMPLIFICATION), "{{job}}")],
                "percentunit",
                thresholds=alert_steps(cfg, "SyncscopeSyncAmplification"),
            ),
        ),
        Tile(
            4,
            4,
            stat_panel(
                "Exposed communication",
                "Share of step time in communication that backward did not hide.",
                [q(rec(recorded.COMM_EXPOSED_RATIO), "{{job}}")],
                "percentunit",
            ),
        ),
        Tile(
            4,
            4,
            stat_panel(
                "Arrival skew",
                "Latest minus earliest rank, as a share of the mean step (orange from "
                "the SyncscopeStraggler threshold).",
                [q(rec(recorded.SKEW_RATIO), "{{job}}")],
                "percentunit",
                thresholds=steps((straggler, "orange")),
            ),
        ),
    ]


def _job_and_per_gpu(title: str, desc: str, job: str, per_gpu: str) -> Any:
    """The job's rate and the mean GPU's, the latter on the right axis (N GPUs apart)."""
    panel = ts(title, desc, [q(rec(job), "job"), q(rec(per_gpu), "per GPU")], "short")
    return panel.override_by_name("per GPU", [prop("custom.axisPlacement", "right")])


def _work_and_energy(cfg: Thresholds) -> list[Tile]:
    """Work done per second, by the job and per GPU, and the power and energy it takes."""
    slow = cfg.intervals.slow_rules
    per_unit = ts(
        "Joules per sample",
        "Energy per sample over each point's interval, and per token (right axis): the job's "
        "joules (GPUs' NVML counters and the nodes' CPU packages, where measured) over the "
        "samples its ranks processed. Built for ranges of days: a job whose energy grows "
        "faster than its output shows it here.",
        [
            q(joules_per(recorded.SAMPLES_RATE), "per sample"),
            q(joules_per(recorded.TOKENS_RATE), "per token"),
        ],
        "joule",
    ).override_by_name("per token", [prop("custom.axisPlacement", "right")])
    return [
        Tile(
            6,
            8,
            _job_and_per_gpu(
                "Samples per second",
                "Samples the job's ranks process per second, and per GPU (right axis: the "
                "mean over ranks that report samples). Ranks whose samples are not known "
                "(set samples_per_step or call agent.count()) count in neither.",
                recorded.SAMPLES_RATE,
                recorded.SAMPLES_PER_GPU,
            ),
        ),
        Tile(
            6,
            8,
            _job_and_per_gpu(
                "Tokens per second",
                "Tokens the job's ranks process per second (token-id inputs: batch x "
                "sequence length), and per GPU (right axis).",
                recorded.TOKENS_RATE,
                recorded.TOKENS_PER_GPU,
            ),
        ),
        Tile(
            6,
            8,
            ts(
                "Power",
                "The job's joules per second: its GPUs' energy counters and its nodes' CPU "
                "packages (RAPL), stacked. A source not measured has no line.",
                [q(expr, legend) for expr, legend in energy_by_source()],
                "watt",
                stack=True,
            ),
        ),
        Tile(6, 8, per_unit.interval(slow)),
    ]


def _goodput(cfg: Thresholds) -> list[Tile]:
    """Goodput over the job's whole life (its restarts included), and where the rest went."""
    slow = cfg.intervals.slow_rules
    goodput = (
        "Productive step time, less the steps restarts ran again, over the rank-seconds since "
        "the job's first process started (world size x elapsed): each step less its data "
        "wait, exposed communication, pacing and checkpoint time counts. From counters the "
        "exporters keep across the job's restarts (and their own, with --state-file)."
    )
    bars = ts(
        "Badput by category",
        "Where the rank-seconds since the job started went besides goodput, as shares: "
        "startup (process start to the first step), checkpoint saves and loads, lost progress "
        "(steps a restart ran again), data wait, synchronization wait (exposed communication), "
        "pacing, and nothing running (no process or no step: between restarts, after the end). "
        "With goodput they add up to 100%.",
        [q(badput_shares(), "{{category}}")],
        "percentunit",
        stack=True,
        max_val=1,
    )
    return [
        Tile(
            4,
            8,
            stat_panel("Goodput", goodput, [q(rec(recorded.GOODPUT), "{{job}}")], "percentunit"),
        ),
        Tile(
            4,
            8,
            stat_panel(
                "GPU-hours lost",
                "GPU-hours (one GPU a rank) since the job started that did not go into "
                "productive steps that counted (1 - goodput), of those below (the job's "
                "world size x elapsed hours).",
                [q(gpu_hours(lost=True), "lost"), q(gpu_hours(), "since start")],
                "h",
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Goodput since the job started",
                goodput,
                [q(rec(recorded.GOODPUT), "goodput")],
                "percentunit",
                max_val=1,
            ).interval(slow),
        ),
        Tile(8, 8, bars.draw_style(cm.GraphDrawStyle.BARS).interval(slow)),
    ]


def _cost(slow: str) -> list[Tile]:
    """What the job costs and what its lost time costs: empty unless the exporters are given
    a GPU-hour's price (--price-per-gpu-hour)."""
    price = "From the exporters' --price-per-gpu-hour (one GPU a rank); empty without it."
    return [
        Tile(
            6,
            6,
            stat_panel(
                "Cost per million tokens",
                f"What the job's GPUs cost per hour over the tokens it processes per hour, per "
                f"million, at the current rates. {price}",
                [
                    q(rec(recorded.COST_PER_MILLION_TOKENS), "tokens"),
                    q(rec(recorded.COST_PER_MILLION_SAMPLES), "samples"),
                ],
                "none",
            ),
        ),
        Tile(
            6,
            6,
            stat_panel(
                "Cost of lost time per hour",
                f"The job's cost per hour times the share of its rank-time since it started "
                f"that went into no goodput (1 - goodput). {price}",
                [
                    q(rec(recorded.LOST_COST_PER_HOUR), "lost"),
                    q(rec(recorded.COST_PER_HOUR), "all"),
                ],
                "none",
            ),
        ),
        Tile(
            12,
            6,
            ts(
                "Cost per hour",
                f"The job's GPUs' cost per hour, and the part of it going into no goodput. {price}",
                [
                    q(rec(recorded.COST_PER_HOUR), "cost"),
                    q(rec(recorded.LOST_COST_PER_HOUR), "lost"),
                ],
                "none",
            ).interval(slow),
        ),
    ]


def _trends(cfg: Thresholds) -> list[Tile]:
    """The job against its own first days (set the time range to its life)."""
    day = cfg.windows.trend
    life = (
        f"Each point: the {day} up to it. Set the time range to the job's life to read it "
        "against its own first days (the scenario: runtime variance grows, re-runs increase)."
    )
    panels = (
        (
            "Step-time CV per day",
            "The mean over the day of the job's step-time CV (its most variable rank's).",
            [q(rec(recorded.STEP_CV_PER_DAY), "CV")],
        ),
        (
            "Throughput per GPU per day",
            "Samples per second per GPU (the mean over ranks that report them), and steps per "
            "second, each averaged over the day.",
            [
                q(rec(recorded.SAMPLES_PER_GPU_PER_DAY), "samples/s per GPU"),
                q(rec(recorded.STEPS_RATE_PER_DAY), "steps/s"),
            ],
        ),
        (
            "Restarts per day",
            "Ranks that came back as a new incarnation of themselves in the day, all nodes.",
            [q(rec(recorded.RESTARTS_PER_DAY), "restarts")],
        ),
    )
    return [
        Tile(8, 8, ts(title, f"{text} {life}", targets, "none").interval("1h"))
        for title, text, targets in panels
    ]


def _step_time(cfg: Thresholds) -> list[Tile]:
    """Step time job-wide, and the ranks whose steps are busiest (a straggler's)."""
    phases = M.PHASE_SECONDS_TOTAL.name
    busy = ratio_per_rank(
        cfg, (phases, ('phase!~"comm_exposed|pacing"',)), (M.STEPS_TOTAL.name, ())
    )
    return [
        Tile(
            12,
            8,
            ts(
                "Step time",
                "Mean and quantiles of step wall time, job-wide (every node's "
                "step-duration histogram pooled).",
                [
                    q(rec(recorded.STEP_MEAN), "mean"),
                    q(rec(recorded.STEP_QUANTILE), "p{{quantile}}"),
                ],
                "s",
            ),
        ),
        Tile(
            8,
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
    ]


def _job_phases(cfg: Thresholds) -> list[Tile]:
    """How often the selected ranks time their phases, and the job's phase shares."""
    sampling = sel(cfg, M.PHASE_SAMPLING_EVERY.name, JOB, NODE, RANK)
    return [
        Tile(
            4,
            8,
            stat_panel(
                "Phases timed",
                "How often the selected ranks time their phases: every step, or 1 step in N "
                "where a rank samples them (AgentConfig.phase_every, SYNCSCOPE_PHASE_EVERY, for "
                "steps of a few ms). The other steps' phases are the last timed step's shares "
                "of their own time: the phase panels below are estimates between timed steps. "
                "The largest N among the selected ranks.",
                [q(f"max by (job) ({sampling})", "{{job}}")],
                "prefix:1 step in ",
                no_value="every step",
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Phase shares",
                "Share of step wall time per phase, job-wide; they add up to 1.",
                [q(rec(recorded.PHASE_RATIO), "{{phase}}")],
                "percentunit",
                stack=True,
                max_val=1,
            ),
        ),
    ]


def _selected_ranks_phases(cfg: Thresholds) -> list[Tile]:
    """The selected ranks' seconds per step in each phase, and against the job's median rank."""
    phases = M.PHASE_SECONDS_TOTAL.name
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
    return [
        Tile(
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
        Tile(
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


def _noisy_ranks_and_ranks_that_wait_least(cfg: Thresholds) -> list[Tile]:
    """The ranks whose step time varies most, and those that wait least (the straggler)."""
    phases = M.PHASE_SECONDS_TOTAL.name
    exposed = ratio_per_rank(cfg, (phases, ('phase="comm_exposed"',)), (phases, ()))
    return [
        Tile(
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
        Tile(
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


def _process_groups_and_wait_chain(cfg: Thresholds) -> list[Tile]:
    """The rank-time each process group loses, and which ranks wait for whom."""
    return [
        Tile(
            12,
            8,
            ts(
                "Rank-time lost per process group",
                "Share of the job's rank-time each process group's collectives take "
                "beyond the rank that spends least in them (groups by their mesh "
                f"dimension: dp, tp, pp, shard, ...), over {cfg.windows.straggler}; the "
                "groups together never past the time the ranks were blocked (a pipeline's "
                "receives, posted ahead, overlap its compute). Where a tensor- or "
                "pipeline-parallel job loses its time.",
                [q(rec(recorded.GROUP_WAIT), "{{group}}")],
                "percentunit",
                stack=True,
            ),
        ),
        Tile(
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
    ]


def _synchronization(cfg: Thresholds) -> list[Tile]:
    """The job's time lost to synchronization, and the ranks that arrive latest."""
    straggler = alert_threshold(cfg, "SyncscopeStraggler")
    return [
        Tile(
            12,
            8,
            ts(
                "Amplification, exposed communication, pacing",
                "Job-wide shares of rank time. Dashed line: the SyncscopeSyncAmplification threshold.",
                [
                    q(rec(recorded.SYNC_AMPLIFICATION), "waiting for peers"),
                    q(rec(recorded.COMM_EXPOSED_RATIO), "exposed communication"),
                    q(rec(recorded.PACING_RATIO), "pacing delay"),
                ],
                "percentunit",
                thresholds=alert_steps(cfg, "SyncscopeSyncAmplification"),
            ),
        ),
        Tile(
            12,
            8,
            ts(
                "Arrival lead: the latest ranks",
                "How early each rank reaches collectives compared with the last one, "
                f"job-wide (seconds per step, over {cfg.windows.straggler}), for the "
                f"{TOP} selected ranks lowest over the time range, and the job's median "
                "and band. The straggler sits at zero.",
                ranks_that_stand_out(
                    gauge_per_rank(cfg, recorded.LEAD, recorded=True), lowest=True
                ),
                "s",
                band=True,
            ),
        ),
        Tile(
            12,
            8,
            ts(
                "Arrival lead within each node",
                "How early each rank reaches collectives compared with the rank of its own "
                "node that waits least, as that node's exporter measures it (seconds per "
                "step, its last 64 steps), for the ranks lowest over the time range. A rank "
                "late within its node sits at zero here; a node whose ranks are all late "
                "shows only on the job-wide lead beside.",
                ranks_that_stand_out(gauge_per_rank(cfg, M.ARRIVAL_LEAD_SECONDS.name), lowest=True),
                "s",
                band=True,
            ),
        ),
        Tile(
            12,
            8,
            ts(
                "Arrival skew",
                "Latest minus earliest rank, as a share of the mean step. Dashed "
                "line: the SyncscopeStraggler threshold.",
                [q(rec(recorded.SKEW_RATIO), "{{job}}")],
                "percentunit",
                thresholds=steps((straggler, "orange")),
            ),
        ),
    ]


def _diagnosis(cfg: Thresholds) -> Tile:
    """The exporters' score for each failure mode."""
    return Tile(
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
        .thresholds(steps((cfg.diagnosis.verdict_score, "orange")))
        .with_target(
            q(
                f"max by (mode) ({sel(cfg, M.DIAGNOSIS.name, JOB)})",
                "{{mode}}",
                instant=True,
            ).ref_id("A")
        ),
    )


def _pacing(cfg: Thresholds) -> list[Tile]:
    """How many ranks are paced, by how much, how often."""
    engagements = ratio_per_rank(
        cfg, (M.PACING_ENGAGEMENTS_TOTAL.name, ()), (M.STEPS_TOTAL.name, ())
    )
    return [
        Tile(
            8,
            8,
            ts(
                "Ranks paced",
                "Share of the job's ranks whose pacing controller is delaying them "
                "now (paper §4.3, §5.3). Engaged without a break for long: see "
                "SyncscopePacingEngagedLong.",
                [
                    q(
                        f"{rec(recorded.PACING_ACTIVE)}\n/ on (job)\n  {rec(recorded.WORLD_SIZE)}",
                        "ranks paced",
                    )
                ],
                "percentunit",
                max_val=1,
            ),
        ),
        Tile(
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
        Tile(
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
    ]


def _active_alerts() -> Tile:
    """The syncscope alerts pending and firing, and for how long."""
    return Tile(
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
    )


def _agent_records(cfg: Thresholds) -> Tile:
    """The ranks whose agents drop records, and the records the exporters reject and ingest."""
    dropped = ratio_per_rank(
        cfg, (M.AGENT_RECORDS_DROPPED_TOTAL.name, ()), (M.STEPS_TOTAL.name, ())
    )
    return Tile(
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
    )


def _exporters(cfg: Thresholds) -> list[Tile]:
    """The exporters' own health: scraped or down, collectors failing, collection time."""
    listed = f"bottomk({MAX_SERIES}, max by (instance) (up{{{cfg.selectors.exporter}}}))"

    def of_listed(expr: str) -> Any:
        return q(f"{expr}\nand on (instance)\n  {listed}", instant=True, table_format=True)

    return [
        Tile(
            8,
            6,
            table_panel(
                "Exporters",
                "Scrape success of the syncscope exporters, down ones first (at most "
                f"{MAX_SERIES} listed), the ranks each holds (not stale) and whether its "
                "diagnosis reads the job-wide view back (--prometheus-url) or only its node's.",
                [
                    q(listed, instant=True, table_format=True),
                    of_listed(f"sum by (instance) ({M.EXPORTER_RANKS.name})"),
                    of_listed(f"max by (instance) ({M.EXPORTER_JOB_WIDE_VIEW.name})"),
                ],
                hide=("Time", "__name__", "job"),
                rename={
                    "instance": "Exporter",
                    "Value #A": "Scrape",
                    "Value #B": "Ranks",
                    "Value #C": "Job-wide view",
                },
                sort=("Value #A", False),
                mappings=value_map((0, "down", "red"), (1, "up", "green")),
                thresholds=steps((1, "green"), base="red"),
            ),
        ),
        Tile(
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
        Tile(
            8,
            6,
            ts(
                "Scrape collection time",
                "Time the exporters took to build a scrape's series: the slowest exporter and "
                "the median (each collector's time: an exporter's /v1/state, `collectors`).",
                [
                    q(f"max({M.EXPORTER_COLLECT_DURATION_SECONDS.name})", "slowest exporter"),
                    q(f"quantile(0.5, {M.EXPORTER_COLLECT_DURATION_SECONDS.name})", "median"),
                ],
                "s",
            ),
        ),
    ]
