"""The thresholds file (alert levels, windows, selectors) that rules, dashboards and diagnosis share.

It ships inside the package (``thresholds.json`` beside this module); deployments and tests
change it through dotted-path overrides, never by editing the shipped defaults to suit a noisy
machine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)

THRESHOLDS_FILE = "thresholds.json"
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float:
    """Seconds in a Prometheus duration such as ``1m30s`` or ``500ms``."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a Prometheus duration: {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def _duration(text: str) -> str:
    duration_seconds(text)  # ValueError: not a Prometheus duration
    return text


def _as_written(value: Any, handler: ValidatorFunctionWrapHandler) -> float:
    """A number checked as a float but kept as the file writes it: 120 stays 120, not 120.0,
    so that the rules, dashboards and overrides render it as written."""
    number: float = handler(value)
    return value if type(value) is int else number


Number = Annotated[float, WrapValidator(_as_written)]
Duration = Annotated[str, AfterValidator(_duration)]
Share = Annotated[Number, Field(ge=0.0, le=1.0)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)

    comment: str | None = Field(None, alias="_comment")


class Level(_Model):
    severity: Literal["info", "warning", "critical"]
    threshold: Number | None = None


class Outliers(_Model):
    window: Duration
    quantiles: tuple[Share, Share, Share]
    factor: Annotated[Number, Field(gt=1.0)]


class Alert(_Model):
    for_: Duration = Field(alias="for")
    keep_firing_for: Duration | None = None
    levels: Annotated[list[Level], Field(min_length=1)]
    outliers: Outliers | None = None
    none_scraped_severity: Literal["warning", "critical"] | None = None
    lookback: Duration | None = None
    min_cost_share: Share | None = None  # SyncscopeFabricContention's floor (its _comment)


class Windows(_Model):
    rate: Duration
    straggler: Duration
    transfer: Duration
    contention_baseline: Duration
    trend: Duration  # the trends' day: restarts, step-time CV and throughput per GPU per day


class Intervals(_Model):
    slow_rules: Duration


class Selectors(_Model):
    rank: str
    exporter: str


class Diagnosis(_Model):
    verdict_score: Share
    skew_floor_s: Annotated[Number, Field(ge=0.0)]
    skew_step_fraction: Share
    last_arrival_share: Share
    cause_share: Share
    idle_share_full: Share
    spike_share_full: Share
    clock_ratio: Share
    throughput_ratio: Share
    min_aligned_steps: Annotated[int, Field(ge=1)]


class Thresholds(_Model):
    """The thresholds file, typed: what load_config checks every file and override against."""

    selectors: Selectors
    windows: Windows
    intervals: Intervals
    step_quantiles: Annotated[list[Share], Field(min_length=1)]
    contention_max_skew_ratio: Annotated[Number, Field(ge=0.0)]
    runbook_url_base: str
    dashboard_url_base: str
    diagnosis: Diagnosis
    alerts: dict[str, Alert]


_T = TypeVar("_T")


def required(value: _T | None, key: str) -> _T:
    """``value``, of a key the thresholds file may leave out (None) but this use needs: a
    KeyError naming the key when it is left out."""
    if value is None:
        raise KeyError(key)
    return value


def thresholds_text() -> str:
    """The shipped thresholds file, read from the installed package (wheel or checkout alike)."""
    return resources.files(__package__).joinpath(THRESHOLDS_FILE).read_text(encoding="utf-8")


def load_config(
    overrides: Mapping[str, Any] | None = None, path: Path | str | None = None
) -> Thresholds:
    """The thresholds (the shipped file, or ``path``) with dotted-path overrides applied, as
    the typed model.

    The overrides edit the file's JSON before it is checked: ``a.b.0.c`` indexes lists; an
    unknown key is a KeyError so that a typo cannot pass silently.
    """
    text = Path(path).read_text(encoding="utf-8") if path is not None else thresholds_text()
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"thresholds file {path or THRESHOLDS_FILE}: {exc}") from exc
    for dotted, value in (overrides or {}).items():
        set_path(cfg, dotted, value)
    return validate(cfg, str(path or THRESHOLDS_FILE))


def validate(cfg: Mapping[str, Any], source: str = THRESHOLDS_FILE) -> Thresholds:
    """The thresholds as the typed model; ValueError naming each bad key (and where it came
    from) when a value has the wrong type or range or a key is unknown."""
    try:
        return Thresholds.model_validate(cfg)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        raise ValueError(f"thresholds file {source}: {problems}") from None


def set_path(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    """Set one nested key; an unknown key is an error so that a typo cannot pass silently."""
    *parents, last = dotted.split(".")
    node: Any = cfg
    try:
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if isinstance(node, list):
            node[int(last)] = value
            return
    except (KeyError, IndexError, ValueError, TypeError):
        pass
    else:
        if isinstance(node, dict) and last in node:
            node[last] = value
            return
    raise KeyError(f"{dotted}: no such key in the thresholds file")


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``PATH=JSON`` command-line overrides; a value that is not JSON is taken as a string (2s)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected PATH=VALUE")
        try:
            overrides[key] = json.loads(raw)
        except json.JSONDecodeError:
            overrides[key] = raw
    return overrides


def checked_overrides(
    items: Iterable[str], base: Mapping[str, Any] | None = None
) -> tuple[dict[str, Any], Thresholds]:
    """``base``'s overrides, then the ``--set PATH=VALUE`` ``items``, and the thresholds they
    give: every command that takes --set (``syncscope rules``, the exporter) checks them here
    at start-up, so that a typo fails before anything is written or served rather than leaving
    the rules and the exporter's diagnosis on different lines. KeyError or ValueError naming
    the bad path or value."""
    overrides = {**(base or {}), **parse_overrides(items)}
    return overrides, load_config(overrides)


def fast_for_overrides(cfg: Thresholds, duration: str) -> dict[str, str]:
    """Overrides that shorten every alert's ``for:`` (the demo and e2e tests, 1 s intervals):
    the straggler's becomes ``duration`` and the others keep their shipped ratio to it (none
    shorter than ``duration``). The order in which alerts fire stays the shipped one, so the
    straggler still fires before the alerts it inhibits in Alertmanager (with all of them
    equal, amplification fired first under load and notified on its own)."""
    short = duration_seconds(duration)
    unit = duration_seconds(cfg.alerts["SyncscopeStraggler"].for_)
    return {
        f"alerts.{name}.for": f"{max(short, short * duration_seconds(a.for_) / unit):g}s"
        for name, a in cfg.alerts.items()
    }


def demo_overrides(cfg: Thresholds) -> dict[str, str]:
    """What a 1 s-interval Prometheus beside a one-minute job needs: short for: and windows."""
    rate = "10s"
    return {
        **fast_for_overrides(cfg, "2s"),
        **{
            f"alerts.{name}.keep_firing_for": rate
            for name, a in cfg.alerts.items()
            if a.keep_firing_for is not None
        },
        "windows.rate": rate,
        "windows.straggler": "10s",
        "windows.transfer": "30s",
        "intervals.slow_rules": "1s",
    }
