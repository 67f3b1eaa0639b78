"""The job-wide view an exporter reads back from Prometheus, and what its diagnosis does with it.

The node's ranks come from a recorded real run (tests/fixtures/scenarios); the job-wide
figures are what the recording rules would return for a job whose other ranks report to
another exporter. The real Prometheus round trip is in tests/integration/test_multinode.py.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from typing import Any

import pytest
from syncscope.exporter.app import parse_batch
from syncscope.exporter.collectors import collect_diagnosis
from syncscope.exporter.diagnosis import ModeVerdict, diagnose_job
from syncscope.exporter.jobwide import Interest, JobWide, PrometheusReader, parse
from syncscope.exporter.pooling import NodeInflation
from syncscope.exporter.settings import Settings
from syncscope.exporter.store import JobView, Store, StoreView, with_job_transfer

from syncscope.lab.servers import free_port
from syncscope.monitoring import rules
from syncscope.thresholds import load_config
from tests.unit.test_diagnosis import ranks_of
from tests.unit.test_exporter_app import BATCH

SETTINGS = Settings()


def ruled(leads: dict[int, float], *args: Any, **kwargs: Any) -> JobWide:
    """A reading as the rules give it for a job with these leads: its straggler
    (recorded.STRAGGLER_LAG) is the least blocked rank of the stage whose leads spread most,
    its lag that spread; a stage needs two ranks."""
    stages: dict[int, list[tuple[float, int]]] = {}
    for rank, lead in leads.items():
        stages.setdefault(kwargs.get("stages", {}).get(rank, 0), []).append((lead, rank))
    spread = [(max(m)[0] - min(m)[0], min(m)[1]) for m in stages.values() if len(m) >= 2]
    root = max(spread, key=lambda s: s[0], default=None)
    straggler = None if root is None else (root[1], root[0])
    return JobWide(leads, *args, straggler=straggler, **kwargs)


def held(wide: JobWide) -> JobWide:
    """`wide` as a reading whose values have held for SyncscopeStraggler's for: (the same
    reading that long before it)."""
    before = wide.read_unix_s - SETTINGS.thresholds.straggler_hold_s
    return dataclasses.replace(wide, earlier=(dataclasses.replace(wide, read_unix_s=before),))


def two_of_four(name: str) -> list:
    """Ranks 0 and 1 of a recorded run, as one node's view of a 4-rank job."""
    return [r for r in ranks_of(name) if r.rank in (0, 1)]


def sample(value: str, **labels: str) -> dict:
    return {"metric": labels, "value": [1.0, value]}


def test_parse_groups_the_rules_by_job():
    replies = {
        rules.LEAD: [
            sample("0.03", job="a", rank="0"),
            sample("NaN", job="a", rank="2"),  # no steps in the window: left out, not 0
            sample("0.01", job="b", rank="1"),
        ],
        rules.STRAGGLER_LAG: [sample("0.03", job="a", rank="3")],
        rules.TRANSFER_PER_STEP: [sample("0.005", job="a")],
        rules.SYNC_AMPLIFICATION: [sample("0.4", job="a"), sample("+Inf", job="b")],
        rules.TRANSFER_INFLATION: [sample("1.25", job="a")],
        rules.STEP_MEAN: [sample("0.2", job="a")],
        rules.SLOWEST_LINK: [sample("0.5", job="a", node="n2")],
    }
    jobs = parse(replies, now=100.0)
    assert jobs["a"] == JobWide(
        {0: 0.03, 3: 0.0},  # the straggler's lead is 0 by construction
        0.005,
        0.4,
        100.0,
        1.25,
        ("n2", 0.5),
        step_mean_s=0.2,
        straggler=(3, 0.03),
    )
    assert jobs["b"] == JobWide({1: 0.01}, None, None, 100.0)


