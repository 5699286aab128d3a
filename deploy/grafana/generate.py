"""Generate the gemps Grafana dashboards (deploy/grafana/dashboards/*.json) with grafana-foundation-sdk.

    python deploy/grafana/generate.py           # rewrite the JSON files
    python deploy/grafana/generate.py --check   # exit 1 when the committed files differ

The dashboards are code: edit this file, regenerate, commit both (a test fails when the JSON
differs from a fresh generation). Every panel queries the datasource that
provisioning/datasources/prometheus.yml provisions, by its fixed uid, so Grafana needs no
import step and no `${DS_...}` placeholder. Every PromQL expression here is evaluated against a
real Prometheus scraping a training run in tests/e2e/test_observability.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap as heatmap_builders
from grafana_foundation_sdk.builders import prometheus as prometheus_builders
from grafana_foundation_sdk.builders import stat as stat_builders
from grafana_foundation_sdk.builders import timeseries as timeseries_builders
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common, heatmap
from grafana_foundation_sdk.models import dashboard as dashboard_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

HERE = Path(__file__).resolve().parent
OUTPUT_DIR = HERE / "dashboards"
DATASOURCE_UID = "gemps-prometheus"  # provisioning/datasources/prometheus.yml
DATASOURCE = dashboard_models.DataSourceRef(type_val="prometheus", uid=DATASOURCE_UID)
TAGS = ["gemps"]
RATE = "$__rate_interval"
# Legend text naming a server series' partition of θ (empty for a single server: no such label).
PARTITION = "{{partition}}"
# The whole model's gradient noise scale (samples): each partition's sums over its slice add up;
# none while |G|^2's estimate is not positive (no estimate yet).
NOISE_SCALE = "sum(gemps_gradient_noise_trace) / (sum(gemps_gradient_square) > 0)"


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


def _dashboard(uid: str, title: str, description: str) -> dashboard_builders.Dashboard:
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


def training_dashboard() -> dashboard_builders.Dashboard:
    """The paper's figures, live: loss (Fig. 1), median pi (Fig. 3), staleness, energies."""
    d = _dashboard(
        "gemps-training",
        "gemps - training",
        "Is training converging, and how is GEM scaling the workers' updates? The paper's figures, live.",
    )
    d.with_row(dashboard_builders.Row("Loss and accuracy (paper Figure 1)"))
    d.with_panel(
        timeseries(
            "Training and held-out loss",
            "Training: mean mini-batch loss that workers report with their commits, over the rate window. "
            "Held-out: the evaluator's loss of the central variable on data no worker trains on.",
            [
                Query(mean_over_commits("gemps_training_loss"), "training (mean over commits)"),
                Query("gemps_heldout_loss", "held-out ({{dataset}})"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Held-out accuracy",
            "Accuracy of the central variable on the evaluator's held-out data.",
            [Query("gemps_heldout_accuracy_ratio", "{{dataset}}")],
            unit="percentunit",
            maximum=1,
        )
    )
    d.with_panel(
        timeseries(
            "Learning rate eta",
            "eta at the current central version, from the server's learning-rate schedule (--lr-schedule, "
            "--lr-warmup-commits): what the next gradient commit is scaled by. Flat under the constant schedule.",
            [Query("gemps_learning_rate", "eta")],
            width=24,
            minimum=0,
        )
    )
    d.with_row(dashboard_builders.Row("GEM scaling factor pi (paper Figure 3)"))
    d.with_panel(
        timeseries(
            "Median pi",
            "GEM's per-parameter scaling pi: the median over parameters of each commit, averaged over "
            "the commits in the window (the paper's Figure 3), their median, and the mean pi. The median "
            "falls as workers are added; past ~10 workers it often reads 0, because pi is bimodal: see "
            "the next panel.",
            [
                Query(mean_over_commits("gemps_commit_median_scaling_factor"), "median pi (mean over commits)"),
                Query(quantile(0.5, "gemps_commit_median_scaling_factor"), "median pi (median over commits)"),
                Query(mean_over_commits("gemps_scaling_factor"), "mean pi"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Parameters with pi at 0 and at pi_max",
            "Fraction of each commit's parameters whose pi sits at a clamp, averaged over commits: at 0 the "
            "other workers already moved that parameter by the proxy's energy, so this update is dropped; "
            "at pi_max (default 5) the update is amplified as far as allowed.",
            [Query(mean_over_commits("gemps_commit_clamped_ratio", "bound"), "pi at {{bound}}")],
            unit="percentunit",
            minimum=0,
            maximum=1,
        )
    )
    d.with_panel(
        timeseries(
            "Proxy vs central energy",
            "The two sides of GEM's compliance condition, mean over parameters and commits: proxy = "
            "kappa*|m_i|, the movement a single momentum-SGD worker would make; central = |theta - s_i| + "
            "pi*|Delta|, how far the central variable moved over the committing worker's round trip. GEM "
            "keeps central at proxy wherever pi is not clamped; central above proxy means the other "
            "workers already overshot. Empty for rules other than gem.",
            [Query(mean_over_commits("gemps_gem_energy", "side"), "{{side}}")],
            minimum=0,
        )
    )
    d.with_panel(
        heatmap_panel(
            "Mean pi per commit, distribution over time",
            "How many commits fell in each bucket of mean pi, per rate window.",
            Query(f"sum by (le) (increase(gemps_scaling_factor_bucket[{RATE}]))", "{{le}}", heatmap=True),
            unit="short",
        )
    )
    d.with_row(dashboard_builders.Row("Staleness"))
    d.with_panel(
        heatmap_panel(
            "Staleness distribution over time",
            "Commits per staleness bucket (tau: commits applied between the version a worker computed "
            "on and its own), per rate window. It grows with the number of workers.",
            Query(f"sum by (le) (increase(gemps_commit_staleness_bucket[{RATE}]))", "{{le}}", heatmap=True),
            unit="short",
        )
    )
    d.with_panel(
        timeseries(
            "Staleness: mean, p50, p99",
            "Staleness tau of applied commits, in updates.",
            [
                Query(mean_over_commits("gemps_commit_staleness"), "mean"),
                Query(quantile(0.5, "gemps_commit_staleness"), "p50"),
                Query(quantile(0.99, "gemps_commit_staleness"), "p99"),
            ],
            minimum=0,
        )
    )
    return d


def server_dashboard() -> dashboard_builders.Dashboard:
    """Operations: throughput, latency, queue, workers, rejections, traffic, resources.

    With θ partitioned (`gemps server --partitions K`, or K server pods) every server series
    carries a `partition` label: the panels show one series per partition (a worker's commit is
    applied once by each), named by PARTITION in their legends (empty for a single server)."""
    d = _dashboard(
        "gemps-server",
        "gemps - server",
        "Is the parameter server keeping up? Throughput, latency, the FIFO queue, workers, rejections.",
    )
    d.with_panel(
        stat(
            "Central version",
            "Commits applied to the central variable (per partition of θ).",
            [Query("gemps_central_version", PARTITION)],
        )
    )
    d.with_panel(stat("Active workers", "Workers holding a lease.", [Query("gemps_active_workers", PARTITION)]))
    d.with_panel(
        stat(
            "Commits per second",
            "Applied commits per second (per partition of θ).",
            [Query(f'sum by (partition) (rate(gemps_commits_total{{outcome="applied"}}[{RATE}]))', PARTITION)],
            unit="ops",
        )
    )
    d.with_panel(
        stat(
            "Scrape targets up",
            "Targets Prometheus scrapes successfully, by job (server, workers, evaluator), and the server "
            "processes answering (1, or the K partitions of θ of `gemps server --partitions K`).",
            [
                Query('sum by (job) (up{job=~"gemps-.*"})', "{{job}}"),
                Query("count(gemps_central_version)", "server partitions"),
            ],
        )
    )
    d.with_row(dashboard_builders.Row("Throughput and latency"))
    d.with_panel(
        timeseries(
            "Throughput",
            "Applied commits and training samples per second (samples as workers report them).",
            [
                Query(
                    f'sum by (partition) (rate(gemps_commits_total{{outcome="applied"}}[{RATE}]))',
                    f"commits/s {PARTITION}",
                ),
                Query(f"sum by (partition) (rate(gemps_training_samples_total[{RATE}]))", f"samples/s {PARTITION}"),
            ],
            unit="ops",
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Commit latency p50 / p99",
            "Server-side time per Commit (queue wait + apply + encoding the reply), by plane (grpc: the "
            "Commit RPC; data: a commit frame on the data plane, received to reply sent), and the applier's "
            "two phases: queue_wait in the FIFO queue, apply running the rule.",
            [
                Query(quantile(0.5, "gemps_rpc_duration_seconds", "plane", 'method="Commit"'), "Commit {{plane}} p50"),
                Query(quantile(0.99, "gemps_rpc_duration_seconds", "plane", 'method="Commit"'), "Commit {{plane}} p99"),
                Query(quantile(0.5, "gemps_commit_duration_seconds", "phase"), "{{phase}} p50"),
                Query(quantile(0.99, "gemps_commit_duration_seconds", "phase"), "{{phase}} p99"),
            ],
            unit="s",
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Queue depth and applier utilisation",
            "Operations waiting for the single FIFO applier (sampled at scrape, and the window's maximum), "
            "and the fraction of time the applier was busy: near 1, the server is the bottleneck.",
            [
                Query("gemps_queue_depth", f"queued {PARTITION}"),
                Query(f"max_over_time(gemps_queue_depth[{RATE}])", f"queued (max) {PARTITION}"),
                Query(f"rate(gemps_applier_busy_seconds_total[{RATE}])", f"applier busy (0..1) {PARTITION}"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Rejected commits by reason",
            "Commits refused per second, by reason (unknown_worker: evicted or never registered; "
            "bad_version: base_version in the future; non_finite: NaN/Inf; bad_shape/bad_payload: wrong "
            "size or encoding). A rejected commit never touches the central variable.",
            [Query(f'sum by (reason) (rate(gemps_commits_total{{outcome="rejected"}}[{RATE}]))', "{{reason}}")],
            unit="ops",
            minimum=0,
        )
    )
    d.with_row(dashboard_builders.Row("Workers"))
    d.with_panel(
        timeseries(
            "Active workers",
            "Workers holding a lease, and joins and departures (left, or evicted after the lease TTL).",
            [
                Query("gemps_active_workers", f"active {PARTITION}"),
                Query(f"sum(increase(gemps_registrations_total[{RATE}]))", "joined"),
                Query(f"sum by (cause) (increase(gemps_departures_total[{RATE}]))", "{{cause}}"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Workers that pay (gradient noise scale)",
            "The gradient noise scale B_noise = tr(Sigma)/|G|^2 that the server estimates from gradient commits "
            "(McCandlish et al. 2018), in workers of the batch size it assumes: about the critical batch, past "
            "which more workers buy no faster training, only staleness. Beside the registered workers. Partitions' "
            "sums add up: the whole model's is sum(trace)/sum(|G|^2). Empty for local-step (update) commits.",
            [
                Query(f"{NOISE_SCALE} / max(gemps_gradient_noise_batch_size)", "workers that pay (B_noise / batch)"),
                Query("max(gemps_active_workers)", "registered"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Worker step time p50 / p99",
            "Wall time per training step as the workers measure it (local compute plus the commit round "
            "trip), across all workers that serve /metrics (started with --metrics-port; compose does). "
            "Compare with the server's commit latency: the rest is the workers' own compute.",
            [
                Query(quantile(0.5, "gemps_worker_step_duration_seconds"), "p50"),
                Query(quantile(0.99, "gemps_worker_step_duration_seconds"), "p99"),
            ],
            unit="s",
            minimum=0,
        )
    )
    d.with_row(dashboard_builders.Row("Resources"))
    d.with_panel(
        timeseries(
            "Network",
            "Bytes per second received and sent, by RPC method and plane (grpc: protobuf messages; "
            "data: data-plane frames, θ's raw bytes included).",
            [
                Query(f"sum by (method, plane) (rate(gemps_received_bytes_total[{RATE}]))", "in {{method}} {{plane}}"),
                Query(f"sum by (method, plane) (rate(gemps_sent_bytes_total[{RATE}]))", "out {{method}} {{plane}}"),
            ],
            unit="Bps",
            width=8,
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Server memory",
            "Resident memory of the server process, and the part the commit rule keeps for its workers "
            "(GEM: 2 float32 vectors of every parameter per active worker).",
            [
                Query('process_resident_memory_bytes{job="gemps-server"}', f"resident {PARTITION}"),
                Query("gemps_rule_state_bytes", f"commit rule state {PARTITION}"),
            ],
            unit="bytes",
            width=8,
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Server CPU",
            "CPU seconds per second used by the server process (all threads).",
            [Query(f'rate(process_cpu_seconds_total{{job="gemps-server"}}[{RATE}])', f"cpu {PARTITION}")],
            unit="percentunit",
            width=8,
            minimum=0,
        )
    )
    _replication_row(d)
    return d


def _replication_row(d: dashboard_builders.Dashboard) -> None:
    """Replicated partitions (gemps_server.replication): every replica exports its role and
    epoch; only a primary its backups' lag and the live count. Empty while R=1 (nothing exported)."""
    d.with_row(dashboard_builders.Row("Replication"))
    d.with_panel(
        stat(
            "Under-replicated partitions",
            "Partitions whose primary counts fewer replicas acknowledging commits (itself and its in-sync "
            "backups) than configured (R). Above 0, a further loss could lose acknowledged commits.",
            [Query("sum(gemps_partition_under_replicated)", "under-replicated")],
        )
    )
    d.with_panel(
        stat(
            "Primaries per partition",
            "Replicas holding the primary role, per partition: 1 is healthy; 0 means a failover is under way "
            "(workers' commits wait).",
            [Query('sum by (partition) (gemps_replica_role{role="primary"})', f"primaries {PARTITION}")],
        )
    )
    d.with_panel(
        stat(
            "Epoch",
            "The highest primary epoch per partition: it rises by at least one at every failover.",
            [Query("max by (partition) (gemps_replica_epoch)", f"epoch {PARTITION}")],
        )
    )
    d.with_panel(
        stat(
            "Failovers (1h)",
            "Times a replica became primary over the last hour, all partitions.",
            [Query("sum(increase(gemps_failovers_total[1h]))", "failovers")],
        )
    )
    d.with_panel(
        timeseries(
            "Replicas by role",
            "Replicas in each role (primary, backup, candidate: looking for a primary), per partition.",
            [Query("sum by (role, partition) (gemps_replica_role)", f"{{{{role}}}} {PARTITION}")],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Epoch per replica",
            "The primary's epoch each replica holds or follows: a replica behind the others has not yet "
            "heard of the latest failover.",
            [Query("gemps_replica_epoch", f"{{{{instance}}}} {PARTITION}")],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Live replicas vs configured",
            "Per partition, as its primary counts them: replicas acknowledging commits (the primary and its "
            "in-sync backups) against R, and backups out of the in-sync set.",
            [
                Query("max by (partition) (gemps_replicas_live)", f"live {PARTITION}"),
                Query("max by (partition) (gemps_replicas_configured)", f"configured {PARTITION}"),
                Query("sum by (partition) (1 - gemps_replication_in_sync)", f"out of sync {PARTITION}"),
            ],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Journal entries forwarded and applied per second",
            "State changes each primary forwards to its backups, and each backup applies, per second.",
            [
                Query(f"rate(gemps_replication_forwarded_total[{RATE}])", f"forwarded {{{{instance}}}} {PARTITION}"),
                Query(f"rate(gemps_replication_applied_total[{RATE}])", f"applied {{{{instance}}}} {PARTITION}"),
            ],
            unit="ops",
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Replication lag (commits)",
            "Journal entries each backup has not acknowledged, as its primary sees them.",
            [Query("gemps_replication_lag_commits", f"{{{{backup}}}} {PARTITION}")],
            minimum=0,
        )
    )
    d.with_panel(
        timeseries(
            "Replication lag (seconds)",
            "Age of the oldest journal entry each backup has not acknowledged (0: caught up).",
            [Query("gemps_replication_lag_seconds", f"{{{{backup}}}} {PARTITION}")],
            unit="s",
            minimum=0,
        )
    )


def dashboards() -> dict[str, dashboard_models.Dashboard]:
    """File name -> dashboard model."""
    built = {"gemps-training.json": training_dashboard().build(), "gemps-server.json": server_dashboard().build()}
    for model in built.values():
        for number, panel in enumerate(model.panels or [], start=1):
            panel.id_val = number  # stable ids: Grafana keys panel links and state on them
    return built


def render(model: dashboard_models.Dashboard) -> str:
    return json.dumps(model, cls=JSONEncoder, indent=2, sort_keys=True) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="exit 1 when the committed JSON differs")
    parser.add_argument("--out", type=Path, default=OUTPUT_DIR, help="output folder")
    args = parser.parse_args(argv)
    stale = []
    for name, model in dashboards().items():
        path = args.out / name
        text = render(model)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("out of date (run python deploy/grafana/generate.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
