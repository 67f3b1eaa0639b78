"""The triage row: the late ranks with where, why, since when and at what cost."""

from __future__ import annotations

from typing import Any

from grafana_foundation_sdk.models import dashboard as dm

from syncscope import catalog as M
from syncscope import recorded
from syncscope.monitoring.dashboards.common import (
    FABRIC_UID,
    JOB,
    KEEP,
    OVERVIEW_UID,
    PHASE_COLUMNS,
    TRIAGE_PHASES,
    TRIAGE_ROWS,
)
from syncscope.monitoring.dashboards.panels import (
    Tile,
    alert_threshold,
    link,
    prop,
    q,
    stat_panel,
    steps,
    table_panel,
)
from syncscope.monitoring.dashboards.queries import (
    idle_gpus_from_skew,
    late_rows,
    lateness,
    on_straggler,
    phase_per_step,
    rec,
    straggler_alert_age,
)
from syncscope.monitoring.promql import sel
from syncscope.thresholds import Thresholds


def triage_table(cfg: Thresholds) -> Any:
    """The triage row's table: the latest ranks with their node, GPU, cause, phases against the
    job's median rank, alert age and cost (targets A..L merged on job and rank)."""
    straggler = alert_threshold(cfg, "SyncscopeStraggler")
    window = cfg.windows.straggler
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


def _triage_targets(cfg: Thresholds, window: str) -> list[Any]:
    """A lateness, B of a step, C cause, D GPU, E last report, F.. phases, K alert, L cost."""
    median = "\n- on (job) group_left ()\n  quantile by (job) (0.5, {0})"
    targets = [
        q(f"topk({TRIAGE_ROWS}, {lateness()})", instant=True, table_format=True),
        q(
            late_rows(f"({lateness()})\n/ on (job) group_left ()\n  {rec(recorded.STEP_MEAN)}"),
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


def triage(cfg: Thresholds) -> list[Tile]:
    """The triage row: the late ranks, what their lateness costs, since when it is known."""
    return [
        Tile(24, 8, triage_table(cfg)),
        *_cost_of_lateness(),
        *_straggler_alert_and_ranks_reporting(),
    ]


def _cost_of_lateness() -> list[Tile]:
    """What waiting for the late ranks costs: idle GPUs, throughput against its own best."""
    return [
        Tile(
            6,
            4,
            stat_panel(
                "Idle GPU-hours per hour",
                "GPUs idle waiting at collectives for the last peer, on average: the "
                "synchronization-amplification ratio times the world size (transient waits "
                "included). What the job loses, in GPU-hours per hour.",
                [
                    q(
                        f"{rec(recorded.SYNC_AMPLIFICATION)}\n* on (job)\n  {rec(recorded.WORLD_SIZE)}",
                        "{{job}}",
                    )
                ],
                "suffix: GPU-h/h",
                thresholds=steps((1, "orange")),
            ),
        ),
        Tile(
            6,
            4,
            stat_panel(
                "Throughput against the last hour's best",
                "Steps per second now over the highest rate of the last hour: below 100 % the "
                "job runs slower than it did itself.",
                [
                    q(
                        f"{rec(recorded.STEPS_RATE)}\n/ on (job)\n  "
                        f"(max_over_time({rec(recorded.STEPS_RATE)}[1h]) > 0)",
                        "{{job}}",
                    )
                ],
                "percentunit",
                thresholds=steps((0.8, "orange"), (0.95, "green"), base="red"),
            ),
        ),
    ]


def _straggler_alert_and_ranks_reporting() -> list[Tile]:
    """Since when the straggler alert is active, and whether every rank reports."""
    return [
        Tile(
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
        Tile(
            6,
            4,
            stat_panel(
                "Ranks reporting",
                "Ranks whose records reach an exporter, against the world size the ranks "
                "report. Fewer reporting: see SyncscopeRankSilent.",
                [
                    q(rec(recorded.RANKS_REPORTING), "reporting"),
                    q(rec(recorded.WORLD_SIZE), "world size"),
                ],
                "none",
            ),
        ),
    ]