class Engine:
    """Stands in for Prometheus's instant queries over a 16-rank job on 4 nodes of 4 ranks
    (node n<k> holds ranks 4k..4k+3), rank 13 the straggler: answers the queries a reader
    sends by the matchers in them, and keeps them."""

    def __init__(self) -> None:
        self.queries: list[str] = []
        self.leads = {
            rank: (0.0 if rank == 13 else 0.02 + (16 - rank) / 1000) for rank in range(16)
        }

    def instant(self, promql: str) -> list[dict]:
        self.queries.append(promql)
        if promql.startswith("{__name__=~"):
            assert 'job=~"j"' in promql
            return [
                {
                    **sample("0.035", job="j", rank="13"),
                    "metric": {"__name__": rules.STRAGGLER_LAG, "job": "j", "rank": "13"},
                },
                {**sample("0.05", job="j"), "metric": {"__name__": rules.STEP_MEAN, "job": "j"}},
                {
                    **sample("0.9", job="j"),
                    "metric": {"__name__": rules.SLOWEST_LINK, "job": "j", "node": "n2"},
                },
            ]
        if promql.startswith(rules.LEAD) and "rank=~" not in promql:  # the node's ranks
            assert 'node=~"n0"' in promql and 'job=~"j"' in promql, promql
            return [sample(str(self.leads[r]), job="j", rank=str(r)) for r in range(4)]
        # The next hops: one term per small group, a selector of its members, and one per label
        # of the large groups, the rules' least blocked member of each (its lowest rank: i, the
        # data-parallel group i, i+4, i+8, i+12).
        out = []
        for term in promql.split(" or "):
            if term.startswith(rules.GROUP_NEXT_HOP):
                assert 'group="dp"' in term, term
                for first in term.split('group_first=~"')[1].split('"')[0].split("|"):
                    least = min(range(int(first), 16, 4), key=self.leads.__getitem__)
                    labels = {"job": "j", "group": "dp", "group_first": first, "rank": str(least)}
                    out.append(
                        {
                            "metric": {"__name__": rules.GROUP_NEXT_HOP, **labels},
                            "value": [1.0, str(self.leads[least])],
                        }
                    )
                continue
            ranks = [int(r) for r in term.split('rank=~"')[1].split('"')[0].split("|")]
            out += [sample(str(self.leads[r]), job="j", rank=str(r)) for r in ranks]
        return out


def test_a_read_asks_for_the_nodes_ranks_and_the_jobs_own_series_only():
    """Node n0 holds ranks 0-3 of the 16-rank job: the reader asks for those four leads (job
    and node matchers), the job's series (the straggler and the slowest link among them), and
    the least blocked member of each group of its ranks that reaches other nodes and does not hold
    the straggler: the world (16 ranks, holds 13) and its tensor-parallel group (0-3, all
    here) need nothing; its data-parallel groups (i, i+4, i+8, i+12) do. Each is read whole
    (a small group) or, too large for that, is one recorded series: its least blocked member
    (recorded.GROUP_NEXT_HOP), asked for by its label and lowest rank. Either way the reply
    stays the node's size; the query's text does too for large groups."""
    engine = Engine()
    dp = frozenset(tuple(range(i, 16, 4)) for i in range(4))
    interest = Interest(frozenset({"n0"}), frozenset({tuple(range(16)), (0, 1, 2, 3)}) | dp)
    reader = PrometheusReader("http://127.0.0.1:9", wanted=lambda: {"j": interest})
    reader.api.instant = engine.instant  # type: ignore[method-assign]
    assert reader.read_once()
    reading = reader.get("j")
    assert reading is not None and reading.straggler == (13, 0.035)
    assert reading.slowest_link == ("n2", 0.9) and reading.step_mean_s == 0.05
    # dp group (1, 5, 9, 13) holds the straggler: 3 of 4 dp groups asked, each whole
    (hops,) = [q for q in engine.queries if "rank=~" in q]
    assert hops.count(rules.LEAD) == 3 and "bottomk" not in hops, hops
    assert set(reading.leads) == {0, 1, 2, 3, 13} | {4, 8, 12, 6, 10, 14, 7, 11, 15}
    assert reader.last_cycle[:2] == (3, 4 + 3 + 12)
    # The same groups as the store holds them past SMALL_GROUP: by (label, lowest rank). Their
    # membership is not known here, so the straggler's group is asked too (its hop: 13).
    large = frozenset(("dp", i) for i in range(4))
    reader.wanted = lambda: {"j": Interest(frozenset({"n0"}), frozenset({(0, 1, 2, 3)}), large)}
    engine.queries.clear()
    assert reader.read_once()
    (hops,) = [q for q in engine.queries if rules.GROUP_NEXT_HOP in q]
    assert "rank=~" not in hops and 'group_first=~"0|1|2|3"' in hops, hops
    later = reader.get("j")
    assert later is not None and later.hops == {"dp": {0: 12, 1: 13, 2: 14, 3: 15}}
    assert set(later.leads) == {0, 1, 2, 3, 13, 12, 14, 15}
    assert reader.last_cycle[:2] == (3, 4 + 3 + 4)


