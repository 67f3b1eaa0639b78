"""The job-wide view an exporter reads back from Prometheus, and what its diagnosis does with it.

The node's ranks come from a recorded real run (tests/fixtures/scenarios); the job-wide
figures are what the recording rules would return for a job whose other ranks report to
another exporter. The real Prometheus round trip is in tests/integration/test_multinode.py.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any

from syncscope.exporter.collectors import collect_diagnosis
from syncscope.exporter.diagnosis import ModeVerdict, diagnose_job
from syncscope.exporter.jobwide import JobWide, PrometheusReader, parse
from syncscope.exporter.pooling import NodeInflation
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import JobView, StoreView, with_job_transfer

from syncscope.lab.servers import free_port
from syncscope.monitoring import rules
from syncscope.thresholds import load_config
from tests.unit.test_diagnosis import ranks_of

SETTINGS = Settings()


def two_of_four(name: str) -> list:
    """Ranks 0 and 1 of a recorded run, as one node's view of a 4-rank job."""
    return [r for r in ranks_of(name) if r.rank in (0, 1)]


def test_parse_groups_the_rules_by_job():
    def sample(value: str, **labels: str) -> dict:
        return {"metric": labels, "value": [1.0, value]}

    replies = {
        rules.LEAD: [
            sample("0.03", job="a", rank="0"),
            sample("0", job="a", rank="3"),
            sample("NaN", job="a", rank="2"),  # no steps in the window: left out, not 0
            sample("0.01", job="b", rank="1"),
        ],
        rules.TRANSFER_PER_STEP: [sample("0.005", job="a")],
        rules.SYNC_AMPLIFICATION: [sample("0.4", job="a"), sample("+Inf", job="b")],
        rules.TRANSFER_INFLATION: [sample("1.25", job="a")],
    }
    jobs = parse(replies, now=100.0)
    assert jobs["a"] == JobWide({0: 0.03, 3: 0.0}, 0.005, 0.4, 100.0, 1.25)
    assert jobs["b"] == JobWide({1: 0.01}, None, None, 100.0)


def test_an_unreachable_prometheus_leaves_the_view_node_local():
    reader = PrometheusReader(f"http://127.0.0.1:{free_port()}", interval_s=1.0, timeout_s=0.5)
    assert reader.read_once() is False
    assert reader.failures == 1 and reader.last_error
    assert reader.get("a") is None


def test_a_reading_older_than_three_intervals_is_dropped():
    reader = PrometheusReader("http://127.0.0.1:9", interval_s=10.0)
    now = time.time()
    reader._jobs = {"a": JobWide({0: 0.0}, None, None, now - 25)}
    assert reader.get("a", now=now) is not None
    assert reader.get("a", now=now + 10) is None


def test_an_ended_job_keeps_the_reading_it_had_at_its_last_report():
    """After the job's last report (105) the rules' windows drift past its last steps: the
    reading then (at 100) stays its view, also once Prometheus has dropped the job; a job
    still reporting gets each new reading, and none when Prometheus stopped answering."""
    reader = PrometheusReader("http://127.0.0.1:9", interval_s=10.0)
    running = JobWide({0: 0.03, 1: 0.0}, None, None, 100.0)
    drifted = JobWide({0: 0.0, 1: 0.02}, None, None, 110.0)
    reader._jobs = {"a": running, "b": running}
    assert reader.get("a", now=101.0, as_of=101.0) is running
    assert reader.get("b", now=101.0, as_of=101.0) is running
    reader._jobs = {"a": drifted, "b": drifted}
    assert reader.get("a", now=111.0, as_of=105.0) is running  # "a" ended at 105
    assert reader.get("b", now=111.0, as_of=111.0) is drifted  # "b" still reports
    reader._jobs = {}  # the rules' windows have left the job's last steps
    assert reader.get("a", now=400.0, as_of=105.0) is running
    # "b" still runs, but Prometheus has not answered since 110: node-local, not stale.
    assert reader.get("b", now=400.0, as_of=400.0) is None
    assert reader.get("c", now=400.0, as_of=400.0) is None


