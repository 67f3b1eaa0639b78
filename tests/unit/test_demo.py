"""`syncscope demo` cleans up after itself: a demo that fails stops every process it started;
with --nodes its table merges every node's exporter."""

from __future__ import annotations

import pytest

from syncscope.cli import build_parser
from syncscope.lab import demo


def test_a_demo_that_fails_after_starting_the_exporter_stops_it(monkeypatch):
    started = []
    real_start = demo.start_exporter

    def spy(*args, **kwargs):
        proc = real_start(*args, **kwargs)
        started.append(proc)
        return proc

    def broken_launch(*_args, **_kwargs):
        raise OSError("no ranks today")

    monkeypatch.setattr(demo, "start_exporter", spy)
    monkeypatch.setattr(demo, "launch", broken_launch)
    args = build_parser().parse_args(["demo", "--duration", "1", "--prometheus", "off"])
    with pytest.raises(OSError, match="no ranks today"):
        demo.run(args)
    assert len(started) == 1
    assert started[0].poll() is not None, "the exporter outlived the failed demo"


def _rank(rank: int, lead: float) -> dict:
    return {
        "rank": rank,
        "steps_total": 10,
        "step_time_median_s": 0.04,
        "step_time_cv": 0.1,
        "arrival_lead_s": lead,
        "phase_shares": {"comm_exposed": 0.5},
        "stale": False,
    }


def _state(ranks: list[dict], straggler: int | None) -> dict:
    diagnosis = {"straggler": {"rank": straggler, "cause": "forward", "cause_reason": "x"}}
    return {
        "jobs": {"demo": {"ranks": ranks, "diagnosis": diagnosis if straggler is not None else {}}}
    }


def test_the_nodes_table_lists_every_nodes_ranks_and_the_exporters_pick_the_smallest_lead():
    # Node 0's exporter blames rank 1 from its local view; node 1's blames rank 3, which
    # arrives later (smaller lead) than rank 1.
    states = [
        _state([_rank(1, 0.004), _rank(0, 0.006)], 1),
        _state([_rank(2, 0.030), _rank(3, 0.0)], 3),
    ]
    assert demo.exporters_straggler(states, "demo") == 3
    assert demo.exporters_straggler([_state([], None)], "demo") is None
    lines = demo.render_nodes_table(states, "demo", 3, "the exporters")
    rows = [line.split() for line in lines[2:6]]
    assert [(r[0], r[1]) for r in rows] == [("0", "0"), ("0", "1"), ("1", "2"), ("1", "3")]
    assert rows[3][-1] == "STRAGGLER" and "STRAGGLER" not in lines[3]
    assert "job-wide straggler: rank 3 (named by the exporters)" in lines
