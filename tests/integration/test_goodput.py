"""Goodput across restarts (issue 31): a 2-rank gloo DDP job that checkpoints with torch.save is
killed twice mid-run and relaunched the way torchrun's elastic agent does, each time resuming
from its last checkpoint; its exporter is restarted in between with its state file. Goodput and
its categories from the exporter's counters, and from a real Prometheus with syncscope's rules
where Prometheus is installed, must match what the ranks' own record files and the workload's
own timing of its saves and loads give, computed here independently.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from syncscope.lab.launch import fork_server
from syncscope.lab.servers import free_port
from tests.conftest import Exporter, by_rank, parse_samples, wait_until

pytestmark = pytest.mark.slow

WORLD = 2
JOB = "goodput"
EVERY = 100  # steps between checkpoints
STEPS = 900  # the third run ends here: most of the job's steps are its
# Each kill lands between 30 steps after a checkpoint (as reported) and the next checkpoint:
# steps of 15-25 ms and a 0.25 s flush keep the steps reported close behind the steps run, so
# the steps after the checkpoint are run again, and seen to be.
KILL_AT = (EVERY + 30, 2 * EVERY + 30)
WORKLOAD = ["--hidden", "512", "--data-ms", "2"]


def reported_step(exporter: Exporter) -> int:
    """The highest step every rank has reported (pooled), -1 before any."""
    ranks = exporter.state(recent=1)["jobs"].get(JOB, {}).get("ranks", [])
    if len(ranks) < WORLD or any(not r["recent_steps"] for r in ranks):
        return -1
    return min(r["recent_steps"][-1]["step"] for r in ranks)


def launch(job_factory: Any, exporter: Exporter, args: list[str], tmp: Path) -> Any:
    return job_factory(
        WORLD,
        [
            *WORKLOAD,
            "--checkpoint-every",
            str(EVERY),
            "--checkpoint-dir",
            str(tmp / "ckpt"),
            *args,
        ],
        exporter.url,
        job=JOB,
        SYNCSCOPE_RECORD=str(tmp / "records" / "rank{rank}.jsonl"),
        SYNCSCOPE_FLUSH_INTERVAL_S="0.25",
    )


def kill_after(job: Any, exporter: Exporter, step: int) -> None:
    assert wait_until(lambda: reported_step(exporter) >= step, 60, 0.1), reported_step(exporter)
    job.procs[1].kill()  # a rank dies; torchrun's elastic agent then stops the whole group
    job.kill()


# -- the truth, from the ranks' record files and the workload's own timing ---------------------
def from_records(records: Path) -> dict[str, float]:
    """Productive time, lost progress and checkpoint time (seconds over all ranks) from the
    record files: each step less its data wait, exposed communication, pacing and the
    checkpoint time inside it; lost progress as the steps a restart ran again times the
    productive time they took the first time."""
    out = defaultdict(float)
    for path in sorted(records.glob("rank*.jsonl")):
        lines = []
        for text in path.read_text().splitlines():
            try:
                lines.append(json.loads(text))
            except ValueError:  # a line a kill cut short
                continue
        incarnations: list[str] = []
        steps: dict[str, dict[int, float]] = defaultdict(dict)  # incarnation -> step -> own time
        in_step: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
        for line in lines:
            inc = line["incarnation"]
            if inc not in incarnations:
                incarnations.append(inc)
            if line.get("event", "").startswith("checkpoint_"):
                out[line["event"]] += line["duration_s"]
                if line["step"] is not None:
                    in_step[inc][line["step"]] += line["duration_s"]
            elif line.get("event") == "startup":
                out["startup"] += line["duration_s"]
                out["startups"] += 1
        for line in lines:
            if "event" in line:
                continue
            inc, p = line["incarnation"], line["phases"]
            checkpoint = in_step[inc].get(line["step"], 0.0)
            waiting = p["data"] + p["comm_exposed"] + p["pacing"]
            productive = line["step_s"] - waiting - checkpoint
            out["productive"] += productive
            out["steps"] += 1
            steps[inc][line["step"]] = productive
        for i, inc in enumerate(incarnations[1:], start=1):
            highs = [max(steps[e]) for e in incarnations[:i] if steps[e]]
            if not steps[inc] or not highs:
                continue
            for k in range(min(steps[inc]), max(highs) + 1):
                earlier = [e for e in incarnations[:i] if k in steps[e]]
                out["lost_progress"] += steps[earlier[-1]][k]
                out["lost_steps"] += 1
    return out


def measured_checkpoints(ckpt: Path) -> dict[str, float]:
    """What the workload timed around its own torch.save and torch.load calls."""
    out = defaultdict(float)
    for path in ckpt.glob("measured-*.jsonl"):
        for line in path.read_text().splitlines():
            m = json.loads(line)
            out[m["kind"]] += m["seconds"]
            out[m["kind"] + "s"] += 1
    return out


def goodput(productive: float, lost: float, started: float, at: float) -> float:
    return (productive - lost) / (WORLD * (at - started))


def render_goodput_row(prom_url: str, start: float, end: float, tmp_path: Path) -> None:
    """The checked-in job overview's "Goodput and cost" row, run as Grafana would against the
    job's Prometheus: goodput and every badput category the run had are drawn, the cost
    panels are empty (no price was given). The picture goes to the test's tmp dir, and to
    $SYNCSCOPE_GOODPUT_SCREENSHOT when set (how docs/goodput-row.png is made)."""
    from syncscope.lab import render
    from syncscope.monitoring import dashboards as D

    ctx = render.Context.for_job(prom_url, JOB, start=start, end=end, rate_interval="10s")
    overview = render.load_dashboard(D.OVERVIEW_UID)
    panels = render.row_panels(overview, "Goodput and cost")
    html, shown = render.render_html(overview, panels, ctx)
    print(f"goodput row: {shown}")
    assert shown["Goodput"]["series"] == [JOB], shown
    categories = set(shown["Badput by category"]["series"])
    had = {"startup", "checkpoint_save", "checkpoint_load", "lost_progress", "data_wait"}
    assert had <= categories, categories
    for title in ("Cost per million tokens", "Cost of lost time per hour", "Cost per hour"):
        assert shown[title]["series"] == [], (title, shown[title])
    if render.can_screenshot():
        targets = [tmp_path / "goodput-row.png"]
        if os.environ.get("SYNCSCOPE_GOODPUT_SCREENSHOT"):
            targets.append(Path(os.environ["SYNCSCOPE_GOODPUT_SCREENSHOT"]))
        for target in targets:
            render.screenshot(html, target)
            assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_goodput_across_two_kills_and_relaunches_from_checkpoints(job_factory, tmp_path):
    (tmp_path / "records").mkdir()
    port = free_port()
    state_file = ["--state-file", str(tmp_path / "exporter-state.json"), "--state-interval", "1"]
    exporter = Exporter(state_file, port=port)
    prom = None
    if shutil.which("prometheus"):
        from syncscope.lab.servers import Prometheus
        from syncscope.monitoring.prometheus_config import local_config

        (tmp_path / "prom").mkdir()
        prom = Prometheus(local_config(port, str(tmp_path / "prom")), str(tmp_path / "prom"))
    try:
        # The job's first processes start after this; a fork server's own start (its imports,
        # at the session's first job) is not the job's.
        fork_server()
        t_launch = time.time()
        first = launch(job_factory, exporter, ["--steps", "100000"], tmp_path)
        if prom is not None:
            prom.wait_ready()
        kill_after(first, exporter, KILL_AT[0])
        # The exporter restarts while the job is down: its counters come back from the file.
        steps_before = by_rank(exporter.samples("syncscope_steps_total"))
        exporter.stop()
        exporter = Exporter(state_file, port=port)
        assert by_rank(exporter.samples("syncscope_steps_total")) == steps_before
        second = launch(job_factory, exporter, ["--steps", "100000"], tmp_path)
        kill_after(second, exporter, KILL_AT[1])
        third = launch(job_factory, exporter, ["--steps", str(STEPS)], tmp_path)
        results = third.wait(60)
        assert all(r["stats"]["dropped_records"] == 0 for r in results)
        time.sleep(1.0)  # the last batches (sent at close) are in
        text = exporter.metrics_text()
        t_read = time.time()
        if prom is not None:
            time.sleep(2.5)  # two scrapes and evaluations after the last batch

        truth = from_records(tmp_path / "records")
        measured = measured_checkpoints(tmp_path / "ckpt")
        badput = {
            dict(k)["category"]: v
            for k, v in parse_samples(text, "syncscope_node_badput_seconds_total").items()
        }
        (productive,) = parse_samples(text, "syncscope_node_productive_seconds_total").values()
        (started,) = parse_samples(text, "syncscope_job_started_timestamp_seconds").values()
        steps = sum(by_rank(parse_samples(text, "syncscope_steps_total")).values())
        restarts = {r["rank"]: r["restarts"] for r in exporter.state()["jobs"][JOB]["ranks"]}
        ours = goodput(productive, badput["lost_progress"], started, t_read)
        theirs = goodput(truth["productive"], truth["lost_progress"], t_launch, t_read)
        print(
            f"\ngoodput: exporter {ours:.4f}, record files {theirs:.4f}; "
            f"lost progress {badput['lost_progress']:.3f} s vs {truth['lost_progress']:.3f} s "
            f"({truth['lost_steps']:.0f} steps run again); checkpoint save+load "
            f"{badput['checkpoint_save'] + badput['checkpoint_load']:.4f} s vs measured "
            f"{measured['save'] + measured['load']:.4f} s ({measured['saves']:.0f} saves, "
            f"{measured['loads']:.0f} loads); startup {badput['startup']:.2f} s; "
            f"job start {started - t_launch:+.2f} s after launch"
        )
        # Every step once in the counters, across two restarts of the job and one of the
        # exporter; both restarts seen as such. (A rank writes its record lines just before
        # it sends them: a kill in between leaves one flush's steps in its file only.)
        assert steps <= truth["steps"] <= steps + 2 * WORLD * 32
        assert restarts == {0: 2, 1: 2}
        assert t_launch - 0.1 <= started <= t_launch + 5.0  # /proc's start, to a clock tick
        assert abs(ours - theirs) <= 0.02
        assert productive == pytest.approx(truth["productive"], rel=0.02)
        assert ours > 0.1  # a job mostly stepping: a goodput worth comparing
        assert truth["lost_steps"] >= 2 * WORLD * 20  # the kills did throw steps away
        assert badput["lost_progress"] == pytest.approx(truth["lost_progress"], rel=0.10)
        assert measured["loads"] == 2 * WORLD and measured["saves"] >= 3 * WORLD
        checkpoint = badput["checkpoint_save"] + badput["checkpoint_load"]
        assert checkpoint == pytest.approx(measured["save"] + measured["load"], rel=0.10)
        assert badput["checkpoint_load"] == pytest.approx(measured["load"], rel=0.10)
        assert badput["startup"] == pytest.approx(truth["startup"], rel=1e-6)
        # every rank's three starts timed (a forked rank's start takes ~0.2 s, an executed one's
        # seconds: torch's import)
        assert truth["startups"] == 3 * WORLD
        assert 0 < badput["startup"] < 3 * WORLD * 30

        if prom is not None:
            rule = prom.query(f'job:syncscope_goodput:ratio{{job="{JOB}"}}')
            assert len(rule) == 1  # one goodput line for the whole job, restarts and all
            (at,) = prom.query(f'timestamp(job:syncscope_goodput:ratio{{job="{JOB}"}})')
            evaluated = float(at["value"][1])
            from_rules = float(rule[0]["value"][1])
            expected = goodput(truth["productive"], truth["lost_progress"], t_launch, evaluated)
            print(f"goodput: rules {from_rules:.4f}, record files {expected:.4f}")
            assert abs(from_rules - expected) <= 0.02
            shares = {
                s["metric"]["category"]: float(s["value"][1])
                for s in prom.query(f'job_category:syncscope_badput:ratio{{job="{JOB}"}}')
            }
            assert from_rules + sum(shares.values()) == pytest.approx(1.0, abs=1e-6)
            rank_seconds = WORLD * (evaluated - t_launch)
            measured_share = (measured["save"] + measured["load"]) / rank_seconds
            rules_share = shares["checkpoint_save"] + shares["checkpoint_load"]
            assert rules_share == pytest.approx(measured_share, rel=0.10)
            assert shares["lost_progress"] == pytest.approx(
                truth["lost_progress"] / rank_seconds, rel=0.10
            )
            render_goodput_row(prom.url, t_launch, evaluated, tmp_path)
    finally:
        if prom is not None:
            prom.stop()
        exporter.stop()
    saved = json.loads((tmp_path / "exporter-state.json").read_text())
    assert {r["job"] for r in saved["ranks"]} == {JOB}
    assert os.path.getsize(tmp_path / "exporter-state.json") > 0
