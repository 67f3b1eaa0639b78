"""Draw panels of the generated Grafana dashboards from a real Prometheus, without Grafana.

No Grafana server can run here, so this module does what Grafana would do with a panel of the
checked-in dashboard JSON: it fills in the variables, runs every target against Prometheus
(instant queries for tables, ``query_range`` for time series and stats), turns the results into
data frames the way Grafana's Prometheus data source does (a table-format result is one frame
per query: ``Time``, the labels sorted, ``Value #<refId>``), applies the panel's
transformations (``merge``, ``sortBy``, ``organize``: ports of Grafana's own, see the
functions), resolves field config (defaults, then overrides by display name: unit, decimals,
mappings, thresholds, links, colours) and formats values with Grafana's units (``s``,
``percentunit``, ``dtdurations``, ``suffix:``). It then draws the panels as HTML (tables, stats
and inline-SVG time series at their grid positions) and screenshots them with headless
chromium (the Debian binary, driven by the playwright package as tests/e2e/test_status_page.py
does).

    python -m syncscope.lab.render --prometheus http://127.0.0.1:9090 --job demo --out docs/

writes ``triage-row.png`` (the job overview's first row: the late-ranks table and its stats)
and ``step-time-panel.png`` (the "Step time" time series). tests/e2e/test_dashboard_render.py
runs it on a real 4-rank job with a slowed rank (docs/dashboards.md).

What it does not do: Grafana's own auto decimals, tooltips and interactions; it reads the
``Time`` of instant queries as Prometheus returns it (seconds, shown in ms as Grafana does).
"""

from __future__ import annotations

import argparse
import html
import json
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from syncscope.monitoring import dashboards as D
from syncscope.prometheus_api import PrometheusAPI

DASHBOARD_DIR = Path(__file__).resolve().parents[2] / "dashboards"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Grafana's grid: 24 columns, 30 px rows, 8 px between panels.
GRID_ROW_PX, GRID_MARGIN_PX, GRID_WIDTH_PX = 30, 8, 1600
COLOURS = {
    "green": "#73BF69",
    "orange": "#FF9830",
    "red": "#F2495C",
    "blue": "#5794F2",
    "purple": "#B877D9",
    "yellow": "#FADE2A",
    "text": "#ccccdc",
    "transparent": "transparent",
}
# Grafana's palette-classic, the default series colours.
PALETTE = [
    "#7EB26D",
    "#EAB839",
    "#6ED0E0",
    "#EF843C",
    "#E24D42",
    "#1F78C1",
    "#BA43A9",
    "#705DA0",
    "#508642",
    "#CCA300",
    "#447EBC",
    "#C15C17",
]
TRIAGE_FILE = "triage-row.png"
STEP_TIME_FILE = "step-time-panel.png"


def colour(name: str | None) -> str:
    if not name:
        return COLOURS["text"]
    return COLOURS.get(name, name)


# ------------------------------------------------------------------------------ data frames


@dataclass
class Field:
    name: str
    values: list[Any]
    numeric: bool = False
    config: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def display_name(self) -> str:
        return str(self.config.get("displayName") or self.name)


@dataclass
class Frame:
    fields: list[Field]
    ref_id: str = ""

    @property
    def length(self) -> int:
        return len(self.fields[0].values) if self.fields else 0


def parse_value(text: str) -> float:
    return float(text)  # Prometheus writes NaN, +Inf, -Inf as float() reads them


def table_frames(results: list[tuple[str, list[dict[str, Any]]]]) -> list[Frame]:
    """Instant results of table-format targets as Grafana's Prometheus data source makes them
    (result_transformer.ts, transformDFToTable): per query Time (ms), its labels sorted, and
    "Value #<refId>" ("Value" when the panel has one such query)."""
    frames = []
    for ref_id, vector in results:
        value_name = f"Value #{ref_id}" if len(results) > 1 else "Value"
        label_names = sorted({k for s in vector for k in s["metric"]})
        fields = [Field("Time", [float(s["value"][0]) * 1000 for s in vector], numeric=True)]
        fields += [Field(n, [s["metric"].get(n, "") for s in vector]) for n in label_names]
        fields.append(Field(value_name, [parse_value(s["value"][1]) for s in vector], True))
        frames.append(Frame(fields, ref_id))
    return frames


