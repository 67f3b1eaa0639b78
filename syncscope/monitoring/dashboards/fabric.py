"""The fabric and locality dashboard: fabric_locality() lists its rows; each function below gives
the tiles of one kind of panel in them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from grafana_foundation_sdk.builders import (
    heatmap,
)

from syncscope import catalog as M
from syncscope import recorded
from syncscope.monitoring.alerts.fabric import contention_floor
from syncscope.monitoring.dashboards.common import (
    BY_RANK,
    DS,
    JOB,
    MAX_SERIES,
    NODE,
    RANGE,
    RANK,
    RATE,
    TOP,
)
from syncscope.monitoring.dashboards.panels import (
    Row,
    Tile,
    alert_steps,
    alert_threshold,
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
from syncscope.thresholds import Thresholds

# The labels of a per-node and a per-group (op and process group) recorded series.
BY_NODE = "job, node"
BY_GROUP = "job, op, group"


def fabric_locality(cfg: Thresholds) -> list[Row]:
    """Rows for the fabric and GPU-locality failure modes: bandwidth, contention, skew, topology."""
    return [
        Row("Fabric: slow link and contention", [*_links(cfg), *_transfer(cfg)]),
        Row("Collectives", _collectives(cfg)),
        Row("Arrival skew", _arrival_skew(cfg)),
        Row("GPU locality", [_topology_table(cfg), _locality_faults(), *_gpu_state(cfg)]),
    ]


def _max_by(by: str, name: str) -> PerRank:
    """A recorded series' largest value per ``by`` labels (over a window: its mean's)."""

    def expr(window: str | None, at: str, matchers: Sequence[str]) -> str:
        s = rec(name, *matchers)
        inner = s if window is None else f"avg_over_time({s}[{window}]{at})"
        return f"max by ({by}) ({inner})"

    return expr


def _nodes_that_stand_out(name: str, *, lowest: bool = False) -> list[Any]:
    """Targets: the selected nodes highest (or lowest) on a recorded per-node series, and the
    job's median and band."""
    return ranks_that_stand_out(
        _max_by(BY_NODE, name), "{{node}}", lowest=lowest, by=BY_NODE, matchers=(NODE,)
    )


def _groups_that_stand_out(name: str, *, lowest: bool = False) -> list[Any]:
    """Targets: the 10 op/group pairs highest (or lowest) on a recorded per-group series."""
    return ranks_that_stand_out(
        _max_by(BY_GROUP, name),
        "{{op}} {{group}}",
        k=10,
        lowest=lowest,
        band=False,
        by=BY_GROUP,
        matchers=(),
    )


def _links(cfg: Thresholds) -> list[Tile]:
    """Each node's link: what it can carry, against the median node's, and how busy it is."""
    return [
        Tile(
            8,
            8,
            ts(
                "Link capacity: the slowest nodes",
                "What each node's link is known to carry each way (negotiated speed, "
                f"or a shaping of it), as its ranks read it at start: the {TOP} selected "
                "nodes lowest, and the job's median and band. In a synchronous "
                "collective the job moves at the pace of the lowest.",
                _nodes_that_stand_out(recorded.LINK_CAPACITY, lowest=True),
                "Bps",
                band=True,
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Slow link: capacity against the job's median node",
                "Each node's link capacity over the median node's, for the "
                f"{TOP} selected nodes lowest. Dashed line: the SyncscopeSlowLink "
                "threshold; a node under it is the slow link.",
                _nodes_that_stand_out(recorded.LINK_CAPACITY_RATIO, lowest=True),
                "percentunit",
                thresholds=steps(
                    (
                        alert_threshold(cfg, "SyncscopeSlowLink"),
                        "green",
                    ),
                    base="red",
                ),
                band=True,
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Link utilisation while the job transfers: the busiest nodes",
                "Each node's link throughput over the time the job spends in its "
                "transfer, as a share of the link's capacity, for the "
                f"{TOP} selected nodes highest: the slow link sits near 100 % while "
                "the others idle.",
                _nodes_that_stand_out(recorded.LINK_UTILIZATION),
                "percentunit",
                band=True,
            ),
        ),
    ]


