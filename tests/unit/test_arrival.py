"""The agent's transfer baselines on synthetic durations with a known answer, and the keys the
agent and the exporter share."""

from __future__ import annotations

import pytest
from syncscope.agent.local_arrival import Baselines

from syncscope.arrival import collective_key, key_text, parse_key_text

KEY = collective_key("ddp_grad_sync", "default_pg", 4 * 2**20)


def test_a_calls_wait_is_its_duration_beyond_the_smallest_recent_one():
    base = Baselines(window=4)
    # the rank arrives last once (4 ms: the transfer alone), early by 30 ms otherwise; a
    # flush's calls are judged against the baseline after all of them
    waits = base.observe([(KEY, 0.034), (KEY, 0.004), (KEY, 0.034)])
    assert waits == pytest.approx([0.030, 0.0, 0.030])
    assert base.baseline(KEY) == pytest.approx(0.004)
    # the 4 ms call leaves the window of 4: the smallest of the last four is 34 ms again
    base.observe([(KEY, 0.034)] * 3)
    assert base.baseline(KEY) == pytest.approx(0.034)


def test_the_exporters_baseline_wins_over_the_local_minimum():
    """A steady straggler's peers never see a wait-free call of their own: alone, a rank reads
    no wait; the node's baseline from the exporter shows the 30 ms it waits."""
    base = Baselines()
    assert base.observe([(KEY, 0.034)] * 5) == [0.0] * 5
    base.merge({KEY: 0.004})
    assert base.observe([(KEY, 0.034)]) == pytest.approx([0.030])
    assert base.all() == {KEY: 0.004}


def test_keys_round_trip_as_text_and_bad_text_is_none():
    assert parse_key_text(key_text(KEY)) == KEY
    assert parse_key_text("all_reduce|pg") is None
    assert parse_key_text("all_reduce|pg|x") is None
