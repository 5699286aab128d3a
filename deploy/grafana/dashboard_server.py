"""The server dashboard (gemps-server.json): is the parameter server keeping up? Throughput,
latency, the FIFO queue, workers, rejections, resources, and replication's row
(dashboard_replication)."""

from __future__ import annotations

from dashboard_panels import PARTITION, RATE, Query, new_dashboard, quantile, stat, timeseries
from dashboard_replication import replication_row
from grafana_foundation_sdk.builders import dashboard as dashboard_builders

# The whole model's gradient noise scale (samples): each partition's sums over its slice add up;
# none while |G|^2's estimate is not positive (no estimate yet).
NOISE_SCALE = "sum(gemps_gradient_noise_trace) / (sum(gemps_gradient_square) > 0)"


def server_dashboard() -> dashboard_builders.Dashboard:
    """Operations: throughput, latency, queue, workers, rejections, traffic, resources.

    With θ partitioned (`gemps server --partitions K`, or K server pods) every server series
    carries a `partition` label: the panels show one series per partition (a worker's commit is
    applied once by each), named by PARTITION in their legends (empty for a single server)."""
    d = new_dashboard(
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
    replication_row(d)
    return d
