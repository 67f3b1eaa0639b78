"""The ``syncscope simulate`` and ``syncscope project`` subcommands (registered by the top CLI)."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from syncscope.sim.params import SimParams, bundled_params, load_params

PAPER_TABLE1 = "paper_table1"


def add_subcommands(subparsers: Any) -> None:
    """Register ``simulate`` and ``project`` on an argparse subparsers object.

    Each parser gets ``func(args) -> int`` as its default, so the top-level CLI only has to call
    ``args.func(args)``.
    """
    sim = subparsers.add_parser(
        "simulate",
        help="simulate synchronous data-parallel training, with and without pacing",
        description=(
            "Simulate a synchronous data-parallel job at several node counts, baseline and with "
            "the agent's pacing controller in the loop. --paper-table1 prints the comparison "
            "with the paper's Table 1 (parameters in sim/params/paper_table1.json)."
        ),
    )
    sim.add_argument(
        "--params",
        default=None,
        help=f"parameter file (JSON) or bundled set ({', '.join(bundled_params())}); "
        f"default {PAPER_TABLE1}",
    )
    sim.add_argument(
        "--paper-table1",
        action="store_true",
        help="run the paper's Table 1 parameter set and print it side by side with the paper",
    )
    sim.add_argument("--nodes", type=int, nargs="+", help="node counts (default: from the params)")
    sim.add_argument("--steps", type=int, help="measured steps per run (default: from the params)")
    sim.add_argument("--warmup", type=int, help="warm-up steps per run, not counted")
    sim.add_argument("--seed", type=int, help="random seed (default: from the params)")
    sim.add_argument(
        "--pacing",
        choices=("both", "off", "on"),
        default="both",
        help="baseline and paced side by side (default), or one of them",
    )
    sim.add_argument(
        "--no-ablations", action="store_true", help="skip the ablations listed in the params"
    )
    sim.add_argument("--plot-dir", type=Path, help="write PNG plots into this folder")
    sim.add_argument("--json", type=Path, help="write all results as JSON to this file")
    sim.add_argument(
        "--record",
        type=Path,
        help="write the simulated job's step records (the agent's JSON-lines format) to this "
        "file; needs exactly one --nodes and --pacing off or on",
    )
    sim.set_defaults(func=run_simulate)

    proj = subparsers.add_parser(
        "project",
        help="fit a measured run and project it to larger world sizes",
        description=(
            "Fit per-rank compute and communication to measured runs (agent JSON-lines records, "
            "the exporter's /v1/state JSON, or a Prometheus range query) and project step time, "
            "throughput, scaling efficiency and CV at larger world sizes, with bootstrap bands."
        ),
    )
    proj.add_argument(
        "runs",
        nargs="+",
        help="measured runs: files, or http(s) URLs of an exporter's /v1/state; several world "
        "sizes fit the latency and bandwidth terms of the all-reduce separately",
    )
    proj.add_argument("--format", default="auto", choices=("auto", "jsonl", "state", "prometheus"))
    proj.add_argument("--to", type=int, nargs="+", help="target world sizes (ranks)")
    proj.add_argument(
        "--max-ranks",
        type=int,
        default=4096,
        help="without --to: project 2x, 4x, ... the largest measured size up to this (default 4096)",
    )
    proj.add_argument(
        "--samples-per-rank",
        type=float,
        default=1.0,
        help="samples per rank per step, for throughput in samples/s (default 1: rank-steps/s)",
    )
    proj.add_argument("--bootstrap", type=int, default=20, help="bootstrap refits for the bands")
    proj.add_argument("--steps", type=int, default=1000, help="simulated steps per projection")
    proj.add_argument("--seed", type=int, default=0)
    proj.add_argument(
        "--compare",
        nargs="+",
        default=[],
        help="measured runs at held-out sizes: prints predicted vs measured (and projects there)",
    )
    proj.add_argument("--plot-dir", type=Path, help="write PNG plots into this folder")
    proj.add_argument("--json", type=Path, help="write the fit and projection as JSON")
    proj.set_defaults(func=run_project)


def _error(message: str) -> int:
    print(f"syncscope: {message}", file=sys.stderr)
    return 2


def run_simulate(args: argparse.Namespace) -> int:
    from syncscope.sim.engine import Simulator
    from syncscope.sim.progress import Progress
    from syncscope.sim.table1 import (
        ablations,
        compare,
        format_ablation,
        format_paper_table,
        steps_needed,
    )

    try:
        params = load_params(PAPER_TABLE1 if args.paper_table1 else (args.params or PAPER_TABLE1))
    except (OSError, ValueError, TypeError) as exc:
        return _error(f"cannot load parameters: {exc}")
    params = _apply_run_settings(params, args)
    nodes = args.nodes or list(params.nodes)
    if any(n < 1 for n in nodes):
        return _error("--nodes must be positive")

    if args.record is not None:
        return _record(params, nodes, args)

    results: dict[str, Any] = {"params": params.to_dict()}
    if args.pacing != "both" and not args.paper_table1:
        summaries = []
        total = len(nodes) * (params.steps + params.warmup_steps)
        with Progress(total, "simulate") as bar:
            for n in nodes:
                sim = Simulator(params, n, pacing=args.pacing == "on")
                summaries.append(sim.run(progress=bar))
        print(_format_single(params, summaries))
        results["runs"] = [s.as_dict() for s in summaries]
        return _write_json(args.json, results)

    studies = [("main", params, "")]
    if not args.no_ablations:
        studies += [(name, p, desc) for name, desc, p in ablations(params)]
    total = sum(steps_needed(p, nodes) for _, p, _ in studies)
    comparisons = []
    with Progress(total, "simulate") as bar:
        for name, p, desc in studies:
            label = params.name if name == "main" else f"ablation '{name}'"
            comparisons.append(compare(p, nodes, progress=bar, name=label, description=desc))
    print(
        f"steps per run: {params.steps} after {params.warmup_steps} warm-up; seed {params.seed}; "
        "baseline and pacing share random numbers\n"
    )
    print(format_paper_table(comparisons[0]))
    for c in comparisons[1:]:
        print()
        print(format_ablation(c))
    results["comparisons"] = [c.as_dict() for c in comparisons]
    if args.plot_dir is not None:
        code = _plots(lambda: _plot_comparison(comparisons[0], args.plot_dir))
        if code:
            return code
    return _write_json(args.json, results)


def _apply_run_settings(params: SimParams, args: argparse.Namespace) -> SimParams:
    overrides: dict[str, Any] = {}
    if args.steps is not None:
        overrides["steps"] = args.steps
    if args.warmup is not None:
        overrides["warmup_steps"] = args.warmup
    if args.seed is not None:
        overrides["seed"] = args.seed
    return params.with_overrides(overrides) if overrides else params


def _record(params: SimParams, nodes: list[int], args: argparse.Namespace) -> int:
    from syncscope.sim.engine import Simulator
    from syncscope.sim.records import run_from_simulation, write_jsonl

    if len(nodes) != 1 or args.pacing == "both":
        return _error("--record needs exactly one --nodes value and --pacing off or on")
    sim = Simulator(params, nodes[0], pacing=args.pacing == "on")
    lines = write_jsonl(args.record, run_from_simulation(sim, params.steps, params.warmup_steps))
    print(f"wrote {lines} step records ({sim.ranks} ranks x {params.steps} steps) to {args.record}")
    return 0


def _format_single(params: SimParams, summaries: list[Any]) -> str:
    head = (
        f"{'nodes':>5} {'ranks':>5} {'pacing':>6} │ {'step ms':>8} {'p99 ms':>8} {'CV':>6} │ "
        f"{'samples/s':>10} {'eff.':>6} │ {'wait ms':>7} {'delay ms':>8} │ phase shares"
    )
    lines = [f"{params.name}: {params.description}", head, "─" * len(head)]
    unit = summaries[0].throughput / summaries[0].ranks if summaries else 1.0
    for s in summaries:
        shares = " ".join(f"{k[:4]} {v:.0%}" for k, v in s.phase_shares.items() if v >= 0.005)
        lines.append(
            f"{s.nodes:>5} {s.ranks:>5} {'on' if s.pacing else 'off':>6} │ "
            f"{s.mean_step_s * 1e3:>8.1f} {s.p99_step_s * 1e3:>8.1f} {s.cv:>6.3f} │ "
            f"{s.throughput:>10.0f} {s.throughput / s.ranks / unit:>6.3f} │ "
            f"{s.mean_wait_s * 1e3:>7.1f} {s.mean_delay_s * 1e3:>8.1f} │ {shares}"
        )
    return "\n".join(lines)


def _plots(draw: Any) -> int:
    from syncscope.sim.plots import PlotsUnavailable

    try:
        for path in draw():
            print(f"plot: {path}")
    except PlotsUnavailable as exc:
        return _error(str(exc))
    return 0


def _plot_comparison(comparison: Any, out_dir: Path) -> list[Path]:
    from syncscope.sim.plots import plot_comparison

    return plot_comparison(comparison, out_dir)


def _write_json(path: Path | None, results: dict[str, Any]) -> int:
    if path is not None:
        path.write_text(json.dumps(results, indent=2, default=_jsonable))
        print(f"results: {path}")
    return 0


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "as_dict"):
        return value.as_dict()
    return str(value)


def _load(source: str, fmt: str) -> Any:
    from syncscope.sim.records import from_exporter_state, from_prometheus, load_run

    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=30) as response:  # noqa: S310 - user's URL
            obj = json.loads(response.read())
        if fmt == "prometheus" or (fmt == "auto" and "data" in obj):
            return from_prometheus(obj, source)
        return from_exporter_state(obj, source)
    return load_run(source, fmt)


def run_project(args: argparse.Namespace) -> int:
    from syncscope.sim.progress import Progress
    from syncscope.sim.projection import default_targets, project

    try:
        runs = [_load(src, args.format) for src in args.runs]
        held_out = [_load(src, args.format) for src in args.compare]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return _error(f"cannot load measured run: {exc}")
    reference = max(r.world_size for r in runs)
    targets = args.to or default_targets(reference, args.max_ranks)
    targets = sorted(set(targets) | {r.world_size for r in held_out})
    if any(t < 1 for t in targets):
        return _error("--to must be positive")
    per_replicate = sum(1 for _ in {reference, *targets}) * (args.steps + 100)
    try:
        with Progress(per_replicate * (args.bootstrap + 1), "project") as bar:
            result = project(
                runs,
                targets,
                samples_per_rank=args.samples_per_rank,
                bootstrap=args.bootstrap,
                steps=args.steps,
                seed=args.seed,
                progress=bar,
            )
    except ValueError as exc:
        return _error(str(exc))
    print(format_fit(runs, result.model))
    print()
    print(format_projection(result, held_out))
    output: dict[str, Any] = {"projection": result.as_dict()}
    if held_out:
        comparison = compare_held_out(result, held_out)
        print()
        print(format_held_out(comparison))
        output["held_out"] = comparison
    if args.plot_dir is not None:
        from syncscope.sim.plots import plot_projection

        # Every measured size on the plot: the ones fitted and the held-out ones.
        measured = {
            size: args.samples_per_rank * size / m["mean_step_s"]
            for size, m in result.model.measured.items()
            if m["mean_step_s"] > 0
        }
        measured.update(
            {int(r["world_size"]): r["measured_throughput"] for r in output.get("held_out", [])}
        )
        code = _plots(lambda: plot_projection(result, args.plot_dir, measured))
        if code:
            return code
    return _write_json(args.json, output)


def format_fit(runs: list[Any], model: Any) -> str:
    c, law = model.compute, model.comm
    compute_ms = (c.data_s + c.forward_s + c.backward_s + c.optimizer_s) * 1e3
    lines = ["fitted from:"]
    for r in sorted(runs, key=lambda r: r.world_size):
        m = model.measured[r.world_size]
        lines.append(
            f"  {r.source}: world {r.world_size}, {int(m['ranks_reported'])} ranks reported, "
            f"{int(m['steps'])} steps, step {m['mean_step_s'] * 1e3:.1f} ms, CV {m['cv']:.3f}"
            + (f", {r.skipped_records} bad records skipped" if r.skipped_records else "")
        )
    lines += [
        f"compute per rank: {compute_ms:.1f} ms (forward with data and other "
        f"{c.forward_s * 1e3:.1f}, backward {c.backward_s * 1e3:.1f}, optimizer "
        f"{c.optimizer_s * 1e3:.1f}); jitter {c.jitter_cv:.1%}, persistent spread "
        f"{c.persistent_cv:.1%}, drift {c.drift_cv:.1%} over {c.drift_steps:.0f} steps",
        f"hiccups: {model.tail_events} seen, {c.tail_prob:.3%} of rank-steps, "
        f"{c.tail_scale_s * 1e3:.1f}-{c.tail_max_s * 1e3:.1f} ms, Pareto alpha {c.tail_alpha:.2f}",
        f"communication (ring law): 2(N-1)/N x {law.bandwidth_term_s * 1e3:.3f} ms + 2(N-1) x "
        f"{law.latency_s * 1e3:.4f} ms; measured transfer "
        + ", ".join(
            f"N={n}: {t * 1e3:.2f} ms" for n, t in zip(law.sizes, law.measured_s, strict=True)
        ),
    ]
    lines += [f"note: {n}" for n in model.notes]
    return "\n".join(lines)


def format_projection(result: Any, held_out: list[Any]) -> str:
    held = {r.world_size for r in held_out}

    def band(values: tuple[float, float, float], scale: float, fmt: str) -> str:
        lo, mid, hi = (v * scale for v in values)
        return f"{mid:{fmt}} [{lo:{fmt}}–{hi:{fmt}}]"

    head = (
        f"{'ranks':>6} │ {'step ms [5–95 %]':>24} │ {'throughput/s [5–95 %]':>30} │ "
        f"{'efficiency':>20} │ {'CV':>20}"
    )
    lines = [
        f"projection ({result.bootstrap} bootstrap refits; efficiency relative to the measured "
        f"size {result.model.reference_size}; throughput at {result.samples_per_rank:g} "
        "samples per rank-step)",
        head,
        "─" * len(head),
    ]
    for p in result.points:
        tag = " (measured size)" if p.ranks == result.model.reference_size else ""
        tag = " (held out)" if p.ranks in held else tag
        lines.append(
            f"{p.ranks:>6} │ {band(p.step_s, 1e3, '7.2f'):>24} │ {band(p.throughput, 1, '9.1f'):>30} │ "
            f"{band(p.efficiency, 1, '5.3f'):>20} │ {band(p.cv, 1, '5.3f'):>20}{tag}"
        )
    return "\n".join(lines)


def compare_held_out(result: Any, held_out: list[Any]) -> list[dict[str, float]]:
    from syncscope.sim.projection import _measured_summary

    rows = []
    for run in held_out:
        measured = _measured_summary(run)
        p = result.point(run.world_size)
        rows.append(
            {
                "world_size": run.world_size,
                "predicted_step_s": p.step_s[1],
                "predicted_step_s_low": p.step_s[0],
                "predicted_step_s_high": p.step_s[2],
                "measured_step_s": measured["mean_step_s"],
                "step_error": p.step_s[1] / measured["mean_step_s"] - 1.0,
                "within_band": float(p.step_s[0] <= measured["mean_step_s"] <= p.step_s[2]),
                "predicted_cv": p.cv[1],
                "measured_cv": measured["cv"],
                "measured_throughput": result.samples_per_rank
                * run.world_size
                / measured["mean_step_s"],
            }
        )
    return rows


def format_held_out(rows: list[dict[str, float]]) -> str:
    lines = ["held-out sizes: predicted vs measured"]
    for r in rows:
        lines.append(
            f"  N={int(r['world_size'])}: step predicted {r['predicted_step_s'] * 1e3:.2f} ms "
            f"[{r['predicted_step_s_low'] * 1e3:.2f}–{r['predicted_step_s_high'] * 1e3:.2f}], "
            f"measured {r['measured_step_s'] * 1e3:.2f} ms, error {r['step_error']:+.1%}"
            f" ({'inside' if r['within_band'] else 'outside'} the band); CV predicted "
            f"{r['predicted_cv']:.3f}, measured {r['measured_cv']:.3f}"
        )
    return "\n".join(lines)