def merge(frames: list[Frame]) -> list[Frame]:
    """Grafana's merge transformation (transformers/merge.ts): rows of all frames keyed by the
    fields every frame has, a row merged into each earlier one it does not contradict."""
    if len(frames) <= 1:
        return frames
    data = [f for f in frames if f.fields]
    if not data:
        return frames[:1]
    names: list[str] = []
    prototypes: dict[str, Field] = {}
    index_by_name: dict[str, dict[int, int]] = {}
    for i, frame in enumerate(data):
        for j, f in enumerate(frame.fields):
            if f.name not in prototypes:
                prototypes[f.name] = f
                names.append(f.name)
            index_by_name.setdefault(f.name, {})[i] = j
    key_names = [n for n in names if len(index_by_name[n]) == len(data)]
    if not key_names:
        return frames
    rows: dict[str, list[dict[str, Any]]] = {}
    order: list[tuple[str, int]] = []
    for i, frame in enumerate(data):
        for v in range(frame.length):
            key = "".join(str(frame.fields[index_by_name[n][i]].values[v]) for n in key_names)
            value = {
                n: frame.fields[index_by_name[n][i]].values[v]
                for n in names
                if i in index_by_name[n]
            }
            if key not in rows:
                rows[key] = [value]
                order.append((key, 0))
                continue
            merged = False
            for k, existing in enumerate(rows[key]):
                if all(
                    existing.get(p) is None or existing[p] == value[p]
                    for p in value
                    if p in existing
                ):
                    rows[key][k] = {**existing, **value}
                    merged = True
            if not merged:
                rows[key].append(value)
                order.append((key, len(rows[key]) - 1))
    out = [rows[key][k] for key, k in order]
    fields = [
        Field(n, [row.get(n) for row in out], prototypes[n].numeric, dict(prototypes[n].config))
        for n in names
    ]
    return [Frame(fields)]


def _sort_key(value: Any) -> tuple[int, Any]:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (0, 0)
    return (1, value)


def sort_by(frames: list[Frame], options: dict[str, Any]) -> list[Frame]:
    """Grafana's sortBy: the first sort entry, matched by display name."""
    sort = (options.get("sort") or [{}])[0]
    out = []
    for frame in frames:
        idx = next(
            (i for i, f in enumerate(frame.fields) if f.display_name == sort.get("field")), None
        )
        if idx is None:
            out.append(frame)
            continue
        column = frame.fields[idx].values
        order = sorted(
            range(frame.length),
            key=lambda r: _sort_key(column[r]),
            reverse=bool(sort.get("desc")),
        )
        fields = [
            Field(f.name, [f.values[r] for r in order], f.numeric, f.config, f.labels)
            for f in frame.fields
        ]
        out.append(Frame(fields, frame.ref_id))
    return out


def organize(frames: list[Frame], options: dict[str, Any]) -> list[Frame]:
    """Grafana's organize: drop excludeByName, order by indexByName (the rest after, in
    their order), rename by renameByName (sets the display name); all by display name."""
    exclude = options.get("excludeByName") or {}
    index = options.get("indexByName") or {}
    rename = options.get("renameByName") or {}
    out = []
    for frame in frames:
        kept = [f for f in frame.fields if not exclude.get(f.display_name)]
        kept.sort(key=lambda f: index.get(f.display_name, sys.maxsize))
        renamed = []
        for f in kept:
            config = dict(f.config)
            if rename.get(f.display_name):
                config["displayName"] = rename[f.display_name]
            renamed.append(Field(f.name, f.values, f.numeric, config, f.labels))
        out.append(Frame(renamed, frame.ref_id))
    return out


TRANSFORMS = {"merge": lambda fr, _o: merge(fr), "sortBy": sort_by, "organize": organize}


def transform(frames: list[Frame], panel: dict[str, Any]) -> list[Frame]:
    for t in panel.get("transformations", []):
        if t.get("disabled"):
            continue
        if t["id"] not in TRANSFORMS:
            raise NotImplementedError(f"transformation {t['id']} is not emulated")
        frames = TRANSFORMS[t["id"]](frames, t.get("options") or {})
    return frames


