"""Panel building blocks (Grafana's foundation SDK): time series, stats, tables, thresholds, links, layout. No PromQL here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from grafana_foundation_sdk.builders import (
    common,
    prometheus,
    stat,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models import prometheus as pm

from syncscope.monitoring.dashboards.common import DS, GRID_WIDTH
from syncscope.thresholds import Thresholds, required


def q(expr: str, legend: str = "", *, instant: bool = False, table_format: bool = False):
    query = prometheus.Dataquery().expr(expr).datasource(DS)
    if legend:
        query = query.legend_format(legend)
    if instant:
        query = query.instant()
    if table_format:
        query = query.format(pm.PromQueryFormat.TABLE)
    return query


def steps(*levels: tuple[float, str], base: str = "green") -> db.ThresholdsConfig:
    return (
        db.ThresholdsConfig()
        .mode(dm.ThresholdsMode.ABSOLUTE)
        .steps(
            [dm.Threshold(value=None, color=base)]
            + [dm.Threshold(value=v, color=c) for v, c in levels]
        )
    )


def alert_threshold(cfg: Thresholds, alert: str) -> float:
    """The threshold of an alert's first level (the only one of a single-level alert)."""
    return required(cfg.alerts[alert].levels[0].threshold, "threshold")


def alert_steps(cfg: Thresholds, alert: str) -> db.ThresholdsConfig:
    """Orange at the warning threshold, red at the critical one: the alert's own levels."""
    colours = {"warning": "orange", "critical": "red"}
    levels = cfg.alerts[alert].levels
    return steps(*((required(lv.threshold, "threshold"), colours[lv.severity]) for lv in levels))


def value_map(*entries: tuple[float, str, str]) -> list[dm.ValueMapping]:
    """Value -> (text, colour). A state that needs attention (down, failing, fault) is red."""
    return [
        dm.ValueMap(
            options={
                f"{value:g}": dm.ValueMappingResult(text=text, color=colour, index=i)
                for i, (value, text, colour) in enumerate(entries)
            }
        )
    ]


def threshold_lines() -> common.GraphThresholdsStyleConfig:
    return common.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)


def with_targets(panel: Any, targets: Sequence[Any]) -> Any:
    for ref, target in zip("ABCDEFGHIJKLMNOP", targets, strict=False):
        panel = panel.with_target(target.ref_id(ref))
    return panel


def prop(id_val: str, value: Any) -> dm.DynamicConfigValue:
    return dm.DynamicConfigValue(id_val=id_val, value=value)


def band_overrides(panel: Any) -> Any:
    """The job's 10th-90th percentile band filled grey, its median a dashed grey line."""
    grey = {"mode": "fixed", "fixedColor": "#8e8e8e"}
    panel = panel.override_by_name(
        "p90",
        [
            prop("color", grey),
            prop("custom.fillBelowTo", "p10"),
            prop("custom.fillOpacity", 15),
            prop("custom.lineWidth", 0),
        ],
    )
    panel = panel.override_by_name("p10", [prop("color", grey), prop("custom.lineWidth", 0)])
    return panel.override_by_name(
        "median",
        [prop("color", grey), prop("custom.lineStyle", {"fill": "dash", "dash": [10, 10]})],
    )


def ts(
    title: str,
    desc: str,
    targets: Sequence[Any],
    unit: str,
    *,
    thresholds=None,
    stack: bool = False,
    max_val: float | None = None,
    min_val: float | None = 0,
    band: bool = False,
) -> Any:
    panel = timeseries.Panel().title(title).description(desc).datasource(DS).unit(unit)
    if min_val is not None:
        panel = panel.min(min_val)
    panel = panel.legend(
        common.VizLegendOptions()
        .show_legend(True)
        .display_mode(cm.LegendDisplayMode.LIST)
        .placement(cm.LegendPlacement.BOTTOM)
    )
    if max_val is not None:
        panel = panel.max(max_val)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).thresholds_style(threshold_lines())
    if stack:
        panel = panel.stacking(common.StackingConfig().mode(cm.StackingMode.NORMAL)).fill_opacity(
            40
        )
    if band:
        panel = band_overrides(panel)
    return with_targets(panel, targets)