def _transfer(cfg: Thresholds) -> list[Tile]:
    """The job's transfer per step (after its last rank arrives): bandwidth, time, inflation."""
    return [
        Tile(
            8,
            8,
            ts(
                "DDP bus bandwidth",
                "Gradient bytes per step over the job's transfer per step (the exposed "
                "sync after the last rank arrives), with nccl-tests' all-reduce factor "
                "2(n−1)/n.",
                [q(rec(recorded.DDP_BUS_BANDWIDTH), "{{job}}")],
                "Bps",
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Transfer per step",
                "The job's transfer per step (after its last rank arrives), from the "
                "steps every node samples alike.",
                [q(rec(recorded.TRANSFER_PER_STEP), "{{job}}")],
                "s",
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Transfer inflation (contention window)",
                "The recent transfer per step over its own 10th percentile in the "
                "baseline window: contention while it is above the dashed "
                "SyncscopeFabricContention threshold. A link slow from the start stays "
                "near 1 here and shows as the slow link instead.",
                [q(rec(recorded.TRANSFER_INFLATION), "{{job}}")],
                "none",
                thresholds=alert_steps(cfg, "SyncscopeFabricContention"),
            ),
        ),
    ]


def _collectives(cfg: Thresholds) -> list[Tile]:
    """Collectives by op and process group: bandwidth, transfer against wait, contention."""
    floor = contention_floor(cfg)
    seconds = sel(cfg, M.COLLECTIVE_SECONDS_TOTAL.name, JOB, NODE)
    wait = sel(cfg, M.COLLECTIVE_WAIT_SECONDS_TOTAL.name, JOB, NODE)
    return [
        Tile(
            12,
            8,
            ts(
                "Bus bandwidth by op: the slowest groups",
                "Achieved bus bandwidth (nccl-tests convention) from bytes and the "
                "transfer part of durations, for the 10 op/group pairs lowest over the "
                "time range; DDP's gradient sync is exposed time only and not shown.",
                _groups_that_stand_out(recorded.BUS_BANDWIDTH, lowest=True),
                "Bps",
            ),
        ),
        Tile(
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
        Tile(
            12,
            8,
            ts(
                "Transfer time per call: the slowest groups",
                "Transfer part of one call, job-wide, for the 10 op/group pairs "
                "highest over the time range.",
                _groups_that_stand_out(recorded.TRANSFER_PER_CALL),
                "s",
            ),
        ),
        Tile(
            12,
            8,
            ts(
                "Contention index: the most contended groups",
                "Transfer per call (per step for DDP's gradient sync) over its own "
                "10th percentile in the baseline window, for the 10 op/group pairs "
                "highest over the time range; calls other than DDP's only while arrival "
                "skew is low. Dashed line: the SyncscopeFabricContention threshold, "
                "which does not fire where the excess costs each rank less than "
                f"{pct(floor)} of its time ({recorded.CONTENTION_COST}): a tiny call can "
                "double and cost nothing.",
                _groups_that_stand_out(recorded.CONTENTION),
                "none",
                thresholds=alert_steps(cfg, "SyncscopeFabricContention"),
            ),
        ),
    ]


def _arrival_skew(cfg: Thresholds) -> list[Tile]:
    """How late each rank reaches collectives, who waits for it, and the job's skew."""
    lead = gauge_per_rank(cfg, recorded.LEAD, recorded=True)
    waiting = ratio_lead_per_step()
    return [
        Tile(
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
                ranks_that_stand_out(lead, "{{rank}}", k=20, lowest=True, band=False)[0].ref_id("A")
            ),
        ),
        Tile(
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
        Tile(
            24,
            6,
            ts(
                "Arrival skew",
                "Latest minus earliest rank (seconds) over the straggler window, job-wide "
                "(the rules), and the widest within one node (its exporter's own ranks): "
                "near the job's, the late rank's node holds early ranks too.",
                [
                    q(rec(recorded.SKEW), "{{job}}"),
                    q(
                        f"max by (job) ({sel(cfg, M.ARRIVAL_SKEW_SECONDS.name, JOB)})",
                        "{{job}} within a node",
                    ),
                ],
                "s",
            ),
        ),
    ]


def _topology_targets(cfg: Thresholds) -> list[Any]:
    """The Topology table's queries (A: GPU, NIC and NUMA placement; B..D: PCIe width and
    generation, NVLink links; E: locality faults), each for the same rows."""
    # The rows: 20 selected ranks with a GPU, those with locality faults first
    # (LOCALITY_FAULT has series only where a GPU has a fault: healthy ranks count 0).
    topology_rows = (
        f"topk(20,\n    sum by (job, rank) ({rec(recorded.LOCALITY_FAULT, NODE, RANK)})\n  or\n"
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
        f"(\n    sum by ({BY_RANK}) ({rec(recorded.LOCALITY_FAULT, NODE, RANK)})\n  or\n"
        f"    0 * max by ({BY_RANK}) ({sel(cfg, M.GPU_INFO.name, JOB, NODE, RANK)})\n)\n"
        f"and on (job, rank)\n  {topology_rows}"
    )
    return [
        q(info, instant=True, table_format=True),
        topology(M.GPU_PCIE_LINK_WIDTH.name),
        topology(M.GPU_PCIE_LINK_GENERATION.name),
        topology(M.GPU_NVLINK_ACTIVE_LINKS.name),
        q(faults, instant=True, table_format=True),
    ]


def _topology_table(cfg: Thresholds) -> Tile:
    """GPU, NIC, PCIe, NVLink and NUMA placement of the selected ranks, faults first."""
    return Tile(
        16,
        8,
        table_panel(
            "Topology",
            "GPU, NIC, PCIe link (under load vs what the GPU and slot support), NVLink, "
            "NUMA placement and locality faults of the selected ranks, those with faults "
            "first (20 at most).",
            _topology_targets(cfg),
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
    )


def _locality_faults() -> Tile:
    """The locality faults present on the selected ranks."""
    return Tile(
        8,
        8,
        table_panel(
            "Locality faults",
            "Faults present (PCIe below max width or generation, or NUMA mismatch: "
            f"SyncscopeLocalityFault) on the selected ranks, faults first ({MAX_SERIES} "
            "rows at most).",
            [
                q(
                    f"topk({MAX_SERIES}, {rec(recorded.LOCALITY_FAULT, NODE, RANK)})",
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
    )


def _gpu_state(cfg: Thresholds) -> list[Tile]:
    """The GPUs that stand out: the slowest clocks, the hottest, the most power, throttling."""
    return [
        Tile(
            8,
            8,
            ts(
                "SM clock: the slowest GPUs",
                f"Streaming-multiprocessor clock of the {TOP} selected ranks lowest, and "
                "the job's median and band.",
                ranks_that_stand_out(gauge_per_rank(cfg, M.GPU_SM_CLOCK_HERTZ.name), lowest=True),
                "hertz",
                band=True,
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Temperature: the hottest GPUs",
                f"GPU temperature of the {TOP} selected ranks highest, and the job's "
                "median and band.",
                ranks_that_stand_out(gauge_per_rank(cfg, M.GPU_TEMPERATURE_CELSIUS.name)),
                "celsius",
                band=True,
            ),
        ),
        Tile(
            8,
            8,
            ts(
                "Power: the GPUs drawing most",
                f"GPU power draw of the {TOP} selected ranks highest, and the job's "
                "median and band.",
                ranks_that_stand_out(gauge_per_rank(cfg, M.GPU_POWER_WATTS.name)),
                "watt",
                band=True,
            ),
        ),
        Tile(
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
        _gpu_faults(cfg),
    ]


def _gpu_faults(cfg: Thresholds) -> Tile:
    """The GPUs with hardware faults over the time range: XID errors, uncorrected ECC errors,
    row remapping (the exporter's verdict names them as the infrastructure's)."""

    def faulted(metric: str, counter: bool = False) -> Any:
        """The ranks with the fault: a counter's that grew over the range, a gauge's present."""
        selected = sel(cfg, metric, JOB, NODE, RANK)
        expr = f"increase({selected}[{RANGE}]) > 0" if counter else selected
        return q(f"topk(20, max by ({BY_RANK}) ({expr}))", instant=True, table_format=True)

    return Tile(
        24,
        6,
        table_panel(
            "GPU faults",
            "The selected ranks whose GPU had a hardware fault in the time range (20 at most): "
            "XID errors NVML delivered and the last code, uncorrected ECC errors, rows pending "
            "remap or failed to remap. Empty: none, or no GPU.",
            [
                faulted(M.GPU_XID_ERRORS_TOTAL.name, counter=True),
                faulted(M.GPU_LAST_XID.name),
                faulted(M.GPU_ECC_UNCORRECTED_ERRORS_TOTAL.name, counter=True),
                faulted(M.GPU_ROW_REMAP_PENDING.name),
                faulted(M.GPU_ROW_REMAP_FAILURE.name),
            ],
            hide=("Time", "__name__", "job"),
            rename={
                "node": "Node",
                "rank": "Rank",
                "Value #A": "XID errors",
                "Value #B": "Last XID",
                "Value #C": "Uncorrected ECC",
                "Value #D": "Remap pending",
                "Value #E": "Remap failed",
            },
            thresholds=steps((1, "red")),
        ),
    )