def test_node_local_view_of_a_multi_node_job_never_calls_the_fabric_contended():
    ranks = two_of_four("balanced")
    assert all(r.world_size == 4 for r in ranks)
    out = diagnose_job(ranks, SETTINGS)
    fabric = out.modes["fabric_contention"]
    assert fabric.score == 0 and not fabric.verdict
    assert "node-local" in fabric.reason and "--prometheus-url" in fabric.reason


def test_job_wide_view_names_a_straggler_on_another_node():
    ranks = two_of_four("balanced")
    step = statistics.median(r.step_time_median_s for r in ranks)  # the node's median step
    job_wide = JobWide({0: 0.030, 1: 0.031, 2: 0.029, 3: 0.0}, 0.004, 0.45, time.time())
    out = diagnose_job(ranks, SETTINGS, job_wide=job_wide)
    assert out.straggler is not None and out.straggler.rank == 3
    assert out.straggler.cause == "unknown" and "another node" in out.straggler.cause_reason
    assert out.modes["straggler"].verdict
    assert abs(out.skew_s - 0.031) < 1e-9
    assert out.modes["sync_amplification"].verdict  # 45 % idle
    assert "job-wide" in out.modes["sync_amplification"].reason
    # No baseline read yet: no fabric verdict, whatever share of the step the transfer is.
    assert 0.004 / step > 0.25
    fabric = out.modes["fabric_contention"]
    assert fabric.score == 0 and not fabric.verdict and "baseline" in fabric.reason


def test_only_the_exporter_of_the_stragglers_node_exports_its_cause():
    """Both nodes' exporters name the straggler from the job-wide view, but only the one its
    rank reports to can tell why: the other exports no cause series (one cause per rank in
    Prometheus, which the triage table shows on the straggler's row)."""
    ranks = two_of_four("balanced")  # ranks 0 and 1 of a 4-rank job

    def causes(leads: dict[int, float]) -> list[dict[str, str]]:
        out = diagnose_job(ranks, SETTINGS, job_wide=JobWide(leads, 0.004, 0.45, time.time()))
        assert out.straggler is not None
        view = StoreView(0.0, 0.0, 0, {}, {"j": JobView(tuple(ranks), out, "j")})
        families = {f.name: f for f in collect_diagnosis(view)}
        return [s.labels for s in families["syncscope_straggler_cause"].samples]

    assert causes({0: 0.030, 1: 0.031, 2: 0.029, 3: 0.0}) == []  # rank 3: another node
    (here,) = causes({0: 0.0, 1: 0.031, 2: 0.029, 3: 0.030})  # rank 0: this node
    assert here["rank"] == "0" and here["cause"], here
    assert here["node"] == ranks[0].hostname, here  # the triage row's node, from the cause too


def test_job_wide_fabric_contention_is_transfer_inflated_against_its_own_baseline():
    ranks = two_of_four("balanced")
    leads = {0: 0.001, 1: 0.0, 2: 0.0015, 3: 0.0005}
    steady = JobWide(leads, 0.004, 0.05, time.time(), transfer_inflation=1.1)
    contended = JobWide(leads, 0.008, 0.05, time.time(), transfer_inflation=1.8)
    calm = diagnose_job(ranks, SETTINGS, job_wide=steady).modes["fabric_contention"]
    assert not calm.verdict and abs(calm.score - 0.1) < 1e-9
    hot = diagnose_job(ranks, SETTINGS, job_wide=contended).modes["fabric_contention"]
    assert hot.verdict and abs(hot.score - 0.8) < 1e-9
    assert "1.80× its own baseline" in hot.reason