def test_a_reader_with_no_job_here_asks_nothing():
    engine = Engine()
    reader = PrometheusReader("http://127.0.0.1:9")
    reader.api.instant = engine.instant  # type: ignore[method-assign]
    assert reader.read_once() and engine.queries == []


def test_an_unreachable_prometheus_leaves_the_view_node_local():
    reader = PrometheusReader(
        f"http://127.0.0.1:{free_port()}",
        interval_s=1.0,
        timeout_s=0.5,
        wanted=lambda: {"a": Interest(frozenset({"n0"}))},
    )
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
    job_wide = held(ruled({0: 0.030, 1: 0.031, 2: 0.029, 3: 0.0}, 0.004, 0.45, time.time()))
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
        out = diagnose_job(ranks, SETTINGS, job_wide=held(ruled(leads, 0.004, 0.45, time.time())))
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
    steady = ruled(leads, 0.004, 0.05, time.time(), transfer_inflation=1.1)
    contended = ruled(leads, 0.008, 0.05, time.time(), transfer_inflation=1.8)
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
    inflated = ruled(leads, 0.008, 0.05, time.time(), transfer_inflation=1.8)

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
    job_wide = ruled({0: 0.001, 1: 0.0, 2: 0.0015, 3: 0.0005}, 0.004, 0.05, time.time())
    out = diagnose_job(ranks, SETTINGS, job_wide=job_wide)
    assert out.straggler is None
    assert not out.modes["straggler"].verdict
    assert not out.modes["sync_amplification"].verdict


def test_a_local_straggler_keeps_its_cause_in_the_job_wide_view():
    ranks = [r for r in ranks_of("forward_straggler")]
    slow = min(ranks, key=lambda r: r.arrival_lead_s).rank
    mates = [r for r in ranks if r.rank in (slow, (slow + 1) % 4)]
    leads = {r: (0.0 if r == slow else 0.03) for r in range(4)}
    out = diagnose_job(mates, SETTINGS, job_wide=held(ruled(leads, 0.004, 0.5, time.time())))
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
        ranks, SETTINGS, job_wide=held(ruled(leads, 0.004, 0.1, time.time(), stages=stages))
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
        return diagnose_job(ranks, SETTINGS, job_wide=held(ruled(leads, 0.004, 0.05, time.time())))

    between = job_wide(0.08 * step)
    assert between.straggler is None and not between.modes["straggler"].verdict, between
    assert "below" in between.modes["straggler"].reason
    over = job_wide(0.12 * step)
    assert over.straggler is not None and over.straggler.rank == 3, over.modes["straggler"]


