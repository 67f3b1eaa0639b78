import type { Options as StatOptions } from '@grafana/schema/dist/esm/raw/composable/stat/panelcfg/x/StatPanelCfg_types.gen';
import type { Options as TimeSeriesOptions, FieldConfig as TimeSeriesFieldConfig } from '@grafana/schema/dist/esm/raw/composable/timeseries/panelcfg/x/TimeSeriesPanelCfg_types.gen';
import type { Options as TableOptions, FieldConfig as TableFieldConfig } from '@grafana/schema/dist/esm/raw/composable/table/panelcfg/x/TablePanelCfg_types.gen';
import type { Options as HeatmapOptions, FieldConfig as HeatmapFieldConfig } from '@grafana/schema/dist/esm/raw/composable/heatmap/panelcfg/x/HeatmapPanelCfg_types.gen';
import type { Options as BarGaugeOptions } from '@grafana/schema/dist/esm/raw/composable/bargauge/panelcfg/x/BarGaugePanelCfg_types.gen';
import type { Options as StateTimelineOptions, FieldConfig as StateTimelineFieldConfig } from '@grafana/schema/dist/esm/raw/composable/statetimeline/panelcfg/x/StateTimelinePanelCfg_types.gen';

export interface PanelPlugins {
  stat: { options: Partial<StatOptions> };
  timeseries: { options: Partial<TimeSeriesOptions>; custom: Partial<TimeSeriesFieldConfig> };
  table: { options: Partial<TableOptions>; custom: Partial<TableFieldConfig> };
  heatmap: { options: Partial<HeatmapOptions>; custom: Partial<HeatmapFieldConfig> };
  bargauge: { options: Partial<BarGaugeOptions> };
  'state-timeline': { options: Partial<StateTimelineOptions>; custom: Partial<StateTimelineFieldConfig> };
}
