"""promtool's input notation expanded as the Prometheus docs define it, and the staged replay's
split of the rules (syncscope/lab/promtool_cases.py, syncscope/lab/vmreplay.py)."""

from __future__ import annotations

import math

import pytest

from syncscope.lab.promtool_cases import (
    STALE,
    PromtoolTest,
    duration_seconds,
    expand_values,
    parse_selector,
)
from syncscope.lab.vmreplay import stages


@pytest.mark.parametrize(
    "notation,values",
    [
        # The examples of Prometheus's configuration/unit_testing_rules.md.
        ("-2+4x3", [-2.0, 2.0, 6.0, 10.0]),
        ("1-2x4", [1.0, -1.0, -3.0, -5.0, -7.0]),
        ("1x4", [1.0, 1.0, 1.0, 1.0, 1.0]),
        ("1 _x3 stale", [1.0, None, None, None, STALE]),
        # Shapes of deploy/prometheus/tests/: several terms, decimals, a repeat after a ramp.
        ("0+60x4 240x2", [0.0, 60.0, 120.0, 180.0, 240.0, 240.0, 240.0, 240.0]),
        ("0.05x1 0.1+0.05x1", [0.05, 0.05, 0.1, 0.15]),
        ("3 _ 4", [3.0, None, 4.0]),
        ("1e3+1e2x1", [1000.0, 1100.0]),
    ],
)
def test_expand_values(notation, values):
    assert expand_values(notation) == pytest.approx(values)


def test_expand_values_special_floats():
    inf, nan = expand_values("Inf NaN")
    assert inf == math.inf and math.isnan(nan)


def test_a_typo_is_an_error_not_a_sample():
    with pytest.raises(ValueError):
        expand_values("1+x3")


def test_selectors_and_durations():
    assert parse_selector('up{job="a",instance="h:1"}') == {
        "__name__": "up",
        "job": "a",
        "instance": "h:1",
    }
    assert parse_selector('{quantile="0.9"}') == {"quantile": "0.9"}
    assert duration_seconds("1m30s") == 90 and duration_seconds("15s") == 15
    with pytest.raises(ValueError):
        duration_seconds("5 min")


def test_exposition_moves_timestamps_and_unix_time_values_by_the_base():
    test = PromtoolTest(
        "f",
        "t",
        15.0,
        [
            ({"__name__": "c_total", "job": "j"}, [0.0, None, 2.0, STALE]),
            ({"__name__": "x_timestamp_seconds", "job": "j"}, [60.0]),
        ],
        [],
    )
    assert list(test.exposition(1000.0)) == [
        'c_total{job="j"} 0.0 1000000',
        'c_total{job="j"} 2.0 1030000',
        'x_timestamp_seconds{job="j"} 1060.0 1000000',
    ]
    assert test.uses_stale


def test_stages_put_each_rule_after_the_records_it_reads():
    groups = {
        "groups": [
            {
                "name": "g",
                "rules": [
                    {"record": "job:b:sum", "expr": "sum(job:a:rate)"},
                    {"record": "job:a:rate", "expr": "rate(syncscope_x_total[1m])"},
                ],
            },
            {
                "name": "slow",
                "interval": "1m",
                "rules": [{"record": "job:c:max", "expr": "max(job:b:sum)"}],
            },
            {
                "name": "alerts",
                "rules": [
                    {"alert": "A", "expr": "job:a:rate > 1", "annotations": {"summary": "s"}},
                ],
            },
        ]
    }
    split = stages(groups)
    order = [
        [r.get("record") or r["alert"] for g in f["groups"] for r in g["rules"]] for f in split
    ]
    assert order == [["job:a:rate"], ["job:b:sum", "A"], ["job:c:max"]]
    assert split[2]["groups"] == [
        {"name": "slow", "interval": "1m", "rules": [groups["groups"][1]["rules"][0]]}
    ]
    assert "annotations" not in split[1]["groups"][1]["rules"][0]