def test_the_job_wide_line_is_a_share_of_the_windows_mean_step_not_of_the_step_now():
    """The leads are means per step over the rules' window. After a slow spell (a competing
    flow doubled the transfer) the ranks' step is short again while the window still holds the
    long steps: 8 ms of lead from that window is under 10 % of its 100 ms mean step, though
    over 10 % of the 60 ms step reported now (in CI such a transition named a straggler). The
    reverse, a job slowing down, is judged on the window's steps alike."""
    now = 0.06
    ranks = [dataclasses.replace(r, step_time_median_s=now) for r in two_of_four("balanced")]
    leads = {0: 0.008, 1: 0.008, 2: 0.008, 3: 0.0}

    def reading(step_mean: float | None) -> Any:
        wide = held(ruled(leads, 0.004, 0.05, time.time(), step_mean_s=step_mean))
        return diagnose_job(ranks, SETTINGS, job_wide=wide)

    after_spell = reading(0.1)
    assert after_spell.straggler is None, after_spell.modes["straggler"]
    assert after_spell.skew_line_s == pytest.approx(0.01)
    slowing = reading(0.07)  # 8 ms over 10 % of the window's 70 ms
    assert slowing.straggler is not None and slowing.straggler.rank == 3
    assert slowing.skew_line_s == pytest.approx(0.007)
    # No step mean read (an older rule set): the step reported now, as before
    assert reading(None).skew_line_s == pytest.approx(0.006)


def test_the_job_wide_view_names_a_rank_only_once_it_has_held_for_a_window():
    """The job-wide view names a rank once it has been the root over the line for the alert's
    for: and a straggler window (5 min each as shipped). As a competing flow began, each
    node's rates ended at its own last scrape, and the ranks of one node led the others by
    12 % of the window's step at one evaluation, 2 % at the next, then 11 % twice: a lead
    that lasts while the change is inside the window, less than a window. A straggler's
    lead holds."""
    ranks = [dataclasses.replace(r, step_time_median_s=0.1) for r in two_of_four("balanced")]
    hold = SETTINGS.thresholds.straggler_hold_s
    assert hold > 0, "the shipped alert waits"
    late, flat = {0: 0.03, 1: 0.03, 2: 0.03, 3: 0.0}, {0: 0.001, 1: 0.0, 2: 0.002, 3: 0.001}
    now = time.time()

    def named(*readings: dict[int, float]) -> Any:
        """The newest of `readings`, evenly spread over the alert's for:, oldest first."""
        at = [
            now - hold * (len(readings) - 1 - i) / max(1, len(readings) - 1)
            for i in range(len(readings))
        ]
        wide = [ruled(leads, 0.004, 0.05, t) for leads, t in zip(readings, at, strict=True)]
        out = diagnose_job(
            ranks, SETTINGS, job_wide=dataclasses.replace(wide[-1], earlier=tuple(wide[:-1]))
        )
        return out.straggler.rank if out.straggler else None, out.modes["straggler"]

    rank, mode = named(late)  # just over the line
    assert rank is None and not mode.verdict and "must hold" in mode.reason, mode
    assert named(late, late)[0] == 3
    assert named(late, late, late)[0] == 3
    assert named(late, flat, late)[0] is None  # the flicker
    other = {0: 0.0, 1: 0.03, 2: 0.03, 3: 0.03}  # rank 0 the root a for: ago
    assert named(other, late)[0] is None


