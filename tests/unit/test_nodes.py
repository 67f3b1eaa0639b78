"""The pure parts of the multi-node harness: the pooled truth, the comparison, launch's per-rank
prefix and environment, Alertmanager's config, and which namespaces count as stale."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import yaml

from syncscope.lab.launch import launch, wait_all
from syncscope.lab.nodes import _STALE, EmulatedNodes
from syncscope.lab.servers import alertmanager_config
from syncscope.lab.truth import (
    compare,
    format_comparison,
    pooled_truth,
    rule_window_steps,
    truth_from_dir,
)


def _rec(rank: int, step: int, d: float, step_s: float = 0.1) -> dict:
    return {
        "rank": rank,
        "world_size": 3,
        "step": step,
        "step_s": step_s,
        "phases": {"forward": 0.01, "comm_exposed": d},
        "wait_s": 0.0,
        "end_unix_s": 1.0 + step,
    }


def _write(directory, records: list[dict]) -> None:
    for rec in records:
        with open(os.path.join(directory, f"rank{rec['rank']}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def test_pooled_truth_is_each_ranks_wait_for_the_last_arrival_over_common_steps(tmp_path):
    # Step 1: rank 2 is last (smallest d); step 2: rank 0 is. Step 3 is missing on rank 1 and
    # step 0 is warm-up, so both are left out.
    d = {0: [9.0, 0.04, 0.00], 1: [9.0, 0.03, 0.02], 2: [0.0, 0.00, 0.05]}
    records = [_rec(r, k, d[r][k]) for r in d for k in range(3)]
    records += [_rec(0, 3, 0.5), _rec(2, 3, 0.0)]
    _write(tmp_path, records)
    truth = truth_from_dir(str(tmp_path), skip_steps=1)
    assert truth.steps == 2
    assert truth.mean_wait_s == pytest.approx({0: 0.02, 1: 0.025, 2: 0.025})
    assert truth.mean_blocked_s == pytest.approx({0: 0.02, 1: 0.025, 2: 0.025})
    assert truth.amplification == pytest.approx((0.04 + 0.03 + 0.02 + 0.05) / (6 * 0.1))
    assert truth.straggler == 0  # smallest mean d


def test_a_steady_straggler_is_named_and_waits_are_relative_to_it():
    records = {
        r: {k: _rec(r, k, 0.001 if r == 3 else 0.031 + 0.001 * r) for k in range(10)}
        for r in range(4)
    }
    truth = pooled_truth(records)
    assert truth.straggler == 3
    assert truth.mean_transfer_s == pytest.approx(0.001)  # the straggler's d: it waits for nobody
    assert truth.mean_wait_s[3] == pytest.approx(0.0)
    assert truth.mean_wait_s[0] == pytest.approx(0.030)


def test_a_pipelines_straggler_is_the_least_blocked_rank_of_the_stage_that_waits_longest():
    # Two stages: stage 1 (ranks 1, 3) is heavier, so stage 0 (ranks 0, 2) blocks longer every
    # step, and rank 1 is the job's least blocked rank. Rank 2 is slow within stage 0: rank 0
    # waits 20 ms for it there; stage 1's ranks wait 2 ms for each other.
    exposed = {0: 0.030, 1: 0.001, 2: 0.010, 3: 0.003}
    records = {r: {k: _rec(r, k, exposed[r]) for k in range(5)} for r in range(4)}
    stages = {r: r % 2 for r in range(4)}
    truth = pooled_truth(records, stages=stages)
    assert truth.mean_wait_s == pytest.approx({0: 0.020, 1: 0.0, 2: 0.0, 3: 0.002})
    assert truth.straggler == 2
    assert pooled_truth(records).straggler == 1  # compared across stages


def test_a_paced_ranks_delay_counts_as_time_it_waited():
    # Rank 1 is the straggler (1 ms blocked). Rank 0 waits 30 ms in the collective; rank 2 is
    # paced 20 ms at the step boundary and then waits 10 ms: both lost 30 ms to rank 1.
    records = {r: {k: _rec(r, k, (0.031, 0.001, 0.011)[r]) for k in range(4)} for r in range(3)}
    for k in range(4):
        records[2][k]["phases"]["pacing"] = 0.020
    truth = pooled_truth(records)
    assert truth.mean_wait_s == pytest.approx({0: 0.030, 1: 0.0, 2: 0.030})
    assert truth.straggler == 1
    assert truth.amplification == pytest.approx(0.060 / 0.3)


def test_truth_refuses_records_without_a_common_step():
    with pytest.raises(ValueError, match="every rank"):
        pooled_truth({0: {1: _rec(0, 1, 0.0)}, 1: {2: _rec(1, 2, 0.0)}})
    with pytest.raises(ValueError, match="no records"):
        pooled_truth({})


def test_a_windowed_truth_covers_the_steps_the_rules_window_saw():
    # Steps end at 1 + k s; the job ends at 10 s. A 3 s window read 2 s after the end covers
    # the steps that ended after 9 s: only step 9, where rank 1 waited 0.05 s.
    records = {
        r: {k: _rec(r, k, 0.01 if k < 9 or r == 0 else 0.06) for k in range(10)} for r in (0, 1)
    }
    truth = pooled_truth(records, window_s=3.0, settle_s=2.0)
    assert truth.at_unix_s == pytest.approx(12.0)
    assert truth.steps == 1
    assert truth.mean_wait_s == pytest.approx({0: 0.0, 1: 0.05})
    whole = pooled_truth(records)
    assert whole.at_unix_s is None and whole.mean_wait_s[1] == pytest.approx(0.005)


class FakeProm:
    def __init__(self) -> None:
        self.at: list[float | None] = []

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        self.at.append(at)
        if promql.startswith("job_rank:syncscope_phase_blocked_seconds_per_step:minus_job_min"):
            return [{"metric": {"rank": str(r)}, "value": [0, str(0.01 * r)]} for r in range(2)]
        if promql.startswith("job:syncscope_sync_amplification:ratio"):
            return [{"metric": {}, "value": [0, "0.5"]}]
        if promql.startswith("job:syncscope_collective_transfer_seconds_per_step:min"):
            return [{"metric": {}, "value": [0, "0.004"]}]
        if promql.startswith("job_rank:syncscope_straggler_lag_seconds:argmin_lead"):
            return [{"metric": {"rank": "0"}, "value": [0, "0.01"]}]
        raise AssertionError(promql)


def test_compare_sets_exporters_and_rules_beside_the_truth():
    truth = pooled_truth({r: {k: _rec(r, k, 0.02 * (1 - r)) for k in range(4)} for r in range(2)})
    states = [
        {
            "jobs": {
                "j": {
                    "ranks": [{"rank": r, "arrival_lead_s": 0.005 * r}],
                    "diagnosis": {
                        "straggler": {"rank": r},
                        "modes": {"fabric_contention": {"verdict": r == 0, "score": 0.6}},
                    },
                }
            }
        }
        for r in range(2)
    ]
    prom = FakeProm()
    c = compare(prom, states, truth, "j")
    assert set(prom.at) == {None}  # a truth without a window: the rules as they are now
    assert c["ranks"][1]["node"] == 1
    assert c["ranks"][1]["exported_lead_s"] == pytest.approx(0.005)
    assert c["ranks"][1]["rule_lead_avg_s"] == pytest.approx(0.01)
    assert c["ranks"][0]["truth_wait_s"] == pytest.approx(0.02)
    assert c["straggler"] == {"truth": 1, "rule": 0}
    assert [n["fabric_contention"] for n in c["nodes"]] == [True, False]
    assert c["amplification"]["rule"] == 0.5
    assert c["transfer"] == {"truth": pytest.approx(0.0), "rule": 0.004}
    text = format_comparison(c)
    assert "straggler: rule 0, truth 1" in text
    assert format_comparison(compare(None, states, truth, "j"))  # without Prometheus too


def test_launch_gives_each_rank_its_prefix_environment_and_local_rank(tmp_path):
    # The prefix runs instead of python here: it writes what the rank would have seen.
    script = 'echo "$RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $GLOO_SOCKET_IFNAME" > "$0"'
    procs = launch(
        4,
        [],
        local_world_size=2,
        prefix=lambda rank: ["sh", "-c", script, str(tmp_path / f"r{rank}")],
        rank_env=lambda rank: {"GLOO_SOCKET_IFNAME": f"node{rank // 2}"},
    )
    assert wait_all(procs, 30) == [0, 0, 0, 0]
    seen = [(tmp_path / f"r{rank}").read_text().split() for rank in range(4)]
    assert seen == [
        ["0", "0", "4", "2", "node0"],
        ["1", "1", "4", "2", "node0"],
        ["2", "0", "4", "2", "node1"],
        ["3", "1", "4", "2", "node1"],
    ]


def test_alertmanager_config_sends_firing_and_resolved_to_the_webhook(tmp_path):
    text = alertmanager_config("http://127.0.0.1:1/hook")
    config = yaml.safe_load(text)
    assert config["receivers"][0]["webhook_configs"] == [
        {"url": "http://127.0.0.1:1/hook", "send_resolved": True}
    ]
    assert config["route"]["group_wait"] == "1s"
    amtool = shutil.which("amtool")
    if amtool:
        (tmp_path / "am.yml").write_text(text)
        done = subprocess.run(
            [amtool, "check-config", str(tmp_path / "am.yml")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_only_this_schemes_namespaces_count_as_stale_and_names_are_unique():
    assert _STALE.match("syncscope-123-0-node4")
    assert _STALE.match("syncscope-123-7-switch")
    assert not _STALE.match("syncscope-123-0-node4-extra")
    assert not _STALE.match("other-123-0-node4")
    a, b = EmulatedNodes(2, 1), EmulatedNodes(2, 1)  # not entered: nothing exists yet
    try:
        assert a.name != b.name
        assert {n.netns for n in a.nodes}.isdisjoint(n.netns for n in b.nodes)
        assert a.node_of(1).index == 1 and a.world_size == 2
    finally:
        a.close()
        b.close()


def test_the_truth_can_cover_exactly_the_steps_a_rules_window_saw():
    class RangeProm:
        def query(self, promql: str, at: float | None = None) -> list[dict]:
            assert promql == 'syncscope_steps_total{job="j",rank="0"}[10s]' and at == 12.0
            # rank 0's counter at the window's first and last scrape: steps 5..7 were in it
            return [{"metric": {}, "values": [[3.0, "5"], [7.0, "6"], [11.0, "8"]]}]

    d = {0: [0.0] * 10, 1: [0.01 * k for k in range(10)]}  # rank 1 waits 10 ms more each step
    records = {r: {k: _rec(r, k, d[r][k]) for k in range(10)} for r in d}
    truth = pooled_truth(
        records, window_s=10.0, rule_steps=rule_window_steps(RangeProm(), "j", "10s")
    )
    assert truth.steps == 3 and truth.at_unix_s == pytest.approx(12.0)
    assert truth.mean_wait_s[1] == pytest.approx(0.06)  # steps 5, 6, 7
