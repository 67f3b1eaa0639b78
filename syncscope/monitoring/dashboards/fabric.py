"""The fabric and locality dashboard, one function per row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import (
    heatmap,
)

from syncscope import catalog as M
from syncscope import recorded as R
from syncscope.monitoring.alerts.fabric import contention_floor
from syncscope.monitoring.dashboards.common import (
    BY_RANK,
    DS,
    JOB,
    MAX_SERIES,
    NODE,
    RANK,
    RATE,
    TOP,
)
from syncscope.monitoring.dashboards.panels import (
    alert_steps,
    prop,
    q,
    steps,
    table_panel,
    ts,
    value_map,
    value_map_json,
)
from syncscope.monitoring.dashboards.queries import (
    PerRank,
    gauge_per_rank,
    ranks_that_stand_out,
    ratio_lead_per_step,
    rec,
)
from syncscope.monitoring.promql import pct, sel
from syncscope.thresholds import Thresholds, required


def fabric_locality(cfg: Thresholds) -> list[tuple[str, list[tuple[int, int, Any]]]]:
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

    lead = gauge_per_rank(cfg, R.LEAD, recorded=True)
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
        f"max by ({BY_RANK}, name, pci_bus_id, numa_node, process_numa_nodes, nic, "
        "nic_distance, pcie_link_max_width, pcie_link_max_generation) "
        f"({sel(cfg, M.GPU_INFO.name, JOB, NODE, RANK)})\nand on (job, rank)\n  {topology_rows}"
    )
    # How many locality faults each row's GPU has (0 where none: healthy GPUs write no series).
    faults = (
        f"(\n    sum by ({BY_RANK}) ({rec(R.LOCALITY_FAULT, NODE, RANK)})\n  or\n"
        f"    0 * max by ({BY_RANK}) ({sel(cfg, M.GPU_INFO.name, JOB, NODE, RANK)})\n)\n"
        f"and on (job, rank)\n  {topology_rows}"
    )
    return [
        _fabric_slow_link_and_contention(cfg, nodes=nodes),
        _fabric_collectives(cfg, seconds=seconds, wait=wait, groups=groups),
        _fabric_arrival_skew(cfg, lead=lead, waiting=waiting),
        _fabric_gpu_locality(cfg, gpu_rank=gpu_rank, topology=topology, info=info, faults=faults),
    ]


def _fabric_slow_link_and_contention_1(
    cfg: Thresholds, *, nodes: Any
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
                    (
                        required(cfg.alerts["SyncscopeSlowLink"].levels[0].threshold, "threshold"),
                        "green",
                    ),
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


def _fabric_slow_link_and_contention_2(cfg: Thresholds) -> list[tuple[int, int, Any]]:
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
    cfg: Thresholds, *, nodes: Any
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
    cfg: Thresholds, *, seconds: Any, wait: Any, groups: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Fabric row: Collectives."""
    floor = contention_floor(cfg)
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
                    "skew is low. Dashed line: the SyncscopeFabricContention threshold, "
                    "which does not fire where the excess costs each rank less than "
                    f"{pct(floor)} of its time ({R.CONTENTION_COST}): a tiny call can "
                    "double and cost nothing.",
                    groups(R.CONTENTION),
                    "none",
                    thresholds=alert_steps(cfg, "SyncscopeFabricContention"),
                ),
            ),
        ],
    )


def _fabric_arrival_skew(
    cfg: Thresholds, *, lead: Any, waiting: Any
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
    cfg: Thresholds, *, gpu_rank: Any, topology: Any, info: Any, faults: Any
) -> list[tuple[int, int, Any]]:
    """Fabric row "GPU locality", panels, part 1."""
    return [
        (
            16,
            8,
            table_panel(
                "Topology",
                "GPU, NIC, PCIe link (under load vs what the GPU and slot support), NVLink, "
                "NUMA placement and locality faults of the selected ranks, those with faults "
                "first (20 at most).",
                [
                    q(info, instant=True, table_format=True),
                    topology(M.GPU_PCIE_LINK_WIDTH.name),
                    topology(M.GPU_PCIE_LINK_GENERATION.name),
                    topology(M.GPU_NVLINK_ACTIVE_LINKS.name),
                    q(faults, instant=True, table_format=True),
                ],
                hide=("Time", "__name__", "job", "Value #A"),
                rename={
                    "node": "Node",
                    "rank": "Rank",
                    "name": "GPU",
                    "pci_bus_id": "PCI bus",
                    "numa_node": "NUMA node",
                    "process_numa_nodes": "process NUMA nodes",
                    "nic": "NIC",
                    "nic_distance": "NIC distance",
                    "pcie_link_max_width": "max width",
                    "pcie_link_max_generation": "max gen",
                    "Value #B": "PCIe width",
                    "Value #C": "PCIe gen",
                    "Value #D": "NVLink links",
                    "Value #E": "locality faults",
                },
                columns={
                    "locality faults": [
                        prop("mappings", value_map_json((0, "ok", "green"))),
                        prop(
                            "thresholds",
                            {
                                "mode": "absolute",
                                "steps": [
                                    {"color": "green", "value": None},
                                    {"color": "red", "value": 1},
                                ],
                            },
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


def _fabric_gpu_locality_2(cfg: Thresholds, *, gpu_rank: Any) -> list[tuple[int, int, Any]]:
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
    cfg: Thresholds, *, gpu_rank: Any, topology: Any, info: Any, faults: Any
) -> tuple[str, list[tuple[int, int, Any]]]:
    """Fabric row: GPU locality."""
    return (
        "GPU locality",
        [
            *_fabric_gpu_locality_1(
                cfg, gpu_rank=gpu_rank, topology=topology, info=info, faults=faults
            ),
            *_fabric_gpu_locality_2(cfg, gpu_rank=gpu_rank),
        ],
    )
