"""One real gloo job across emulated nodes (network namespaces joined by veth links), one
exporter per node: a remote straggler beside the pooled per-step truth, and the step-time-CV
alert travelling the rules → a real Alertmanager → a webhook. The remote straggler, the slow
link and the CV alert are judged by both rule engines, one Prometheus and two vmagent shards
into VictoriaMetrics with vmalert, scraping one job at once (node 0's exporter reads the
job-wide view back from the first, node 1's from the second).

Needs root and iproute2 (skipped with the kernel's or the permissions' reason otherwise); one
run per scenario, judged by every test that needs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from syncscope.exporter import __main__ as exporter_main

from syncscope import catalog as M
from syncscope.lab import render, scenarios
from syncscope.lab.launch import wait_all
from syncscope.lab.nodes import EmulatedNodes, NodesUnavailable
from syncscope.lab.servers import Alertmanager, Prometheus, VMStack
from syncscope.lab.truth import (
    compare,
    format_comparison,
    pooled_truth,
    read_records,
    record_files,
    rule_window_steps,
)
from syncscope.monitoring import dashboards as D
from syncscope.monitoring import rules as R
from syncscope.monitoring.prometheus_config import (
    exporter_overrides,
    local_window_s,
)
from syncscope.thresholds import load_config, required
from tests.conftest import (
    SKIP_STEPS,
    RunOnce,
    Webhook,
    chain_end,
    emulated,
    shipped_alertmanager_config,
    torch_available,
    wait_until,
)

# quiet: these jobs judge lateness and link shares on ranks that share this machine's cores;
# `make test` runs them one at a time, with only idle-priority work beside them (see the marker
# in pyproject.toml).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.quiet,
    pytest.mark.skipif(not torch_available(), reason="torch is not installed"),
]
VM_BINARIES = ("victoria-metrics", "vmagent", "vmalert")
# The rule engines scripts/setup installed here, and why one is skipped where it is not.
INSTALLED = {
    "prometheus": shutil.which("prometheus") is not None,
    "vm": all(shutil.which(b) for b in VM_BINARIES),
}
MISSING = {
    "prometheus": "prometheus not installed (scripts/setup test installs it)",
    "vm": "VictoriaMetrics, vmagent or vmalert not installed (scripts/setup test)",
}
needs_prometheus = pytest.mark.skipif(not INSTALLED["prometheus"], reason=MISSING["prometheus"])
# Each scenario that checks the job-wide rules end to end runs on both engines: one Prometheus,
# and vmagent shards into VictoriaMetrics with vmalert (docs/victoriametrics.md).
engines = pytest.mark.parametrize(
    "engine",
    [
        pytest.param(e, marks=pytest.mark.skipif(not INSTALLED[e], reason=MISSING[e]))
        for e in scenarios.ENGINES
    ],
)
needs_alertmanager = pytest.mark.skipif(
    shutil.which("prometheus-alertmanager") is None and shutil.which("alertmanager") is None,
    reason="prometheus-alertmanager not installed (scripts/setup test installs it)",
)


@contextlib.contextmanager
def job_wide_nodes(tmp_path, **kw: Any) -> Iterator[tuple[EmulatedNodes, Prometheus | VMStack]]:
    """syncscope.lab.scenarios.job_wide_nodes, skipped with the kernel's reason where refused."""
    try:
        with scenarios.job_wide_nodes(str(tmp_path), **kw) as both:
            yield both
    except NodesUnavailable as exc:
        pytest.skip(str(exc))


def scenario(run: Any, *args: Any) -> dict[str, Any]:
    try:
        return dict(run(*args))
    except NodesUnavailable as exc:
        pytest.skip(str(exc))


def installed_engines() -> tuple[str, ...]:
    """The rule engines scripts/setup installed here, of scenarios.ENGINES."""
    return tuple(engine for engine in scenarios.ENGINES if INSTALLED[engine])


def alertmanagers(
    stack: contextlib.ExitStack,
    tmp_path,
    engines: tuple[str, ...],
    config: Callable[[str], str] | None = None,
) -> tuple[dict[str, Webhook], dict[str, str | None]]:
    """A webhook and a real Alertmanager sending to it (with `config(webhook_url)` where given)
    per engine, stopped with `stack`, so that each engine's notifications are its own: the
    hooks and the Alertmanagers' addresses, by engine."""
    hooks: dict[str, Webhook] = {}
    addresses: dict[str, str | None] = {}
    for engine in engines:
        hooks[engine] = hook = Webhook()
        stack.callback(hook.stop)
        am_dir = tmp_path / f"alertmanager-{engine}"
        am_dir.mkdir()
        am = Alertmanager(hook.url, str(am_dir), config=config(hook.url) if config else None)
        stack.callback(am.stop)
        am.wait_ready()
        addresses[engine] = am.address
    return hooks, addresses


