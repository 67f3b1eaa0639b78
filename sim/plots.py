"""PNG plots of simulations and projections (matplotlib, imported only when a plot is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from syncscope.sim.projection import Projection
from syncscope.sim.table1 import Comparison


class PlotsUnavailable(RuntimeError):
    """matplotlib is missing: plots are an optional extra."""


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotsUnavailable(
            "plots need matplotlib: pip install 'syncscope[plots]' (or drop --plot-dir)"
        ) from exc
    return plt


def plot_comparison(comparison: Comparison, out_dir: str | Path) -> list[Path]:
    """Throughput vs nodes against ideal, CV vs nodes, and baseline vs pacing; returns paths."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = comparison.rows
    nodes = [r.nodes for r in rows]
    base = [r.baseline.throughput for r in rows]
    paced = [r.paced.throughput for r in rows]
    ideal = [base[0] * n / nodes[0] for n in nodes] if rows else []
    paper = comparison.params.extra.get("paper", {})
    stem = comparison.name.replace(" ", "_")
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(nodes, ideal, "k:", label="ideal (linear from the smallest)")
    ax.plot(nodes, base, "o-", label="simulated baseline")
    ax.plot(nodes, paced, "s-", label="simulated with pacing")
    if paper.get("nodes"):
        ax.plot(
            paper["nodes"], paper["baseline_throughput"], "o--", alpha=0.5, label="paper baseline"
        )
        ax.plot(
            paper["nodes"],
            paper["coordination_throughput"],
            "s--",
            alpha=0.5,
            label="paper coordination",
        )
    ax.set(xlabel="nodes", ylabel="throughput (samples/s)", title="Throughput vs nodes")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, out / f"{stem}_throughput.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(nodes, [r.baseline.cv for r in rows], "o-", label="simulated baseline")
    ax.plot(nodes, [r.paced.cv for r in rows], "s-", label="simulated with pacing")
    if paper.get("nodes"):
        ax.plot(paper["nodes"], paper["baseline_cv"], "o--", alpha=0.5, label="paper baseline")
        ax.plot(
            paper["nodes"], paper["coordination_cv"], "s--", alpha=0.5, label="paper coordination"
        )
    ax.set(xlabel="nodes", ylabel="CV of step time", title="Step-time variability vs nodes")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, out / f"{stem}_cv.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    width = 0.38
    xs = list(range(len(nodes)))
    ax.bar(
        [x - width / 2 for x in xs], [r.baseline.mean_step_s for r in rows], width, label="baseline"
    )
    ax.bar([x + width / 2 for x in xs], [r.paced.mean_step_s for r in rows], width, label="pacing")
    for x, r in zip(xs, rows, strict=True):
        ax.annotate(
            f"{r.throughput_gain:+.1%}",
            (x, max(r.baseline.mean_step_s, r.paced.mean_step_s)),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(xs, [str(n) for n in nodes])
    ax.set(xlabel="nodes", ylabel="mean step time (s)", title="Baseline vs pacing")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, out / f"{stem}_pacing.png"))
    return paths


def plot_projection(
    projection: Projection, out_dir: str | Path, measured: dict[int, float] | None = None
) -> list[Path]:
    """Projected throughput (with band) against ideal, and CV; ``measured`` adds held-out points."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pts = projection.points
    ranks = [p.ranks for p in pts]
    mid = [p.throughput[1] for p in pts]
    ref = pts[0]
    ideal = [ref.throughput[1] * n / ref.ranks for n in ranks]
    paths = []

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.plot(ranks, ideal, "k:", label="ideal")
    ax.fill_between(
        ranks,
        [p.throughput[0] for p in pts],
        [p.throughput[2] for p in pts],
        alpha=0.25,
        label="5–95 % band",
    )
    ax.plot(ranks, mid, "o-", label="projected")
    if measured:
        xs = sorted(measured)
        ax.plot(xs, [measured[x] for x in xs], "kx", markersize=9, label="measured")
    ax.set(xlabel="ranks", ylabel="throughput (samples/s)", title="Projected throughput")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, out / "projection_throughput.png"))

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.fill_between(
        ranks, [p.cv[0] for p in pts], [p.cv[2] for p in pts], alpha=0.25, label="5–95 % band"
    )
    ax.plot(ranks, [p.cv[1] for p in pts], "o-", label="projected CV")
    ax.set(xlabel="ranks", ylabel="CV of step time", title="Projected step-time variability")
    ax.set_xscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    paths.append(_save(fig, plt, out / "projection_cv.png"))
    return paths


def _save(fig: Any, plt: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