def field_config(panel: dict[str, Any], display_name: str) -> dict[str, Any]:
    """The panel's defaults with every byName override for this field applied, flattened
    ("custom.cellOptions" -> config["custom"]["cellOptions"])."""
    fc = panel.get("fieldConfig", {})
    config = json.loads(json.dumps(fc.get("defaults", {})))
    for o in fc.get("overrides", []):
        if o["matcher"]["id"] == "byName" and o["matcher"].get("options") == display_name:
            for p in o["properties"]:
                target = config
                *path, last = p["id"].split(".")
                for part in path:
                    target = target.setdefault(part, {})
                target[last] = p.get("value")
    return config


# ------------------------------------------------------------------------------ units


def _fixed(value: float, decimals: int | None) -> str:
    if decimals is None:
        size = abs(value)
        if size == 0 or size >= 100 or value == round(value):
            decimals = 0
        elif size >= 10:
            decimals = 1
        elif size >= 1:
            decimals = 2
        else:
            decimals = min(6, 2 - math.floor(math.log10(size)))
    text = f"{value:.{decimals}f}"
    return text


def _duration(seconds: float) -> str:
    """Grafana's dtdurations: the two largest units, e.g. "5 minutes, 12 seconds"."""
    units = (("year", 31536000), ("day", 86400), ("hour", 3600), ("minute", 60), ("second", 1))
    left, parts = int(round(abs(seconds))), []
    for name, size in units:
        n, left = divmod(left, size)
        if n:
            parts.append(f"{n} {name}{'s' if n != 1 else ''}")
    return ", ".join(parts[:2]) or "0 seconds"


def format_value(value: Any, unit: str | None, decimals: int | None = None) -> str:
    if value is None or value == "":
        return ""
    if isinstance(value, str):
        return value
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "∞" if v > 0 else "-∞"
    unit = unit or "short"
    if unit == "percentunit":
        return _fixed(v * 100, decimals) + "%"
    if unit == "percent":
        return _fixed(v, decimals) + "%"
    if unit == "s":
        if v == 0:
            return "0 s"  # Grafana's toSeconds: zero in seconds, not "0 ns"
        size = abs(v)
        for limit, scale, name in (
            (1e-6, 1e9, "ns"),
            (1e-3, 1e6, "µs"),
            (1, 1e3, "ms"),
            (60, 1, "s"),
            (3600, 1 / 60, "min"),
            (86400, 1 / 3600, "hour"),
        ):
            if size < limit or name == "hour":
                return f"{_fixed(v * scale, decimals)} {name}"
    if unit == "dtdurations":
        return _duration(v)
    if unit.startswith("suffix:"):
        return _fixed(v, decimals) + unit[len("suffix:") :]
    scaled = {"Bps": "B/s", "hertz": "Hz", "watt": "W"}
    if unit in scaled:
        for prefix, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3), ("", 1)):
            if abs(v) >= scale or prefix == "":
                return f"{_fixed(v / scale, decimals)} {prefix}{scaled[unit]}"
    if unit == "celsius":
        return _fixed(v, decimals) + "°C"
    return _fixed(v, decimals)


def mapped(value: Any, config: dict[str, Any]) -> tuple[str | None, str | None]:
    """(text, colour) of the first value mapping that matches ``value``, if any."""
    for m in config.get("mappings") or []:
        if m.get("type") != "value":
            continue
        key = value if isinstance(value, str) else f"{float(value):g}"
        hit = m.get("options", {}).get(key)
        if hit is not None:
            return hit.get("text"), hit.get("color")
    return None, None


def threshold_colour(value: Any, config: dict[str, Any]) -> str | None:
    steps = (config.get("thresholds") or {}).get("steps") or []
    if not steps or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    found = steps[0].get("color")
    for s in steps[1:]:
        if s.get("value") is not None and value >= s["value"]:
            found = s["color"]
    return str(found) if found else None


# ------------------------------------------------------------------------------ queries


@dataclass
class Context:
    """What Grafana would hold: the variables' values and the time range."""

    prom: PrometheusAPI
    values: dict[str, str]
    start: float
    end: float
    step: float

    @classmethod
    def for_job(
        cls,
        prom_url: str,
        job: str,
        *,
        start: float,
        end: float,
        step: float = 1.0,
        rate_interval: str = "1m",
        rank: str | None = None,
        node: str | None = None,
    ) -> Context:
        values = D.variable_values(
            job=D.exact_value(job),
            node=D.NODE_ALL if node is None else D.exact_value(node),
            rank=D.RANK_ALL if rank is None else D.exact_value(rank),
            rate_interval=rate_interval,
            range_=f"{max(1, int(end - start))}s",
        )
        return cls(PrometheusAPI(prom_url), values, start, end, step)

    def promql(self, expr: str) -> str:
        return D.substitute(expr, self.values)