def test_job_wide_contention_discounts_what_slows_this_nodes_own_work():
    """A host that slows this node's ranks (CPUs shared with other work) slows a host-driven
    transfer that the whole job waits on: the job-wide inflation beyond this node's own work
    inflation is the fabric's, as in the node-local verdict."""
    ranks = two_of_four("balanced")
    leads = {0: 0.001, 1: 0.0, 2: 0.0015, 3: 0.0005}
    inflated = JobWide(leads, 0.008, 0.05, time.time(), transfer_inflation=1.8)

    def fabric(work: float) -> ModeVerdict:
        node = NodeInflation(0.008, 1.8, work)
        out = diagnose_job(ranks, SETTINGS, job_wide=inflated, node_transfer=node)
        return out.modes["fabric_contention"]

    shared_host = fabric(1.7)  # the ranks' own work 1.7× its baseline: 1.06× is the fabric's
    assert not shared_host.verdict, shared_host
    assert "own work is 1.70×" in shared_host.reason, shared_host.reason
    quiet_host = fabric(1.0)  # the work as ever: all of the 1.8× is the fabric's
    assert quiet_host.verdict and abs(quiet_host.score - 0.8) < 1e-9, quiet_host


def test_job_wide_view_of_a_balanced_job_names_nobody():
    ranks = two_of_four("balanced")
    job_wide = JobWide({0: 0.001, 1: 0.0, 2: 0.0015, 3: 0.0005}, 0.004, 0.05, time.time())
    out = diagnose_job(ranks, SETTINGS, job_wide=job_wide)
    assert out.straggler is None
    assert not out.modes["straggler"].verdict
    assert not out.modes["sync_amplification"].verdict


def test_a_local_straggler_keeps_its_cause_in_the_job_wide_view():
    ranks = [r for r in ranks_of("forward_straggler")]
    slow = min(ranks, key=lambda r: r.arrival_lead_s).rank
    mates = [r for r in ranks if r.rank in (slow, (slow + 1) % 4)]
    leads = {r: (0.0 if r == slow else 0.03) for r in range(4)}
    out = diagnose_job(mates, SETTINGS, job_wide=JobWide(leads, 0.004, 0.5, time.time()))
    assert out.straggler is not None and out.straggler.rank == slow
    assert out.straggler.cause == "forward"


def test_baselines_come_down_by_what_the_node_waits_for_other_nodes():
    sync, small = ("ddp_grad_sync", "ddp", 20), ("all_reduce", "pg", 3)
    node = {sync: 0.030, small: 0.001}
    # The job's transfer per step is 5 ms: this node's ranks wait 26 ms for a remote rank.
    out = with_job_transfer(node, 0.031, 0.005)
    assert abs(out[sync] - 0.004) < 1e-12 and out[small] == 0.001
    assert with_job_transfer(node, 0.031, 0.5) == node  # never raised


def test_a_kind_that_skips_steps_does_not_take_the_sync_baseline_to_zero():
    sync, flag = ("ddp_grad_sync", "ddp", 20), ("broadcast", "default_pg", 2)
    # a 6 ms broadcast every tenth step: 0.6 ms per step, not 6 (the sum of the kinds' means
    # put the sync's baseline at 30 - (36 - 5) < 0: zero, "no baseline" to an agent)
    node = {sync: 0.030, flag: 0.006}
    out = with_job_transfer(node, 0.0306, 0.005)
    assert abs(out[sync] - 0.0044) < 1e-12 and out[flag] == 0.006
    # where the other kinds alone exceed the job's transfer, the sync keeps its share of it
    out = with_job_transfer({sync: 0.030, flag: 0.006}, 0.036, 0.005)
    assert abs(out[sync] - 0.030 * 0.005 / 0.036) < 1e-12