def test_the_reader_hands_each_reading_the_history_the_hold_needs(monkeypatch):
    """Each reading carries the readings of the last `history_s` and the one before them
    (what tells that a lead held that long), and no more: memory stays bounded."""
    reader = PrometheusReader(
        "http://127.0.0.1:1",
        interval_s=1.0,
        history_s=10.0,
        wanted=lambda: {"a": Interest(frozenset({"n0"}))},
    )
    clock = iter([100.0, 104.0, 108.0, 112.0, 116.0])
    monkeypatch.setattr(time, "time", lambda: next(clock))

    def instant(query: str) -> list:
        return (
            [{"metric": {"job": "a", "rank": "0"}, "value": [0, "0.01"]}]
            if query.startswith(rules.LEAD)
            else []
        )

    monkeypatch.setattr(reader.api, "instant", instant)
    for _ in range(5):
        assert reader.read_once()
    newest = reader._jobs["a"]
    assert newest.read_unix_s == 116.0
    # 104 is 12 s before: the one older than the history that tells it held from then
    assert [r.read_unix_s for r in newest.earlier] == [104.0, 108.0, 112.0]
    assert all(r.earlier == () for r in newest.earlier)


def test_an_exporter_that_holds_the_whole_job_names_its_straggler_without_the_hold():
    """All four ranks report here: the node's view, which counts last arrivals per step, is the
    job's, and names the straggler at once; the reading Prometheus gives (no history yet) adds
    the amplification, not a hold of 5 minutes."""
    ranks = ranks_of("forward_straggler")
    slow = min(ranks, key=lambda r: r.arrival_lead_s).rank
    leads = {r.rank: r.arrival_lead_s for r in ranks}
    out = diagnose_job(ranks, SETTINGS, job_wide=ruled(leads, 0.004, 0.5, time.time()))
    assert out.straggler is not None and out.straggler.rank == slow, out.modes["straggler"]
    assert out.straggler.cause == "forward"
    assert "job-wide" in out.modes["sync_amplification"].reason
    # Half of the job here: the job-wide view, which must hold first
    mates = [r for r in ranks if r.rank in (slow, (slow + 1) % 4)]
    half = diagnose_job(mates, SETTINGS, job_wide=ruled(leads, 0.004, 0.5, time.time()))
    assert half.straggler is None and "must hold" in half.modes["straggler"].reason


def test_the_store_asks_for_small_groups_whole_and_large_ones_by_label_and_lowest_rank():
    """Store.interest(): a group of at most SMALL_GROUP ranks by its members; a larger one,
    listed or reported by its lowest rank only, as (label, lowest rank)."""
    store = Store(SETTINGS)
    wide = ",".join(str(r) for r in range(1, 80, 4))  # 20 ranks: listed, but past SMALL_GROUP
    topology = {"group.tp": "0,1", "group.dp": wide, "group_first.ep": "1", "gpu": "x"}
    body = {**BATCH, "agent": {**BATCH["agent"], "rank": 1}, "topology": topology}
    assert store.ingest(parse_batch(json.dumps(body).encode()))["accepted"]
    (interest,) = store.interest().values()
    assert interest.groups == {(0, 1)}
    assert interest.large == {("dp", 1), ("ep", 1)}


def test_a_victim_waits_for_the_rules_least_blocked_member_of_a_group_it_cannot_list():
    """Ranks 0 and 1 wait in the world group, rank 3 (another node) the straggler. With the
    group's ranks listed, the chain leads to rank 3 from them; with only its lowest rank known
    (a group too large to list), from the rules' least blocked member (JobWide.hops)."""
    listed = two_of_four("balanced")
    leads = {0: 0.030, 1: 0.031, 2: 0.029, 3: 0.0}
    unlisted = [dataclasses.replace(r, topology={"group_first.default_pg": "0"}) for r in listed]
    for ranks, hops, expect in (
        ([dataclasses.replace(r, topology={"group.default_pg": "0,1,2,3"}) for r in listed], {}, 3),
        (unlisted, {"default_pg": {0: 3}}, 3),
        (unlisted, {}, None),  # nothing says whom: no rank is made up
    ):
        job_wide = held(ruled(leads, 0.004, 0.45, time.time(), hops=hops))
        out = diagnose_job(ranks, SETTINGS, job_wide=job_wide)
        assert out.straggler is not None and out.straggler.rank == 3
        assert {v.rank: v.waits_for for v in out.victims} == {0: expect, 1: expect}, out.victims
