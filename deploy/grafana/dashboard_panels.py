"""The building blocks of the gemps dashboards: the datasource every query names, panels of each
kind laid out alike, PromQL helpers, and a dashboard's common frame (deploy/grafana/generate.py).

Every panel queries the datasource that provisioning/datasources/prometheus.yml provisions, by
its fixed uid, so Grafana needs no import step and no `${DS_...}` placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap as heatmap_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.models import common, heatmap
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

DATASOURCE_UID = "gemps-prometheus"  # provisioning/datasources/prometheus.yml
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
TAGS = ["gemps"]
RATE = "$__rate_interval"
# Legend text naming a server series' partition of θ (empty for a single server: no such label).
PARTITION = "{{partition}}"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    heatmap: bool = False


def _target(query: Query, ref_id: str) -> prometheus_builders.Dataquery:
    target = (
        prometheus_builders.Dataquery()
        .expr(query.expr)
        .ref_id(ref_id)
        .datasource(DATASOURCE)
        .editor_mode(prometheus_models.QueryEditorMode.CODE)
        .range()
    )
    if query.legend:
        target = target.legend_format(query.legend)
    if query.heatmap:
        target = target.format(prometheus_models.PromQueryFormat.HEATMAP)
    return target


class _TakesTargets(Protocol):
    def with_target(self, target: Any) -> Any: ...


def _with_targets(panel: _TakesTargets, queries: Sequence[Query]) -> None:
    for index, query in enumerate(queries):
        panel.with_target(_target(query, chr(ord("A") + index)))


def timeseries(
    title: str,
    description: str,
    queries: Sequence[Query],
    unit: str = "short",
    width: int = 12,
    minimum: float | None = None,
    maximum: float | None = None,
) -> timeseries_builders.Panel:
    panel = (
        timeseries_builders.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .line_width(1)
        .fill_opacity(10)
        .show_points(common.VisibilityMode.NEVER)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.NONE))
    )
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    _with_targets(panel, queries)
    return panel


def heatmap_panel(title: str, description: str, query: Query, unit: str) -> heatmap_builders.Panel:
    panel = (
        heatmap_builders.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .span(12)
        .height(8)
        .calculate(False)
        .rows_frame(heatmap_builders.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .y_axis(heatmap_builders.YAxisConfig().unit(unit).axis_placement(common.AxisPlacement.LEFT))
        .color(
            heatmap_builders.HeatmapColorOptions()
            .mode(heatmap.HeatmapColorMode.SCHEME)
            .scheme("Oranges")
            .scale(heatmap.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
            .fill("dark-orange")
            .reverse(False)
        )
        .cell_gap(1)
        .show_value(common.VisibilityMode.NEVER)
        .show_legend()
        .show_tooltip()
        .hide_from(common_builders.HideSeriesConfig().legend(False).tooltip(False).viz(False))
    )
    _with_targets(panel, [query])
    return panel


def stat(title: str, description: str, queries: Sequence[Query], unit: str = "short") -> stat_builders.Panel:
    panel = (
        stat_builders.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(6)
        .height(4)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )
    _with_targets(panel, queries)
    return panel


def mean_over_commits(metric: str, by: str = "") -> str:
    """Mean of a per-commit histogram or summary over the rate window (sum over count)."""
    total = f"sum by ({by}) " if by else "sum"
    return f"{total}(rate({metric}_sum[{RATE}])) / {total}(rate({metric}_count[{RATE}]))"


def quantile(q: float, metric: str, by: str = "", where: str = "") -> str:
    """Quantile q of a histogram over the rate window; `where` is a label matcher like method="Commit"."""
    labels = f"le, {by}" if by else "le"
    selector = f"{{{where}}}" if where else ""
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{selector}[{RATE}])))"


def new_dashboard(uid: str, title: str, description: str) -> dashboard_builders.Dashboard:
    """A gemps dashboard's frame: tags, time range, refresh, and the link to the other gemps dashboards."""
    return (
        dashboard_builders.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(TAGS)
        .editable()
        .tooltip(dashboard_models.DashboardCursorSync.CROSSHAIR)
        .time("now-30m", "now")
        .refresh("10s")
        .timezone("browser")
        .annotations([])  # Grafana adds its built-in "Annotations & Alerts"
        .variables([])  # none: every query names its metrics, no datasource variable needed
        .link(
            dashboard_builders.DashboardLink("gemps dashboards")
            .type(dashboard_models.DashboardLinkType.DASHBOARDS)
            .tags(TAGS)
            .as_dropdown(False)
            .keep_time(True)
            .include_vars(False)
            .target_blank(False)
        )
    )