def test_a_pipelines_leads_are_over_its_stage_and_its_waits_over_the_job():
    """Two-stage pipelines {0,1} {2,3}, rank 2 (stage 0) slow, blocked per step 0.9, 0.5, 0.6
    and 0.45 s (ranks 0-3): the lead rule's series carry the stage, each lead over its stage's
    least blocked rank; the waits are over the job's least blocked rank (rank 3, the least of
    the stages' minima), whatever the stage."""

    def sample(value: str, **labels: str) -> dict:
        return {"metric": labels, "value": [1.0, value]}

    replies = {
        rules.LEAD: [
            sample("0.3", job="p", rank="0", stage="0"),
            sample("0.05", job="p", rank="1", stage="1"),
            sample("0", job="p", rank="2", stage="0"),
            sample("0", job="p", rank="3", stage="1"),
        ],
        rules.SYNC_PER_STEP_STAGE_MIN: [
            sample("0.6", job="p", stage="0"),
            sample("0.45", job="p", stage="1"),
        ],
    }
    wide = parse(replies, now=100.0)["p"]
    assert wide.stages == {0: 0, 1: 1, 2: 0, 3: 1}
    assert wide.leads == {0: 0.3, 1: 0.05, 2: 0.0, 3: 0.0}
    # stage 0's least blocked rank (2) is blocked 0.15 s a step more than the job's (3)
    assert {r: round(w, 9) for r, w in wide.job_waits().items()} == {
        0: 0.45,
        1: 0.05,
        2: 0.15,
        3: 0.0,
    }
    # A job that is no pipeline: its leads are its waits.
    flat = JobWide({0: 0.03, 1: 0.0})
    assert flat.job_waits() == flat.leads


def test_job_wide_view_of_a_pipeline_names_the_root_of_the_stage_whose_leads_spread():
    """Leads per stage: stage 0's rank 0 30 ms ahead of rank 2, stage 1's ranks 2 ms apart.
    Rank 2 is the root, 30 ms late; ranked across stages, rank 1 (lead 0 too, first) would be."""
    ranks = two_of_four("balanced")
    stages = {0: 0, 1: 1, 2: 0, 3: 1}
    leads = {0: 0.030, 1: 0.0, 2: 0.0, 3: 0.002}
    out = diagnose_job(
        ranks, SETTINGS, job_wide=JobWide(leads, 0.004, 0.1, time.time(), stages=stages)
    )
    assert out.straggler is not None and out.straggler.rank == 2
    assert abs(out.skew_s - 0.030) < 1e-9
    assert "in its pipeline stage (stage 0)" in out.modes["straggler"].reason


def test_job_wide_view_names_a_straggler_only_over_the_alerts_line():
    """The job-wide view counts no last arrivals per step, so a lag noise or a contended link
    lends one rank for a while is not told from a straggler's by persistence: it names a rank
    only where SyncscopeStraggler's condition does (its lag over the step above the alert's
    threshold, 10 %), not at the node-local line (5 %, with the last-arrival count). On CI a
    clean FSDP2 job across two nodes read 8.3 ms of job-wide skew, and a contended link 6.8 ms:
    both over the node-local line, both named."""
    step = 0.2  # both lines over the 5 ms floor
    ranks = [dataclasses.replace(r, step_time_median_s=step) for r in two_of_four("balanced")]
    alert_line = min(lv.threshold for lv in load_config().alerts["SyncscopeStraggler"].levels)
    assert alert_line == 0.1 and 0.05 * step > SETTINGS.skew_threshold_s, step

    def job_wide(lag: float) -> Any:
        leads = {0: lag, 1: lag, 2: lag, 3: 0.0}
        return diagnose_job(ranks, SETTINGS, job_wide=JobWide(leads, 0.004, 0.05, time.time()))

    between = job_wide(0.08 * step)
    assert between.straggler is None and not between.modes["straggler"].verdict, between
    assert "below" in between.modes["straggler"].reason
    over = job_wide(0.12 * step)
    assert over.straggler is not None and over.straggler.rank == 3, over.modes["straggler"]