@pytest.fixture(scope="module")
def on_every_engine(tmp_path_factory: pytest.TempPathFactory) -> RunOnce:
    """`on_every_engine(name)`: the scenario run once, judged by every installed rule engine at
    once (scenarios.job_wide_nodes_on; node i's exporter reads back from the i-th): its results
    per engine, started by the first test that asks."""

    def run(name: str) -> dict[str, Any]:
        tmp, engines = tmp_path_factory.mktemp(name), installed_engines()
        if name == "throttled":
            return scenario(scenarios.slow_link_on, str(tmp), name, 30.0, engines)
        return scenario(remote_straggler, tmp, engines)

    return RunOnce(run)


def remote_straggler(tmp_path, engines: tuple[str, ...]) -> dict[str, Any]:
    """Rank 3 (node 1) slowed 45 ms, judged by each of `engines` with the shipped Alertmanager
    route: per engine, the truth over its rules' window beside its rules and the exporters,
    the triage table, the alerts that fired and what reached the webhook."""
    job = "remote-straggler"
    out: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        # The shipped route and inhibitions: what a team's chat and pager would receive. Its
        # group_wait (30 s) is two of the shipped 15 s evaluations: here two of 1 s.
        hooks, managers = alertmanagers(
            stack,
            tmp_path,
            engines,
            config=lambda url: shipped_alertmanager_config(url, "2s", "1s"),
        )
        # Links shaped alike: a transfer the CPUs' scheduling swings across the contention
        # line would page (it did, once in CI) for what is no fabric at all.
        cluster, stores = stack.enter_context(
            scenarios.job_wide_nodes_on(
                str(tmp_path), managers, link_mbit=scenarios.EVEN_LINKS_MBIT
            )
        )
        started = time.time()
        # 45 ms, not 30: the ranks that wait then sit idle ~25 % of the job's rank-time, clear
        # of SyncscopeSyncAmplification's 20 % line (30 ms read 19.3 % on a loaded machine,
        # and the alert this test expects inhibited did not fire).
        cluster.run(["--duration", "30", "--slow-rank", "3", "--slow-ms", "45"], job)
        # The final flush scraped, the rules evaluated (1 s each) and the exporters read them
        # back (2 s); the truth covers the steps the rules' windows saw.
        time.sleep(4)
        window = local_window_s()
        states = cluster.states()
        for engine, prom in stores.items():
            truth = cluster.truth(SKIP_STEPS, window, rule_window_steps(prom, job, f"{window:g}s"))
            # The checked-in dashboard's triage row at the time the rules are read.
            assert truth.at_unix_s is not None
            ctx = render.Context.for_job(
                prom.url, job, start=started, end=truth.at_unix_s, rate_interval=f"{window:g}s"
            )
            overview = render.load_dashboard(D.OVERVIEW_UID)
            late = next(p for p in overview["panels"] if p["title"] == "Late ranks")
            out[engine] = {
                "truth": truth,
                "comparison": compare(prom, states, truth, job),
                "frame": render.panel_table(late, ctx),
                "triage_html": render.render_html(
                    overview, render.row_panels(overview, "Triage"), ctx
                )[0],
            }
        time.sleep(4)  # the last evaluation's alerts through group_wait (2 s)
        for engine, prom in stores.items():
            out[engine]["fired"] = prom.query_range(
                f'ALERTS{{job="{job}",alertstate="firing"}}', started, time.time()
            )
            out[engine]["notified"] = [
                (to, n)
                for to, n in list(hooks[engine].notifications)
                if n["groupLabels"] == {"job": job}
            ]
            if isinstance(prom, VMStack):
                # Two shards without cluster mode would each scrape both exporters.
                out[engine]["by_shard"] = prom.scraped_by_shard()
        out["targets"] = {f"127.0.0.1:{p}" for p in cluster.exporter_ports}
    return out