def panel_table(panel: dict[str, Any], ctx: Context) -> Frame | None:
    """A table panel's one frame after its transformations, display names set."""
    results = [
        (t["refId"], ctx.prom.instant(ctx.promql(t["expr"]), ctx.end)) for t in panel["targets"]
    ]
    frames = transform(table_frames(results), panel)
    return frames[0] if frames else None


def legend_name(fmt: str | None, metric: dict[str, str]) -> str:
    if fmt:
        return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: metric.get(m.group(1), ""), fmt)
    name = metric.get("__name__", "")
    labels = ", ".join(f'{k}="{v}"' for k, v in sorted(metric.items()) if k != "__name__")
    return f"{name}{{{labels}}}"


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    ref_id: str


def panel_series(panel: dict[str, Any], ctx: Context) -> list[Series]:
    out = []
    for t in panel["targets"]:
        for s in ctx.prom.range(ctx.promql(t["expr"]), ctx.start, ctx.end, ctx.step):
            points = [(float(ts), parse_value(v)) for ts, v in s["values"]]
            out.append(Series(legend_name(t.get("legendFormat"), s["metric"]), points, t["refId"]))
    return out


def series_count(
    prom: PrometheusAPI, query: Mapping[str, Any], start: float, end: float, step: float
) -> int:
    """How many series one panel query (a D.panel_queries item) draws as Grafana runs it: an
    instant query (a table) at ``end``, its result; a range query from ``start`` to ``end``
    every ``step`` seconds, the distinct series over the range."""
    if query["instant"]:
        result = prom.instant(query["promql"], end)
    else:
        result = prom.range(query["promql"], start, end, step)
    return len({json.dumps(s["metric"], sort_keys=True) for s in result})


def count_series(
    prom: PrometheusAPI,
    queries: Iterable[Mapping[str, Any]],
    *,
    start: float,
    end: float,
    step: float,
) -> list[dict[str, Any]]:
    """Every query of ``queries`` with ``series`` (series_count) and ``error`` (None, or why
    Prometheus did not answer): what the scale checks hold against D.MAX_SERIES."""
    out = []
    for query in queries:
        counted: dict[str, Any] = {**query, "series": None, "error": None}
        try:
            counted["series"] = series_count(prom, query, start, end, step)
        except (OSError, RuntimeError, ValueError) as exc:  # HTTP errors and timeouts included
            counted["error"] = f"{type(exc).__name__}: {exc}"
        out.append(counted)
    return out


@dataclass
class Event:
    name: str
    colour: str
    start: float
    end: float
    title: str


def annotation_events(dashboard: dict[str, Any], ctx: Context) -> list[Event]:
    """Grafana's Prometheus annotations (annotations.ts processEvents): each series' samples
    above zero, runs no more than ``step`` apart joined into one region."""
    events = []
    for a in dashboard.get("annotations", {}).get("list", []):
        if not a.get("enable") or "expr" not in a:
            continue
        step = float(re.sub(r"s$", "", a.get("step") or "60s"))
        for s in ctx.prom.range(ctx.promql(a["expr"]), ctx.start, ctx.end, step):
            active = [float(ts) for ts, v in s["values"] if parse_value(v) > 0]
            title = legend_name(a.get("titleFormat"), s["metric"]) or a["name"]
            begin = last = None
            for t in active:
                if last is not None and last + step >= t:
                    last = t
                    continue
                if begin is not None and last is not None:
                    events.append(Event(a["name"], colour(a.get("iconColor")), begin, last, title))
                begin = last = t
            if begin is not None and last is not None:
                events.append(Event(a["name"], colour(a.get("iconColor")), begin, last, title))
    return events


# ------------------------------------------------------------------------------ drawing

