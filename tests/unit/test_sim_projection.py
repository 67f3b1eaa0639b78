"""Projection: fit recovers the simulator's own parameters; loaders; the CLI handlers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from syncscope.sim import cli
from syncscope.sim.compute import ComputeModel
from syncscope.sim.engine import Simulator
from syncscope.sim.fabric import FabricModel
from syncscope.sim.params import SimParams
from syncscope.sim.projection import default_targets, fit, project
from syncscope.sim.records import (
    from_exporter_state,
    from_prometheus,
    load_jsonl,
    load_run,
    run_from_simulation,
    step_records,
    write_jsonl,
)

from syncscope.wire import PHASES

TRUE_COMPUTE = ComputeModel(
    data_s=0.005,
    forward_s=0.03,
    backward_s=0.06,
    optimizer_s=0.005,
    jitter_cv=0.03,
    persistent_cv=0.02,
    drift_cv=0.02,
    drift_steps=100,
    tail_prob=0.002,
    tail_scale_s=0.01,
    tail_alpha=2.5,
)
TRUE_FABRIC = FabricModel(gradient_bytes=1e8, nic_bandwidth_Bps=1e10, nic_latency_s=1e-4)
TRUE = SimParams(compute=TRUE_COMPUTE, fabric=TRUE_FABRIC, samples_per_rank=32)


@pytest.fixture(scope="module")
def measured() -> list:
    return [run_from_simulation(Simulator(TRUE, n, seed=n), 3000) for n in (8, 16)]


def test_fit_recovers_the_generating_parameters(measured: list) -> None:
    model = fit(measured)
    c = model.compute
    t = TRUE_COMPUTE
    gpu = t.forward_s + t.backward_s + t.optimizer_s
    assert c.data_s + c.forward_s + c.backward_s + c.optimizer_s == pytest.approx(
        t.data_s + gpu, rel=0.01
    )
    assert c.backward_s == pytest.approx(t.backward_s, rel=0.02)
    assert c.jitter_cv == pytest.approx(t.jitter_cv, rel=0.10)
    assert c.drift_cv == pytest.approx(t.drift_cv, rel=0.25)
    assert c.drift_steps == pytest.approx(t.drift_steps, rel=0.35)
    # 16 ranks give the spread of 16 draws: its sampling error alone is ~18 %.
    assert c.persistent_cv == pytest.approx(t.persistent_cv, rel=0.45)

    # Hiccups are seen above the detection threshold only; compare the rate of big ones.
    def rate_above(model: ComputeModel, x: float) -> float:
        return model.tail_prob * min(1.0, (model.tail_scale_s / x) ** model.tail_alpha)

    assert rate_above(c, 0.03) == pytest.approx(rate_above(t, 0.03), rel=0.6)
    assert model.comm.bandwidth_term_s == pytest.approx(1e8 / 1e10, rel=0.02)
    assert model.comm.latency_s == pytest.approx(1e-4, rel=0.05)


def test_projection_matches_direct_simulation_at_4x(measured: list) -> None:
    result = project(measured, [32, 64], samples_per_rank=32, bootstrap=6, steps=800)
    for ranks in (32, 64):
        truth = np.mean(
            [Simulator(TRUE, ranks, seed=s).run(1500, 100).mean_step_s for s in (1, 2, 3)]
        )
        point = result.point(ranks)
        assert point.step_s[1] == pytest.approx(truth, rel=0.03)
        assert point.step_s[0] <= point.step_s[1] <= point.step_s[2]
        assert point.efficiency[1] < 1.0
    assert result.point(16).efficiency[1] == pytest.approx(1.0)
    assert result.bootstrap == 6


def test_jsonl_round_trip_and_bad_lines(tmp_path: Path, measured: list) -> None:
    path = tmp_path / "run.jsonl"
    small = run_from_simulation(Simulator(TRUE, 4, seed=1), 60)
    lines = write_jsonl(path, small)
    assert lines == 240
    with open(path, "a") as fh:
        fh.write("not json\n[1, 2]\n" + json.dumps({"rank": 0, "step_s": "NaN"}) + "\n\n")
    back = load_run(path)
    assert back.world_size == 4 and len(back.ranks) == 4
    assert back.skipped_records == 3
    np.testing.assert_allclose(back.ranks[2].phases, small.ranks[2].phases)
    np.testing.assert_allclose(back.ranks[2].wait_s, small.ranks[2].wait_s)
    first = next(step_records(small))
    assert set(first) == {"rank", "world_size", "step", "step_s", "phases", "wait_s"}
    assert set(first["phases"]) == set(PHASES)


def test_exporter_state_and_prometheus_loaders() -> None:
    steps = [
        {"step_s": 0.1 + 0.001 * k, "phases": {"forward": 0.03, "backward": 0.06}, "wait_s": 0.002}
        for k in range(5)
    ]
    state = {
        "jobs": {
            "j": {"ranks": [{"rank": r, "world_size": 2, "recent_steps": steps} for r in (0, 1)]}
        }
    }
    run = from_exporter_state(state)
    assert run.world_size == 2 and len(run.ranks[1].steps) == 5
    assert run.ranks[0].phase("forward")[0] == 0.03

    def series(rank: int, phase: str, value: float) -> dict:
        return {
            "metric": {"rank": str(rank), "phase": phase},
            "values": [[t, str(value)] for t in (1, 2, 3)],
        }

    prom = {
        "status": "success",
        "data": {
            "resultType": "matrix",
            "result": [
                series(r, p, v)
                for r in (0, 1, 2)
                for p, v in (("forward", 0.03), ("backward", 0.06), ("step", 0.1))
            ],
        },
    }
    run = from_prometheus(prom)
    assert len(run.ranks) == 3 and run.world_size == 3
    assert run.ranks[2].step_s.tolist() == [0.1, 0.1, 0.1]
    with pytest.raises(ValueError, match="matrix"):
        from_prometheus({"data": {"resultType": "vector", "result": []}})


def test_load_run_tells_formats_apart(tmp_path: Path) -> None:
    steps = [{"step_s": 0.1, "phases": {"forward": 0.03, "backward": 0.06}} for _ in range(3)]
    state = {
        "jobs": {
            "j": {"ranks": [{"rank": r, "world_size": 2, "recent_steps": steps} for r in (0, 1)]}
        }
    }
    (tmp_path / "state.json").write_text(json.dumps(state))
    (tmp_path / "pretty.json").write_text(json.dumps(state, indent=2))
    prom = {
        "data": {
            "resultType": "matrix",
            "result": [
                {"metric": {"rank": "0", "phase": "step"}, "values": [[1, "0.1"], [2, "0.2"]]}
            ],
        }
    }
    (tmp_path / "prom.json").write_text(json.dumps(prom))
    assert load_run(tmp_path / "state.json").world_size == 2
    assert load_run(tmp_path / "pretty.json").world_size == 2
    assert load_run(tmp_path / "prom.json").ranks[0].step_s.tolist() == [0.1, 0.2]


def test_default_targets() -> None:
    assert default_targets(4, 64) == [8, 16, 32, 64]
    assert default_targets(3, 5) == []


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="syncscope")
    cli.add_subcommands(top.add_subparsers(dest="command", required=True))
    return top


def test_cli_simulate_record_then_project(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = {}
    for world in (4, 8):
        records[world] = tmp_path / f"sim{world}.jsonl"
        args = parser().parse_args(
            [
                "simulate",
                "--params",
                "paper_table1",
                "--nodes",
                str(world),
                "--steps",
                "400",
                "--warmup",
                "50",
                "--pacing",
                "off",
                "--record",
                str(records[world]),
            ]
        )
        assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "step records" in out
    first = json.loads(records[4].read_text().splitlines()[0])
    assert first["world_size"] == 32  # 4 nodes of 8 GPUs
    args = parser().parse_args(
        [
            "project",
            str(records[4]),
            "--to",
            "128",
            "--compare",
            str(records[8]),
            "--bootstrap",
            "2",
            "--steps",
            "200",
            "--samples-per-rank",
            "32",
            "--json",
            str(tmp_path / "p.json"),
            "--plot-dir",
            str(tmp_path / "plots"),
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "held-out sizes: predicted vs measured" in out and "N=64" in out
    saved = json.loads((tmp_path / "p.json").read_text())
    assert [p["ranks"] for p in saved["projection"]["points"]] == [32, 64, 128]
    assert (tmp_path / "plots" / "projection_throughput.png").stat().st_size > 1000


def test_cli_simulate_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parser().parse_args(
        [
            "simulate",
            "--paper-table1",
            "--nodes",
            "4",
            "16",
            "--steps",
            "200",
            "--warmup",
            "50",
            "--plot-dir",
            str(tmp_path),
            "--json",
            str(tmp_path / "t.json"),
        ]
    )
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "paper base" in out and "ablation 'pure straggler'" in out
    assert "1024" in out  # the paper's 4-node baseline is printed beside the simulator's
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "paper_table1_cv.png",
        "paper_table1_pacing.png",
        "paper_table1_throughput.png",
    ]
    saved = json.loads((tmp_path / "t.json").read_text())
    assert [c["name"] for c in saved["comparisons"]][0] == "paper_table1"
    args = parser().parse_args(["simulate", "--nodes", "2", "--steps", "100", "--pacing", "on"])
    assert args.func(args) == 0
    assert "on" in capsys.readouterr().out


def test_cli_errors_are_reported_not_raised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = parser().parse_args(["simulate", "--params", str(tmp_path / "missing.json")])
    assert args.func(args) == 2
    args = parser().parse_args(["project", str(tmp_path / "missing.jsonl")])
    assert args.func(args) == 2
    assert "cannot load" in capsys.readouterr().err


def test_loading_a_jsonl_without_usable_records_fails_clearly(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("{}\n")
    with pytest.raises(ValueError, match="no usable step records"):
        load_jsonl(path)
