"""Baseline-versus-pacing comparison across node counts, printed beside the paper's Table 1."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from syncscope.sim.engine import SimSummary, Simulator
from syncscope.sim.params import SimParams


@dataclass
class ComparisonRow:
    """One node count: the same job (same seed) without and with the pacing controller."""

    nodes: int
    baseline: SimSummary
    paced: SimSummary

    @property
    def throughput_gain(self) -> float:
        return self.paced.throughput / self.baseline.throughput - 1.0


@dataclass
class Comparison:
    name: str
    description: str
    params: SimParams
    rows: list[ComparisonRow]

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "rows": [
                {
                    "nodes": r.nodes,
                    "baseline": r.baseline.as_dict(),
                    "paced": r.paced.as_dict(),
                    "throughput_gain": r.throughput_gain,
                }
                for r in self.rows
            ],
        }


def compare(
    params: SimParams,
    nodes: list[int] | None = None,
    *,
    steps: int | None = None,
    warmup_steps: int | None = None,
    seed: int | None = None,
    progress: Callable[[int], None] | None = None,
    name: str | None = None,
    description: str = "",
) -> Comparison:
    """Run every node count twice (baseline, paced) with common random numbers."""
    rows = []
    for n in nodes or list(params.nodes):
        baseline = Simulator(params, n, seed=seed).run(steps, warmup_steps, progress)
        paced = Simulator(params, n, pacing=True, seed=seed).run(steps, warmup_steps, progress)
        rows.append(ComparisonRow(n, baseline, paced))
    return Comparison(name or params.name, description or params.description, params, rows)


def ablations(params: SimParams) -> list[tuple[str, str, SimParams]]:
    """The parameter file's ablations: (name, description, params with overrides applied)."""
    out = []
    for entry in params.extra.get("ablations", []):
        out.append(
            (entry["name"], entry.get("description", ""), params.with_overrides(entry["overrides"]))
        )
    return out


def steps_needed(params: SimParams, nodes: list[int] | None, runs_per_size: int = 2) -> int:
    """Total simulated steps of a comparison (for the progress bar)."""
    count = len(nodes or params.nodes)
    return count * runs_per_size * (params.steps + params.warmup_steps)


def format_paper_table(comparison: Comparison) -> str:
    """Side-by-side text table: paper numbers (where the file has them) and the simulator's."""
    paper = comparison.params.extra.get("paper", {})
    paper_nodes = list(paper.get("nodes", []))

    def ref(key: str, nodes: int) -> float | None:
        if nodes in paper_nodes and key in paper:
            return float(paper[key][paper_nodes.index(nodes)])
        return None

    def num(value: float | None, fmt: str) -> str:
        return "—" if value is None else format(value, fmt)

    head = (
        f"{'nodes':>5} {'ranks':>5} │ {'paper base':>10} {'sim base':>9} │ "
        f"{'paper coord':>11} {'sim coord':>9} │ {'paper Δ':>8} {'sim Δ':>7} │ "
        f"{'paper CV':>8} {'sim CV':>7} │ {'paper CV':>8} {'sim CV':>7}"
    )
    lines = [
        f"{comparison.name}: {comparison.description}".rstrip(": "),
        f"{'':11} │ {'throughput, baseline':^20} │ {'throughput, pacing':^21} │ "
        f"{'gain':^16} │ {'CV, baseline':^16} │ {'CV, pacing':^16}",
        head,
        "─" * len(head),
    ]
    first = comparison.rows[0] if comparison.rows else None
    for r in comparison.rows:
        pb, pc = ref("baseline_throughput", r.nodes), ref("coordination_throughput", r.nodes)
        paper_gain = (pc / pb - 1.0) * 100 if pb and pc else None
        lines.append(
            f"{r.nodes:>5} {r.baseline.ranks:>5} │ {num(pb, '10.0f')} "
            f"{r.baseline.throughput:>9.0f} │ {num(pc, '11.0f')} {r.paced.throughput:>9.0f} │ "
            f"{num(paper_gain, '+7.1f')}% {r.throughput_gain * 100:>+6.1f}% │ "
            f"{num(ref('baseline_cv', r.nodes), '8.2f')} {r.baseline.cv:>7.3f} │ "
            f"{num(ref('coordination_cv', r.nodes), '8.2f')} {r.paced.cv:>7.3f}"
        )
    lines.append("")
    lines.append(
        f"{'nodes':>5} │ {'eff. base':>9} {'eff. pace':>9} │ {'wait base':>9} {'wait pace':>9} │ "
        f"{'delay':>7} {'paced':>6} │ {'comm/bucket base':>16} {'pace':>7} {'idle fabric':>11}"
    )
    for r in comparison.rows:
        b, p = r.baseline, r.paced
        eff_b = eff_p = None
        if first is not None:
            unit = first.baseline.throughput / first.baseline.ranks
            eff_b = b.throughput / b.ranks / unit
            eff_p = p.throughput / p.ranks / unit
        lines.append(
            f"{r.nodes:>5} │ {num(eff_b, '9.3f')} {num(eff_p, '9.3f')} │ "
            f"{b.mean_wait_s * 1e3:>7.1f}ms {p.mean_wait_s * 1e3:>7.1f}ms │ "
            f"{p.mean_delay_s * 1e3:>5.1f}ms {p.paced_fraction:>6.0%} │ "
            f"{b.mean_bucket_comm_s * 1e3:>14.1f}ms {p.mean_bucket_comm_s * 1e3:>5.1f}ms "
            f"{b.ideal_bucket_comm_s * 1e3:>9.1f}ms"
        )
    return "\n".join(lines)


def format_ablation(comparison: Comparison) -> str:
    """Compact table for an ablation: does pacing help when its mechanism is absent?"""
    head = (
        f"{'nodes':>5} {'ranks':>5} │ {'base thr':>9} {'pace thr':>9} {'Δ':>7} │ "
        f"{'CV base':>7} {'CV pace':>7} │ {'wait base':>9} {'wait pace':>9} {'delay':>7}"
    )
    lines = [f"{comparison.name}: {comparison.description}", head, "─" * len(head)]
    for r in comparison.rows:
        b, p = r.baseline, r.paced
        lines.append(
            f"{r.nodes:>5} {b.ranks:>5} │ {b.throughput:>9.0f} {p.throughput:>9.0f} "
            f"{r.throughput_gain * 100:>+6.2f}% │ {b.cv:>7.3f} {p.cv:>7.3f} │ "
            f"{b.mean_wait_s * 1e3:>7.1f}ms {p.mean_wait_s * 1e3:>7.1f}ms "
            f"{p.mean_delay_s * 1e3:>5.1f}ms"
        )
    return "\n".join(lines)