@engines
@needs_alertmanager
def test_remote_straggler_is_named_job_wide_and_leads_match_the_pooled_truth(
    engine, on_every_engine, tmp_path
):
    """Rank 3 (node 1) slowed 45 ms: the job-wide rules and every exporter reading them back
    (--prometheus-url) name it; leads and amplification agree with the truth pooled per step
    from all four ranks' records; the job overview's triage table, run as Grafana would, has it
    on its first row with its node, cause and cost; one notification reaches the chat receiver.
    On VictoriaMetrics, each exporter is also scraped by exactly one of the two shards. One job
    judged by both engines at once (node 0's exporter reads Prometheus back, node 1's
    VictoriaMetrics)."""
    run = on_every_engine("remote-straggler")
    mine = run[engine]
    truth, comparison, frame = mine["truth"], mine["comparison"], mine["frame"]
    fired, notified = mine["fired"], mine["notified"]
    if engine == "vm":
        by_shard = mine["by_shard"]
        assert sum(len(s) for s in by_shard) == 2 and set().union(*by_shard) == run["targets"], (
            by_shard
        )
    print("\n" + format_comparison(comparison))
    assert truth.straggler == 3
    assert all(truth.mean_wait_s[r] >= 0.020 for r in (0, 1, 2)), truth.mean_wait_s
    assert comparison["straggler"]["rule"] == 3
    for rank, row in comparison["ranks"].items():
        tolerance = max(0.003, 0.15 * row["truth_wait_s"])
        for estimate in ("rule_lead_avg_s", "exported_lead_s"):
            assert row[estimate] is not None, (rank, estimate)
            assert abs(row[estimate] - row["truth_wait_s"]) <= tolerance, (rank, estimate, row)
    amplification = comparison["amplification"]
    assert abs(amplification["rule"] - amplification["truth"]) <= 0.05, amplification
    for node in comparison["nodes"]:
        assert node["straggler"] == 3, node  # both exporters, the straggler's and the other
        assert node["fabric_contention"] is False, node
    assert frame is not None, "the triage table is empty"
    rows = [{f.display_name: f.values[r] for f in frame.fields} for r in range(frame.length)]
    print("\n".join(str(row) for row in rows))
    first = rows[0]
    # Which rank on which node, why and at what cost: all on the first row, the straggler's
    # only row (one cause, from the exporter of its node).
    assert first["Rank"] == "3" and first["Node"] == "node1", rows
    assert [row["Rank"] for row in rows].count("3") == 1, rows
    assert first["Cause"] == "forward", rows
    assert first["Cost"] is not None and first["Cost"] > 0, rows
    # One incident, one notification: the straggler's, to the chat receiver; what it causes
    # (amplification, CV, pacing) is inhibited, and nothing pages.
    print(
        "\n".join(
            f"{to}: {sorted(a['labels']['alertname'] for a in n['alerts'])}" for to, n in notified
        )
    )
    firing = sorted(
        {
            kv.split("=", 1)[1]
            for at in fired.values()
            for series in at
            for kv in series.split(",")
            if kv.startswith("alertname=")
        }
    )
    print(f"firing in {engine}: {firing}")
    assert len(notified) == 1, notified
    to, notification = notified[0]
    assert to == "default", notified
    assert {a["labels"]["alertname"] for a in notification["alerts"]} == {"SyncscopeStraggler"}
    # ... though the rules fired more for this job: the inhibitions did the work.
    assert "SyncscopeSyncAmplification" in firing, firing
    if render.can_screenshot():
        render.screenshot(mine["triage_html"], tmp_path / render.TRIAGE_FILE)
        assert (tmp_path / render.TRIAGE_FILE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@needs_prometheus
def test_pacing_paces_the_early_ranks_on_both_nodes_and_never_the_straggler(across_nodes):
    """DDP (two micro-batches a step) with rank 3 (node 1) slowed 30 ms, pacing on, both
    exporters reading the job-wide view back: ranks 0 and 1 wait for a rank on another node,
    which their node alone cannot see (its minimum is their own wait); with the job's transfer
    from Prometheus their baselines come down and they are paced like rank 2, while rank 3,
    which waits for nobody, never is. Judged on the ddp-accumulate run across nodes, while all
    its ranks still ran."""
    name = "ddp-accumulate"
    slowed = ACROSS_NODES[name][1]
    states = [s for _node, s in across_nodes(name)["slowed"]["running"]]
    pacing = {r["rank"]: r["pacing"] for state in states for r in state["ranks"]}
    print("\n" + "\n".join(f"rank {r}: {p}" for r, p in sorted(pacing.items())))
    assert sorted(pacing) == [0, 1, 2, 3]
    for rank in {0, 1, 2, 3} - {slowed}:
        assert pacing[rank]["enabled"] and pacing[rank]["engagements"] >= 1, (rank, pacing)
        assert pacing[rank]["total_delay_s"] > 0.1, (rank, pacing)
    assert pacing[slowed]["enabled"] and pacing[slowed]["engagements"] == 0, pacing
    assert pacing[slowed]["total_delay_s"] == 0.0, pacing
    assert len(states) == 2
    for state in states:  # both nodes saw the job-wide view, not a node-local one
        assert state["job_wide"], state.get("job_wide")


# Each parallelism on two nodes (ranks 0, 1 on node 0; 2, 3 on node 1): the slowed rank, and
# the chain a victim on node 0 follows to it across the link. FSDP2 and DDP shard or replicate
# over all four ranks; HSDP shards inside nodes ({0,1} {2,3}) and replicates across them; tp
# pairs and pipelines ({0,1} {2,3}, stage 0 first) sit inside nodes, FSDP2 across them.
ACROSS_NODES = {
    "fsdp2": (["--parallel", "fsdp2"], 3),
    "hsdp": (["--parallel", "hsdp"], 3),
    "tp": (["--parallel", "tp"], 3),
    "pp": (["--parallel", "pp", "--layers", "4"], 2),
    # Uneven stages (one layer, then two and the head): stage 0 waits ~10 ms a step for stage
    # 1, over the rule's 5 ms floor and 10 % line if ranks were compared across stages.
    "pp-uneven": (["--parallel", "pp", "--hidden", "768"], 2),
    "ddp-accumulate": (["--accumulate", "2"], 3),
    "pp-interleaved": (["--parallel", "pp", "--schedule", "interleaved", "--layers", "4"], 2),
}
# The two-stage pipeline runs clean with uneven stages only: the harder case for a false verdict
# (stage 0 waits ~10 ms a step for stage 1), the balanced one runs clean on one node.
CLEAN_ACROSS_NODES = ("fsdp2", "hsdp", "tp", "pp-uneven", "pp-interleaved")


def straggler_line() -> float:
    """SyncscopeStraggler's line: the lag over the mean step its condition names a rank at."""
    levels = load_config().alerts["SyncscopeStraggler"].levels
    return min(required(level.threshold, "threshold") for level in levels)


def named_by_the_rule(sel: str) -> str:
    """The ranks SyncscopeStraggler's condition names (the recorded lag over both its lines)."""
    floor = load_config().diagnosis.skew_floor_s
    return f"{R.STRAGGLER_RATIO}{sel} > {straggler_line()} and on (job) {R.SKEW}{sel} > {floor}"


def truth_where_named(
    records_dir: str,
    prom: Prometheus,
    job: str,
    window: float,
    ruled: dict[float, Any],
    stages: dict[int, int] | None,
) -> dict[float, tuple[int | None, dict[int, float]]]:
    """At each evaluation (unix s) where the rule named a rank: the truth pooled from the ranks'
    records over the steps that evaluation's window saw, its straggler and each rank's lag
    behind the earliest of its pipeline stage (`stages`: rank -> stage; None: one) over the
    mean step (what the rule's condition estimates)."""
    named_at = [t for t, series in ruled.items() if ruled_rank(series) is not None]
    if not named_at:
        return {}
    records = read_records(record_files(records_dir))
    steps = rule_window_steps(prom, job, f"{window:g}s")
    out: dict[float, tuple[int | None, dict[int, float]]] = {}
    for t in named_at:
        span = steps(t)
        seen = {
            rank: {
                k: rec
                for k, rec in recs.items()
                if (span[0] <= k < span[1] if span else t - window < rec["end_unix_s"] <= t)
            }
            for rank, recs in records.items()
        }
        try:
            truth = pooled_truth(seen, stages=stages)
        except ValueError:  # no step every rank recorded: nothing to tell it by
            out[t] = (None, {})
            continue
        step = sum(truth.mean_step_s.values()) / len(truth.mean_step_s)
        stage = {r: (stages or {}).get(r, 0) for r in truth.mean_blocked_s}
        most = {
            s: max(b for r, b in truth.mean_blocked_s.items() if stage[r] == s)
            for s in set(stage.values())
        }
        lag = {r: (most[stage[r]] - b) / step for r, b in truth.mean_blocked_s.items()}
        out[t] = (truth.straggler, lag)
    return out


# Per phase, the exporter samples (two a second) and the seconds of the rules' evaluations
# (one a second) over full windows the test takes before it slows a rank, or stops the job.
ENOUGH = {"clean": (16, 12), "slowed": (24, 16)}


def run_across_nodes(tmp_path, job: str, args: list[str], clean: bool) -> dict[str, Any]:
    """One job on two nodes, each exporter reading the job-wide view back, steered through the
    workload's control folder: clean (with `clean`) until the test has its samples, then with
    `args`' slow rank slowed until it has those too. Per phase, every exporter's job state once
    a second and the rules' evaluations over the same time: {"clean": ..., "slowed": ...}.

    The rules judge a job only once every rank has a full window of its own (recorded
    WINDOW_FULL): a phase is read from the first full window
    after every rank's first scrape (`ready`) or after the first slowed step (rank 0 writes
    when), however long this machine took to start the job. The exporters, reading the rules
    back every 2 s, are sampled from that window on, once slowed after they have held what they
    read for as long as they must (the alert's for: and a window) and read it once more. The
    seconds between the ask and that point are neither phase's."""
    control = tmp_path / "control"
    control.mkdir()
    if not clean:
        (control / "slow").touch()
    sel = f'{{job="{job}"}}'
    window, hold_s = local_window_s(), exporter_hold_s() + 2
    # a pipeline's stage: the rank's place in its pair (the workload's ("dp", "pp") mesh)
    stages = {r: r % 2 for r in range(4)} if "pp" in args else None
    out: dict[str, Any] = {}
    with job_wide_nodes(tmp_path) as (cluster, prom), open(tmp_path / f"{job}.log", "wb") as log:
        started = time.time()
        ranks = cluster.launch(
            ["--duration", "240", "--control", str(control), *args],
            env=dict(os.environ, SYNCSCOPE_JOB=job),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        ready = onset = 0.0
        samples: list[tuple[int, Any]] = []
        while all(r.poll() is None for r in ranks):
            time.sleep(1)
            if not ready:
                scraped = prom.query(f"count({M.STEPS_TOTAL.name}{sel}) >= {len(ranks)}")
                ready = time.time() if scraped else 0.0
            if not onset and (control / "onset").exists():
                onset = float((control / "onset").read_text().split()[1])
            slowing = (control / "slow").exists()
            if not ready or (slowing and not onset):
                continue
            since = max(ready + window, onset + window if slowing else 0.0)
            if time.time() < since + 3 + (hold_s if slowing else 0.0):
                continue
            # An exporter whose diagnosis is warming up (a settled window of its ranks' steps
            # not yet delivered) gives no verdict: not a sample of one.
            states = [
                (n, s["jobs"][job])
                for n, s in enumerate(cluster.states())
                if job in s["jobs"] and "warming_up" not in s["jobs"][job]["diagnosis"]
            ]
            samples.extend(states)
            now = time.time()
            phase = "slowed" if slowing else "clean"
            wanted, ruled_s = ENOUGH[phase]
            if len(samples) < wanted or now - (since + 1) < ruled_s:
                continue
            ruled = prom.query_range(named_by_the_rule(sel), started, now)
            out[phase] = {
                "samples": samples,
                "running": states,  # every exporter's last sample, all ranks still running
                # Whom SyncscopeStraggler's condition names, at every evaluation (1 s), over
                # full windows of the phase
                "ruled": prom.query_range(named_by_the_rule(sel), since + 1, now),
                # From the launch (the ask) on: whom the condition names, the job's arrival
                # skew over its mean step (recorded once every rank has a full window; on a
                # clean job, how far under the straggler's line it stayed) and the straggler
                # alert.
                "ruled_since_start": ruled,
                # clean, where it named someone: the truth over the steps that evaluation saw
                "truth_where_named": {}
                if slowing
                else truth_where_named(cluster.records_dir, prom, job, window, ruled, stages),
                "skew": prom.query_range(f"{R.SKEW_RATIO}{sel}", started, now),
                # and each rank's blocked time per step (on a failure: whose moved)
                "blocked": prom.query_range(f"{R.SYNC_PER_STEP}{sel}", started, now),
                # Each rank's stage labels on its phase counter (a pipeline's are learnt from
                # its first point-to-point op): on a failure, whether a rank had two at once.
                "stages": prom.query_range(
                    f'count by (rank, stage) ({M.PHASE_SECONDS_TOTAL.name}{{job="{job}",'
                    'phase="comm_exposed"})',
                    started,
                    now,
                ),
                "alerts": prom.query_range(
                    f'ALERTS{{alertname="SyncscopeStraggler",alertstate="firing",job="{job}"}}',
                    started,
                    now,
                ),
                "lost": {
                    r["metric"]["group"]: float(r["value"][1])
                    for r in prom.query(f"{R.GROUP_WAIT}{sel}", at=now)
                },
                "step": float(prom.query(f"{R.STEP_MEAN}{sel}", at=now)[0]["value"][1]),
                "exposed": float(prom.query(f"{R.COMM_EXPOSED_RATIO}{sel}", at=now)[0]["value"][1]),
            }
            samples = []
            started = now
            (control / ("stop" if slowing else "slow")).touch()
            if slowing:
                break
        assert wait_all(ranks, 60) == [0, 0, 0, 0], (tmp_path / f"{job}.log").read_text()[-2000:]
    assert set(out) == {"clean", "slowed"} - (set() if clean else {"clean"}), sorted(out)
    return out


def exporter_hold_s() -> float:
    """How long the lab's exporters (given `exporter_overrides`) hold a straggler before
    naming it job-wide: their own settings' figure."""
    args = exporter_main.build_parser().parse_args(exporter_overrides())
    return exporter_main.settings_from_args(args).thresholds.straggler_hold_s


def ruled_rank(series: dict[str, float]) -> str | None:
    """The rank the job-wide rule names at one evaluation (None: nobody)."""
    ranks = {
        kv.split("=", 1)[1] for labels in series for kv in labels.split(",") if kv[:5] == "rank="
    }
    return ranks.pop() if len(ranks) == 1 else ("several" if ranks else None)


def rank_and_stage(labels: str) -> str:
    """A series' labels as query_range writes them, less all but its rank and stage."""
    return ",".join(kv for kv in labels.split(",") if kv.split("=", 1)[0] in ("rank", "stage"))


@pytest.fixture(scope="module")
def across_nodes(tmp_path_factory: pytest.TempPathFactory) -> RunOnce:
    """`across_nodes(name)`: the workload's run on two nodes, slowed after a clean phase where
    CLEAN_ACROSS_NODES has it, with pacing asked for: started by the first test that asks."""

    def run(name: str) -> dict[str, Any]:
        args, slowed = ACROSS_NODES[name]
        slowing = ["--slow-rank", str(slowed), "--slow-ms", "30", "--pacing"]
        tmp, clean = tmp_path_factory.mktemp(name), name in CLEAN_ACROSS_NODES
        return run_across_nodes(tmp, f"{name}-across-nodes", [*args, *slowing], clean)

    return RunOnce(run)


@needs_prometheus
@pytest.mark.parametrize("name", list(ACROSS_NODES))
def test_each_parallelism_across_nodes_names_the_root_job_wide(name, across_nodes):
    """One rank slowed 30 ms in forward (a stage-0 rank for the pipeline), pacing asked for:
    both exporters name it in ≥ 95 % of their samples (its node's with cause forward), the job-wide rule
    in ≥ 95 % of its evaluations, and every victim's chain reaches it, across the link where
    the victim is on the other node. With tensor parallelism the chain is exact (node 0's
    exporter follows rank 1's dp wait to rank 3, rank 0's tp wait to rank 1) and the rule per
    group shows the time lost in tp and dp near the victims' waits there; with a pipeline it
    stays within the ranks' blocked time and near the victims' waits in pp. Pacing stays on
    with several groups (it is fed each step's first wait) and never delays the root."""
    _args, slowed = ACROSS_NODES[name]
    phases = across_nodes(name)
    run = phases["slowed"]
    samples = run["samples"]
    assert len(samples) >= 20, len(samples)
    named = [(node, s["diagnosis"]["straggler"] or {}) for node, s in samples]
    right = [(node, n) for node, n in named if n.get("rank") == slowed]
    # On a failure, the samples that named someone else or no one: which, from which node, and
    # what that exporter's straggler mode said then (the list alone is cut short by pytest).
    wrong = [
        (i, node, n.get("rank"), samples[i][1]["diagnosis"]["modes"].get("straggler"))
        for i, (node, n) in enumerate(named)
        if n.get("rank") != slowed
    ]
    assert len(right) >= 0.95 * len(named), (len(right), len(named), wrong)
    # The cause is the straggler's own node's to tell; the other node's exporter says so.
    home = slowed // 2
    causes = {(node == home, n["cause"]) for node, n in right}
    assert causes == {(True, "forward"), (False, "unknown")}, {n["cause_reason"] for _, n in right}
    ruled = [ruled_rank(series) for series in run["ruled"].values()]
    assert len(ruled) >= 15, ruled
    assert ruled.count(str(slowed)) >= 0.95 * len(ruled), ruled
    victims: dict[int, tuple[str, int, float]] = {}
    for _node, s in run["running"]:
        for v in s["diagnosis"]["victims"]:
            victims[v["rank"]] = (v["group"], v["waits_for"], v["wait_s"])
    # on failure: each rank's lead and the delay pacing has given it (a paced rank waits less)
    seen = {
        r["rank"]: (r["arrival_lead_s"], (r["pacing"] or {}).get("total_delay_s"))
        for _node, s in run["running"]
        for r in s["ranks"]
    }
    assert set(victims) == {0, 1, 2, 3} - {slowed}, (victims, seen)
    waits_for = {rank: v[1] for rank, v in victims.items()}
    assert all(chain_end(waits_for, rank) == slowed for rank in victims), victims
    print(
        f"\n{name}: rule named {ruled.count(str(slowed))}/{len(ruled)}; lost per group "
        f"{run['lost']}; step {run['step'] * 1e3:.1f} ms; victims {victims}"
    )
    if name == "tp":
        assert {r: v[:2] for r, v in victims.items()} == {
            0: ("tp", 1),
            1: ("dp", 3),
            2: ("tp", 3),
        }, victims
        for group in ("tp", "dp"):
            waited = sum(w for g, _whom, w in victims.values() if g == group) / (4 * run["step"])
            lost = run["lost"]
            assert abs(lost[group] - waited) <= 0.3 * waited, (group, lost, waited)
    if name.startswith("pp"):
        # A pipeline posts its receives ahead, so their issue-to-completion times overlap its
        # compute and each other (unbounded, `pp` read 175 % of the interleaved job's
        # rank-time): the rule counts no more than the ranks were blocked, and `pp` reads near
        # the victims' waits there (its other ranks' waits in `pp` count too: up to 2.5 times).
        lost = run["lost"]
        assert sum(lost.values()) <= 1.1 * run["exposed"], (lost, run["exposed"])
        waited = sum(w for g, _whom, w in victims.values() if g == "pp") / (4 * run["step"])
        assert 0.7 * waited <= lost["pp"] <= 2.5 * waited, (lost, waited)
    # Pacing never delays the root: not since the ask (it may have paced it while clean).
    clean = phases["clean"]["running"] if "clean" in phases else []
    before = {r["rank"]: r["pacing"]["total_delay_s"] for _node, s in clean for r in s["ranks"]}
    for _node, s in run["running"]:
        for r in s["ranks"]:
            assert r["pacing"] and r["pacing"]["enabled"], r
            if r["rank"] == slowed:
                delay = r["pacing"]["total_delay_s"] - before.get(slowed, 0.0)
                assert delay == 0.0, (r["pacing"], before)


@needs_prometheus
@pytest.mark.parametrize("name", CLEAN_ACROSS_NODES)
def test_each_parallelism_across_nodes_clean_gets_no_straggler_anywhere(name, across_nodes):
    """No rank slowed yet, pacing on: no exporter sample names a straggler or a fabric fault,
    the job-wide rule crosses the straggler alert's threshold only where the ranks' records say
    that rank was nearly that late, and the alert never fires."""
    run = across_nodes(name)["clean"]
    samples = run["samples"]
    assert len(samples) >= 15, len(samples)
    skews = [v for series in run["skew"].values() for v in series.values()]
    print(f"\n{name}: job skew over the mean step at {len(skews)} evaluations, max {max(skews)}")
    assert len(skews) >= 10, run["skew"]  # the rules judged the job, over full windows
    for node, state in samples:
        diagnosis = state["diagnosis"]
        assert diagnosis["straggler"] is None, (node, diagnosis["modes"]["straggler"], skews)
        for mode in ("fabric_contention", "slow_link"):
            assert not diagnosis["modes"].get(mode, {}).get("verdict"), (node, mode, diagnosis)
    ruled = {t: ruled_rank(series) for t, series in run["ruled_since_start"].items()}
    start = min(ruled)  # the launch
    named = {round(t - start): rank for t, rank in ruled.items() if rank is not None}
    stages = sorted({labels for series in run["stages"].values() for labels in series})
    # around each naming, every rank's blocked ms per step ("rank=…,stage=…": ms)
    blocked = {
        round(t - start): {rank_and_stage(labels): round(v * 1e3, 1) for labels, v in s.items()}
        for t, s in run["blocked"].items()
        if any(abs(t - start - at) <= 3 for at in named)
    }
    # The rule names a rank of a clean job only where the ranks' own records say it was that
    # late: the truth's straggler over the steps that evaluation saw, at least 80 % of the way
    # to the line. (Two cores under four ranks and their servers slow a rank for seconds at a
    # time: in one run of the clean tp job, rank 2 was 9.7-9.8 % of the step late by its
    # records at the two evaluations that named it, the line 10 %.) The alert never fires.
    # On failure, per naming (s from the launch): whom, the stage labels, the skew, who was
    # blocked how long, and the truth (its straggler, each rank's lag over the step).
    line, truth = straggler_line(), run["truth_where_named"]
    told = {round(t - start): truth[t] for t in truth}
    for at, rank in named.items():
        straggler, lag = told[at]
        assert rank == str(straggler) and lag[straggler] >= 0.8 * line, (
            named,
            told,
            stages,
            run["skew"],
            blocked,
        )
    assert not any(run["alerts"].values()), run["alerts"]


def assert_no_straggler_verdicts(out: dict[str, Any]) -> None:
    """Both exporters sampled once a second after warm-up, a straggler named in under 1 % of
    each one's samples (none, for fewer than 100); a failure lists when and why."""
    samples = out["straggler_samples"]
    assert sorted(samples) == [0, 1], samples
    for named, seen in samples.values():
        assert seen >= 10 and named < 0.01 * seen, (samples, out["straggler_nearest"])


@engines
def test_a_throttled_node_is_the_slow_link_and_no_rank_a_straggler(engine, on_every_engine):
    """Node 1's link shaped to a quarter of node 0's (tbf, both ends): the rule names node 1 the
    slow link in nearly every evaluation, both exporters say so, nobody is a straggler and
    nothing is contention (the link was slow from the start), the decision verdict is
    infrastructure naming node 1's link, and every fabric panel has data. One job judged by
    both engines at once."""
    out = on_every_engine("throttled")[engine]
    print(f"\n{out}")
    assert out["evaluations"] >= 10, out
    assert out["utilisation"]["node1"] > 2 * out["utilisation"]["node0"], out
    assert out["straggler_alerts"] == [], out
    assert_no_straggler_verdicts(out)
    for node in out["exporters"]:
        assert node["slow_link"]["verdict"] and "node node1" in node["slow_link"]["reason"], node
        assert node["straggler"] is None, node
        assert not node["fabric_contention"]["verdict"], node
        # The decision verdict: the time lost is the infrastructure's, and which link it is.
        verdict = node["verdict"] or {}
        assert verdict.get("verdict") == "infrastructure", node
        assert any("node1" in fault for fault in verdict["faults"]), verdict
    assert not out["empty_fabric_panels"], "\n".join(out["empty_fabric_panels"])
    assert out["named_share"] >= 0.95, out


@needs_prometheus
def test_a_competing_flow_is_contention_only_while_it_runs(tmp_path):
    """Every link shaped alike (200 Mbit/s); 50 s into the job a bulk TCP flow from node 0 to
    node 1 runs for 25 s. The DDP transfer's contention index is under its line for the 30 s
    before, over it while the flow runs, and back under it within 30 s after."""
    out = scenario(scenarios.contention_window, str(tmp_path), "contended")
    print(f"\n{out}")
    assert out["evaluations_before"] >= 25 and out["flagged_before"] == 0, out
    assert out["flagged_while_on_share"] >= 0.8, out
    assert out["cleared_s"] is not None and out["cleared_s"] <= 30, out
    assert out["flagged_30s_after"] == 0, out
    assert_no_straggler_verdicts(out)
    for node in out["exporters_during"]:  # both exporters said so while the flow ran
        assert node["fabric_contention"]["verdict"], node
        assert node["straggler"] is None, node


def cv_alert(tmp_path, engines: tuple[str, ...]) -> dict[str, Any]:
    """A jittery, then steady 2-rank job on one node, its CV alert judged by each of `engines`
    at once, each with an Alertmanager and a webhook of its own: per engine, the first firing
    and the first resolved notification (None where none came), and the recorded CV."""
    job, alert = "jitter-then-steady", "SyncscopeStepTimeCVHigh"
    out: dict[str, Any] = {"job": job, "alert": alert}
    with contextlib.ExitStack() as stack:
        # Ranks silent for 5 s are forgotten: should the noisy steady phase keep the CV up,
        # the alert still resolves once the job has ended.
        cluster = stack.enter_context(
            emulated(1, 2, exporter_args=["--stale-after", "3", "--expire-after", "5"])
        )
        overrides = {f"alerts.{alert}.levels.0.threshold": 0.5, f"alerts.{alert}.for": "2s"}
        hooks, managers = alertmanagers(stack, tmp_path, engines)
        stores: dict[str, Prometheus | VMStack] = {}
        for engine in engines:
            (tmp_path / engine).mkdir()
            stores[engine] = scenarios.start_engine(
                stack,
                engine,
                str(tmp_path / engine),
                cluster.exporter_ports,
                overrides=overrides,
                alertmanager=managers[engine],
            )
        # 20 s of stalls (150 ms on 30 % of a rank's steps), then steady: the exporter's
        # 100-step CV window drains and the alert resolves, usually while the job still runs.
        jittery = ["--jitter-prob", "0.3", "--jitter-ms", "150", "--jitter-until", "20"]
        log = stack.enter_context(open(tmp_path / "ranks.log", "wb"))
        ranks = cluster.launch(
            ["--duration", "35", *jittery],
            env=dict(os.environ, SYNCSCOPE_JOB=job),
            stdout=log,
            stderr=log,
            record=False,
        )

        def firsts(state: str) -> Any:
            seen = {e: hook.alerts(alert, state) for e, hook in hooks.items()}
            return seen if all(seen.values()) else None

        wait_until(lambda: firsts("firing"), timeout=60, interval=1)
        wait_until(lambda: firsts("resolved"), timeout=75, interval=1)
        for engine, store in stores.items():
            out[engine] = {
                "fired": next(iter(hooks[engine].alerts(alert, "firing")), None),
                "resolved": next(iter(hooks[engine].alerts(alert, "resolved")), None),
                "notifications": list(hooks[engine].notifications),
                "cv": store.query("job:syncscope_step_time_cv:max"),
            }
        out["exit_codes"] = wait_all(ranks, 60)
        out["log"] = (tmp_path / "ranks.log").read_text()[-4000:]
    return out


@pytest.fixture(scope="module")
def cv_alert_run(tmp_path_factory: pytest.TempPathFactory) -> RunOnce:
    """`cv_alert_run(None)`: `cv_alert` on every installed engine, run by the first test."""
    return RunOnce(lambda _: cv_alert(tmp_path_factory.mktemp("cv"), installed_engines()))


@engines
@needs_alertmanager
def test_cv_alert_fires_and_resolves_through_a_real_alertmanager(engine, cv_alert_run):
    """Step-time CV over 0.5 for 2 s (20 s of 150 ms stalls): the alert reaches a webhook
    through a real Alertmanager with its labels and runbook, and resolves once the steps are
    steady (or the ranks are gone). One job judged by both engines at once."""
    run = cv_alert_run(None)
    job, alert, mine = run["job"], run["alert"], run[engine]
    fired = mine["fired"]
    assert fired, f"no firing {alert} reached the webhook: {mine['notifications']}"
    labels, annotations = fired["labels"], fired["annotations"]
    assert labels["job"] == job and labels["severity"]
    assert annotations["runbook_url"].endswith("#alert-name-syncscopesteptimecvhigh")
    assert mine["resolved"], f"{alert} never resolved: {mine['cv']}"
    assert mine["resolved"]["labels"]["job"] == job
    assert run["exit_codes"] == [0, 0], run["log"]
