"""promtool's rule unit tests as data another engine can replay: their input series expanded
to timestamped samples, and their expression checks with the hand-computed answers.

promtool (`promtool test rules`) is the reference; this module lets the same inputs and answers
check VictoriaMetrics + vmalert (tests/e2e/test_victoriametrics.py). It understands the input
notation of the Prometheus docs (configuration/unit_testing_rules.md): ``a+bxn``, ``a-bxn``,
``axn``, ``_``, ``_xn`` and ``stale``.

    expand_values("1+2x3 _ stale")  # [1.0, 3.0, 5.0, 7.0, None, STALE]
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

STALE = "stale"

_EXPANDING = re.compile(r"^(?P<a>[-+]?[^-+x]+(?:e[-+]?\d+)?)(?P<op>[-+])(?P<b>[^x]+)x(?P<n>\d+)$")
_REPEAT = re.compile(r"^(?P<a>[-+]?[^x]+)x(?P<n>\d+)$")
_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
_SELECTOR = re.compile(r"^\s*(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)?\s*(?:\{(?P<labels>.*)\})?\s*$")
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def _number(text: str) -> float:
    return float(text)  # also Inf, -Inf, NaN, 1e3


def expand_values(notation: str) -> list[float | str | None]:
    """The samples of promtool's ``values`` notation, one per interval: a float, None for a
    missing sample (``_``) or STALE for a staleness marker."""
    out: list[float | str | None] = []
    for token in notation.split():
        if token == "_":
            out.append(None)
        elif token == STALE:
            out.append(STALE)
        elif token.startswith("_x"):
            out.extend([None] * int(token[2:]))
        elif m := _EXPANDING.match(token):
            a, b, n = _number(m["a"]), _number(m["b"]), int(m["n"])
            sign = 1 if m["op"] == "+" else -1
            out.extend(a + sign * i * b for i in range(n + 1))
        elif m := _REPEAT.match(token):
            out.extend([_number(m["a"])] * (int(m["n"]) + 1))
        else:
            out.append(_number(token))
    return out


def duration_seconds(text: str | int | float) -> float:
    """Prometheus's durations ("1m30s", "5m", "15s") in seconds."""
    if isinstance(text, int | float):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(n) * _UNITS[u] for n, u in parts)


def parse_selector(text: str) -> dict[str, str]:
    """``name{a="b",…}`` -> {"__name__": name, "a": "b", …}."""
    m = _SELECTOR.match(text)
    if m is None:
        raise ValueError(f"not a series: {text!r}")
    labels = {
        k: bytes(v, "utf-8").decode("unicode_escape") for k, v in _LABEL.findall(m["labels"] or "")
    }
    if m["name"]:
        labels["__name__"] = m["name"]
    return labels


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def exposition_line(labels: Mapping[str, str], value: float, timestamp_ms: int) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items()) if k != "__name__")
    number = "NaN" if math.isnan(value) else repr(float(value))
    return f"{labels['__name__']}{{{inner}}} {number} {timestamp_ms}"


@dataclass(frozen=True)
class ExprCase:
    """One ``promql_expr_test``: ``expr`` at ``eval_time`` s after the test's start returns
    ``expected`` ({labels as sorted "k=v,…" text: value})."""

    file: str
    test: str
    index: int
    expr: str
    eval_time: float
    expected: dict[str, float]

    @property
    def id(self) -> str:
        return f"{self.file}:{self.test}:{self.index}"


@dataclass(frozen=True)
class PromtoolTest:
    """One entry of a promtool file's ``tests``: its inputs and its expression checks."""

    file: str
    name: str
    interval: float
    series: list[tuple[dict[str, str], list[float | str | None]]]
    cases: list[ExprCase]

    @property
    def uses_stale(self) -> bool:
        return any(STALE in values for _labels, values in self.series)

    @property
    def duration(self) -> float:
        """Seconds from the first input sample to the last sample or evaluation."""
        last_sample = max((len(v) - 1 for _l, v in self.series), default=0) * self.interval
        last_eval = max((c.eval_time for c in self.cases), default=0.0)
        return max(last_sample, last_eval)

    def exposition(self, base: float) -> Iterator[str]:
        """The inputs as exposition lines, the first sample at unix time ``base``. Missing and
        stale samples are left out (the import formats carry no staleness marker). A series
        whose value is a unix time (``*_timestamp_seconds``) is moved by ``base`` too: promtool's
        clock starts at 0, so there such a value counts from the test's start."""
        for labels, values in self.series:
            shift = base if labels.get("__name__", "").endswith("_timestamp_seconds") else 0.0
            for i, value in enumerate(values):
                if isinstance(value, float):
                    at_ms = round((base + i * self.interval) * 1000)
                    yield exposition_line(labels, value + shift, at_ms)


def label_key(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "__name__")


def load_file(path: Path) -> tuple[dict[str, Any], list[PromtoolTest]]:
    """A promtool test file's top level (rule_files, evaluation_interval, …) and its tests."""
    doc = yaml.safe_load(path.read_text())
    groups = []
    for test in doc.get("tests", []):
        name = test.get("name", "")
        cases = [
            ExprCase(
                file=path.name,
                test=name,
                index=i,
                expr=case["expr"],
                eval_time=duration_seconds(case["eval_time"]),
                expected={
                    label_key(parse_selector(s.get("labels", "{}"))): float(s["value"])
                    for s in case.get("exp_samples") or []
                },
            )
            for i, case in enumerate(test.get("promql_expr_test") or [])
        ]
        series = [
            (parse_selector(s["series"]), expand_values(str(s["values"])))
            for s in test.get("input_series") or []
        ]
        groups.append(
            PromtoolTest(
                path.name, name, duration_seconds(test.get("interval", "1m")), series, cases
            )
        )
    return doc, groups