CSS = """
body { margin: 0; background: #111217; font-family: Inter, 'DejaVu Sans', Arial, sans-serif;
       color: #ccccdc; font-size: 13px; }
.grid { position: relative; }
.panel { position: absolute; box-sizing: border-box; background: #181b1f;
         border: 1px solid #2c3235; border-radius: 2px; overflow: hidden; }
.title { height: 32px; line-height: 32px; padding: 0 8px; font-weight: 500; font-size: 14px;
         color: #ccccdc; white-space: nowrap; overflow: hidden; text-overflow: ellipsis; }
.row { position: absolute; font-size: 15px; font-weight: 500; color: #ccccdc; }
table { border-collapse: collapse; width: 100%; font-size: 12.5px; }
th { text-align: left; color: #6e9fff; font-weight: 500; padding: 6px 8px;
     border-bottom: 1px solid #2c3235; white-space: nowrap; }
td { padding: 5px 8px; border-bottom: 1px solid #22252b; white-space: nowrap; }
td.num { text-align: right; }
td.link { text-decoration: underline; text-decoration-color: #6e9fff; }
.stat { display: flex; height: calc(100% - 32px); }
.stat > div { flex: 1; position: relative; display: flex; flex-direction: column;
              justify-content: center; align-items: center; }
.stat .value { font-size: 30px; font-weight: 500; z-index: 1; }
.stat .name { font-size: 12px; z-index: 1; }
.stat svg { position: absolute; left: 0; bottom: 0; }
.legend { padding: 2px 8px; font-size: 12px; }
.legend span { margin-right: 14px; white-space: nowrap; display: inline-block; }
.legend i { display: inline-block; width: 14px; height: 4px; margin-right: 5px;
            vertical-align: middle; border-radius: 2px; }
"""


def _esc(text: Any) -> str:
    return html.escape(str(text))