def stat_panel(
    title: str,
    desc: str,
    targets: Sequence[Any],
    unit: str,
    *,
    thresholds=None,
    mappings: list[dm.ValueMapping] | None = None,
    no_value: str | None = None,
) -> Any:
    panel = (
        stat.Panel()
        .title(title)
        .description(desc)
        .datasource(DS)
        .unit(unit)
        .color_mode(cm.BigValueColorMode.BACKGROUND if thresholds else cm.BigValueColorMode.NONE)
        .graph_mode(cm.BigValueGraphMode.AREA)
        .reduce_options(common.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    if thresholds is not None:
        panel = panel.thresholds(thresholds)
    if mappings:
        panel = panel.mappings(mappings)
    if no_value is not None:
        panel = panel.no_value(no_value)
    return with_targets(panel, targets)


def table_panel(
    title: str,
    desc: str,
    targets: Sequence[Any],
    *,
    unit: str = "short",
    thresholds=None,
    mappings: list[dm.ValueMapping] | None = None,
    hide: Iterable[str] = ("Time", "__name__"),
    rename: Mapping[str, str] | None = None,
    sort: tuple[str, bool] | None = None,
    columns: Mapping[str, Sequence[dm.DynamicConfigValue]] | None = None,
) -> Any:
    """A table of instant queries merged on their common labels (Grafana's merge), then sorted
    by ``sort`` (field, descending) and organized: ``hide`` dropped, ``rename`` renamed and
    ordered as listed; ``columns`` are per-column settings by their new name."""
    panel = table.Panel().title(title).description(desc).datasource(DS).unit(unit)
    if thresholds is not None:
        panel = panel.thresholds(thresholds).cell_options(cm.TableColoredBackgroundCellOptions())
    if mappings:
        panel = panel.mappings(mappings)
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
    if sort is not None:
        panel = panel.with_transformation(
            dm.DataTransformerConfig(
                id_val="sortBy",
                options={"fields": {}, "sort": [{"field": sort[0], "desc": sort[1]}]},
            )
        )
    options: dict[str, Any] = {"excludeByName": {name: True for name in hide}}
    if rename:
        options["renameByName"] = dict(rename)
        options["indexByName"] = {name: i for i, name in enumerate(rename)}
    panel = panel.with_transformation(dm.DataTransformerConfig(id_val="organize", options=options))
    for name, properties in (columns or {}).items():
        panel = panel.override_by_name(name, list(properties))
    return with_targets(panel, targets)


def link(title: str, url: str) -> dict[str, Any]:
    return {"title": title, "url": url}


def value_map_json(*entries: tuple[float, str, str]) -> list[dict[str, Any]]:
    """value_map() as plain JSON, for a per-column override."""
    return [
        {
            "type": "value",
            "options": {
                f"{value:g}": {"text": text, "color": colour, "index": i}
                for i, (value, text, colour) in enumerate(entries)
            },
        }
    ]


@dataclass(frozen=True)
class Tile:
    """A panel and the grid cells it takes: ``width`` of the GRID_WIDTH columns, ``height``
    rows. Where it goes is layout()'s to decide."""

    width: int
    height: int
    panel: Any  # a foundation-SDK panel builder (time series, stat, table, ...)


@dataclass(frozen=True)
class Row:
    """A dashboard row: its title and its tiles, in the order layout() places them."""

    title: str
    tiles: Sequence[Tile]


def layout(tiles: Sequence[Tile], y0: int) -> tuple[list[tuple[Any, dm.GridPos]], int]:
    """Place tiles in order, each at the lowest free spot (leftmost on ties): a tall tile
    followed by short ones gets them stacked beside it. Returns each panel with its position,
    and the next y."""
    skyline = [y0] * GRID_WIDTH
    placed = []
    for tile in tiles:
        w, h = tile.width, tile.height
        x = min(range(GRID_WIDTH - w + 1), key=lambda i: (max(skyline[i : i + w]), i))
        y = max(skyline[x : x + w])
        placed.append((tile.panel, dm.GridPos(h=h, w=w, x=x, y=y)))
        skyline[x : x + w] = [y + h] * w
    return placed, max(skyline)