def draw_table(panel: dict[str, Any], frame: Frame | None) -> str:
    if frame is None or frame.length == 0:
        return '<div class="legend">No data</div>'
    configs = [field_config(panel, f.display_name) for f in frame.fields]
    head = "".join(f"<th>{_esc(f.display_name)}</th>" for f in frame.fields)
    body = []
    for r in range(frame.length):
        cells = []
        for f, config in zip(frame.fields, configs, strict=True):
            value = f.values[r]
            text, col = mapped(value, config) if value not in (None, "") else (None, None)
            if text is None:
                text = format_value(value, config.get("unit"), config.get("decimals"))
            col = col or threshold_colour(value, config)
            cell_type = (config.get("custom", {}).get("cellOptions") or {}).get("type")
            style, classes = "", []
            if f.numeric:
                classes.append("num")
            if config.get("links") and text:
                classes.append("link")
            if col and cell_type == "color-background" and value not in (None, ""):
                style = f"background:{colour(col)};color:#111217"
            elif col and cell_type == "color-text":
                style = f"color:{colour(col)}"
            cls = f' class="{" ".join(classes)}"' if classes else ""
            st = f' style="{style}"' if style else ""
            cells.append(f"<td{cls}{st}>{_esc(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    mag = 10 ** math.floor(math.log10(raw))
    step = min((m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw), default=10 * mag)
    first = math.ceil(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def draw_series(
    panel: dict[str, Any],
    series: list[Series],
    events: list[Event],
    ctx: Context,
    width: int,
    height: int,
) -> str:
    """A time-series panel as inline SVG: lines (stacked when the panel stacks), fills
    between series (fillBelowTo), dashed threshold lines, annotation regions, a legend."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    custom = defaults.get("custom", {})
    unit = defaults.get("unit")
    stacked = (custom.get("stacking") or {}).get("mode") == "normal"
    legend_h = 22 * max(1, math.ceil(len(series) / 6))
    left, right, top, bottom = 70, 16, 8, 24
    w, h = width - left - right, height - top - bottom - legend_h - 32
    styled = []
    totals: dict[float, float] = {}
    for i, s in enumerate(series):
        config = field_config(panel, s.name)
        col = config.get("color", {})
        stroke = colour(col.get("fixedColor")) if col.get("mode") == "fixed" else None
        points = s.points
        if stacked:
            points = [(t, v + totals.get(t, 0.0)) for t, v in points]
            for t, v in points:
                totals[t] = v
        styled.append((s, points, stroke or PALETTE[i % len(PALETTE)], config))
    values = [v for _s, pts, _c, _cfg in styled for _t, v in pts if math.isfinite(v)]
    lo = defaults.get("min")
    lo = min(values, default=0.0) if lo is None else lo
    hi = defaults.get("max")
    hi = max(values, default=1.0) if hi is None else hi
    steps = (defaults.get("thresholds") or {}).get("steps") or []
    dashed = (custom.get("thresholdsStyle") or {}).get("mode") == "dashed"
    if dashed:
        hi = max([hi] + [s["value"] for s in steps[1:] if s.get("value") is not None])
    ticks = _nice_ticks(lo, hi)
    hi = max(hi, ticks[-1])

    def x(t: float) -> float:
        return left + (t - ctx.start) / max(ctx.end - ctx.start, 1e-9) * w

    def y(v: float) -> float:
        return top + h - (v - lo) / max(hi - lo, 1e-12) * h

    parts = [f'<svg width="{width}" height="{height - legend_h - 32}">']
    for v in ticks:
        parts.append(
            f'<line x1="{left}" x2="{left + w}" y1="{y(v):.1f}" y2="{y(v):.1f}" '
            'stroke="#2c3235"/>'
            f'<text x="{left - 6}" y="{y(v) + 4:.1f}" fill="#8e8e8e" font-size="11" '
            f'text-anchor="end">{_esc(format_value(v, unit))}</text>'
        )
    for t in _nice_ticks(ctx.start, ctx.end, 6):
        label = time.strftime("%H:%M:%S", time.gmtime(t))
        parts.append(
            f'<text x="{x(t):.1f}" y="{top + h + 16}" fill="#8e8e8e" font-size="11" '
            f'text-anchor="middle">{label}</text>'
        )
    for i, e in enumerate(events):
        x0, x1 = x(max(e.start, ctx.start)), x(min(e.end, ctx.end))
        parts.append(
            f'<rect x="{x0:.1f}" y="{top}" width="{max(x1 - x0, 1.5):.1f}" height="{h}" '
            f'fill="{e.colour}" fill-opacity="0.12"/>'
            f'<line x1="{x0:.1f}" x2="{x0:.1f}" y1="{top}" y2="{top + h}" stroke="{e.colour}" '
            'stroke-dasharray="3 3"/>'
            f'<text x="{x0 + 3:.1f}" y="{top + 11 + 12 * (i % 4)}" fill="{e.colour}" '
            'font-size="10">'
            f"{_esc(e.title)}</text>"
        )
    if dashed:
        for s in steps[1:]:
            if s.get("value") is not None:
                parts.append(
                    f'<line x1="{left}" x2="{left + w}" y1="{y(s["value"]):.1f}" '
                    f'y2="{y(s["value"]):.1f}" stroke="{colour(s["color"])}" '
                    'stroke-dasharray="10 10"/>'
                )
    by_name = {s.name: pts for s, pts, _c, _cfg in styled}
    for s, pts, stroke, config in styled:
        finite = [(t, v) for t, v in pts if math.isfinite(v)]
        if not finite:
            continue
        c = config.get("custom", {})
        below = c.get("fillBelowTo")
        if below in by_name:
            other = [(t, v) for t, v in by_name[below] if math.isfinite(v)]
            poly = [f"{x(t):.1f},{y(v):.1f}" for t, v in finite]
            poly += [f"{x(t):.1f},{y(v):.1f}" for t, v in reversed(other)]
            opacity = c.get("fillOpacity", 20) / 100
            parts.append(
                f'<polygon points="{" ".join(poly)}" fill="{stroke}" fill-opacity="{opacity}"/>'
            )
        elif stacked:
            base = [(t, y(v - dict(s.points).get(t, 0.0))) for t, v in finite]
            poly = [f"{x(t):.1f},{y(v):.1f}" for t, v in finite]
            poly += [f"{x(t):.1f},{yy:.1f}" for t, yy in reversed(base)]
            parts.append(f'<polygon points="{" ".join(poly)}" fill="{stroke}" fill-opacity="0.4"/>')
        line_w = c.get("lineWidth", 1.5)
        if line_w == 0:
            continue
        dash = c.get("lineStyle", {}).get("dash")
        dash_attr = f' stroke-dasharray="{" ".join(map(str, dash))}"' if dash else ""
        path = " ".join(
            f"{'M' if i == 0 else 'L'}{x(t):.1f},{y(v):.1f}" for i, (t, v) in enumerate(finite)
        )
        parts.append(
            f'<path d="{path}" fill="none" stroke="{stroke}" stroke-width="{line_w}"{dash_attr}/>'
        )
    parts.append("</svg>")
    legend = "".join(
        f'<span><i style="background:{stroke}"></i>{_esc(s.name)}</span>'
        for s, _p, stroke, _c in styled
    )
    return "".join(parts) + f'<div class="legend">{legend}</div>'


def draw_stat(panel: dict[str, Any], series: list[Series], width: int, height: int) -> str:
    """A stat panel: each series' last non-null value, coloured by thresholds or mappings
    (background mode), with its sparkline."""
    defaults = panel.get("fieldConfig", {}).get("defaults", {})
    background = panel.get("options", {}).get("colorMode") == "background"
    if not series:
        no_value = defaults.get("noValue", "No data")
        return f'<div class="stat"><div><div class="value">{_esc(no_value)}</div></div></div>'
    cells = []
    cell_w = width // len(series)
    for s in series:
        config = field_config(panel, s.name)
        finite = [(t, v) for t, v in s.points if math.isfinite(v)]
        last = finite[-1][1] if finite else None
        text, col = mapped(last, config) if last is not None else (None, None)
        text = text or format_value(last, config.get("unit"), config.get("decimals"))
        col = col or threshold_colour(last, config)
        style = f"background:{colour(col)};color:#111217" if background and col else ""
        spark = ""
        if len(finite) > 1:
            lo, hi = min(v for _t, v in finite), max(v for _t, v in finite)
            t0, t1 = finite[0][0], finite[-1][0]
            sh = (height - 32) * 0.4
            pts = " ".join(
                f"{(t - t0) / max(t1 - t0, 1e-9) * cell_w:.1f},"
                f"{sh - (v - lo) / max(hi - lo, 1e-12) * (sh - 2):.1f}"
                for t, v in finite
            )
            stroke = "#111217" if style else PALETTE[0]
            spark = (
                f'<svg width="{cell_w}" height="{sh:.0f}"><polyline points="{pts}" fill="none" '
                f'stroke="{stroke}" stroke-opacity="0.5" stroke-width="1.5"/></svg>'
            )
        name = f'<div class="name">{_esc(s.name)}</div>' if len(series) > 1 else ""
        cells.append(
            f'<div style="{style}">{name}<div class="value">{_esc(text)}</div>{spark}</div>'
        )
    return f'<div class="stat">{"".join(cells)}</div>'


def _panel_box(panel: dict[str, Any], y0: int, content: str) -> str:
    g = panel["gridPos"]
    col = GRID_WIDTH_PX / 24
    left, top = g["x"] * col, (g["y"] - y0) * (GRID_ROW_PX + GRID_MARGIN_PX)
    width = g["w"] * col - GRID_MARGIN_PX
    height = g["h"] * (GRID_ROW_PX + GRID_MARGIN_PX) - GRID_MARGIN_PX
    return (
        f'<div class="panel" style="left:{left:.0f}px;top:{top:.0f}px;width:{width:.0f}px;'
        f'height:{height:.0f}px"><div class="title">{_esc(panel["title"])}</div>{content}</div>'
    )


def panel_size(panel: dict[str, Any]) -> tuple[int, int]:
    g = panel["gridPos"]
    width = int(g["w"] * GRID_WIDTH_PX / 24 - GRID_MARGIN_PX)
    height = int(g["h"] * (GRID_ROW_PX + GRID_MARGIN_PX) - GRID_MARGIN_PX)
    return width, height


def draw_panel(
    dashboard: dict[str, Any], panel: dict[str, Any], ctx: Context
) -> tuple[str, dict[str, Any]]:
    """(HTML of the panel's content, what it showed: the table's rows or the series' names)."""
    width, height = panel_size(panel)
    if panel["type"] == "table":
        frame = panel_table(panel, ctx)
        rows = []
        if frame is not None:
            rows = [
                {f.display_name: f.values[r] for f in frame.fields} for r in range(frame.length)
            ]
        return draw_table(panel, frame), {"rows": rows}
    series = panel_series(panel, ctx)
    shown = {"series": [s.name for s in series]}
    if panel["type"] == "stat":
        return draw_stat(panel, series, width, height), shown
    if panel["type"] == "timeseries":
        events = annotation_events(dashboard, ctx)
        shown["annotations"] = [e.title for e in events]
        return draw_series(panel, series, events, ctx, width, height), shown
    raise NotImplementedError(f"panel type {panel['type']} is not drawn")


def page(body: str, width: int, height: int) -> str:
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><style>{CSS}</style></head>"
        f'<body><div class="grid" id="grid" style="width:{width}px;height:{height}px">'
        f"{body}</div></body></html>"
    )


def row_panels(dashboard: dict[str, Any], row_title_prefix: str) -> list[dict[str, Any]]:
    """The panels of the first row whose title starts with ``row_title_prefix``."""
    out: list[dict[str, Any]] = []
    inside = False
    for p in dashboard["panels"]:
        if p["type"] == "row":
            if inside:
                break
            inside = p["title"].startswith(row_title_prefix)
        elif inside:
            out.append(p)
    return out


def render_html(
    dashboard: dict[str, Any], panels: list[dict[str, Any]], ctx: Context
) -> tuple[str, dict[str, Any]]:
    """The panels at their grid positions (relative to the first), and what each showed."""
    y0 = min(p["gridPos"]["y"] for p in panels)
    bottom = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    boxes, shown = [], {}
    for p in panels:
        content, seen = draw_panel(dashboard, p, ctx)
        boxes.append(_panel_box(p, y0, content))
        shown[p["title"]] = seen
    height = (bottom - y0) * (GRID_ROW_PX + GRID_MARGIN_PX)
    right = max(p["gridPos"]["x"] + p["gridPos"]["w"] for p in panels)
    return page("".join(boxes), int(right * GRID_WIDTH_PX / 24), height), shown


def can_screenshot() -> bool:
    """What `screenshot` needs: the playwright package and Debian's chromium."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return os.path.exists(CHROMIUM)


def screenshot(html_text: str, out: Path) -> None:
    """Headless chromium (Debian's binary through playwright) draws the page into ``out``."""
    from playwright.sync_api import sync_playwright

    out.parent.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            tab = browser.new_page(viewport={"width": GRID_WIDTH_PX, "height": 600})
            tab.set_content(html_text)
            tab.locator("#grid").screenshot(path=str(out))
        finally:
            browser.close()


def load_dashboard(uid: str, directory: Path = DASHBOARD_DIR) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((directory / f"{uid}.json").read_text())
    return data


def render_docs(
    ctx: Context, out_dir: Path, directory: Path = DASHBOARD_DIR, *, keep_html: bool = False
) -> dict[str, Any]:
    """Render the job overview's triage row and its "Step time" panel into ``out_dir`` (and
    the HTML drawn, with ``keep_html``); returns {file name: {panel: what it showed}}."""
    overview = load_dashboard(D.OVERVIEW_UID, directory)
    triage = row_panels(overview, "Triage")
    step_time = [p for p in overview["panels"] if p["title"] == "Step time"]
    shown = {}
    for name, panels in ((TRIAGE_FILE, triage), (STEP_TIME_FILE, step_time)):
        text, seen = render_html(overview, panels, ctx)
        if keep_html:
            (out_dir / (name[: -len(".png")] + ".html")).write_text(text)
        screenshot(text, out_dir / name)
        shown[name] = seen
    return shown


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prometheus", required=True, help="Prometheus base URL")
    p.add_argument("--job", required=True, help="the training job (the $job variable)")
    p.add_argument("--out", type=Path, required=True, help="folder for the PNGs")
    p.add_argument("--minutes", type=float, default=5.0, help="time range (default 5)")
    p.add_argument("--step", type=float, default=1.0, help="range-query step, seconds")
    p.add_argument("--rate-interval", default="1m", help="stands in for $__rate_interval")
    p.add_argument("--dashboards", type=Path, default=DASHBOARD_DIR)
    args = p.parse_args(argv)
    end = time.time()
    ctx = Context.for_job(
        args.prometheus,
        args.job,
        start=end - args.minutes * 60,
        end=end,
        step=args.step,
        rate_interval=args.rate_interval,
    )
    shown = render_docs(ctx, args.out, args.dashboards)
    print(json.dumps(shown, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
