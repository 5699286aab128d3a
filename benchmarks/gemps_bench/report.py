"""docs/PERFORMANCE.md's tables, target verdicts and figure, from one suite run's JSON."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gemps_bench.suite import CEILINGS, PEERS

Run = dict[str, Any]
MB = 2**20


def _find(runs: Iterable[Run], system: str, size: int, clients: int) -> Run | None:
    return next(
        (r for r in runs if r["system"] == system and r["num_parameters"] == size and r["clients"] == clients), None
    )


def _rate(run: Run | None) -> float:
    return float(run["commits_per_second"]) if run else math.nan


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b and math.isfinite(a) and math.isfinite(b) else "n/a"


def _verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("**met**" if ok else "**not met**")


def own_rss(run: Run) -> int:
    """A run's server peak RSS less the clients' shared memory it maps (theirs, counted in its RSS)."""
    return int(run["server_peak_rss_bytes"] or 0) - int(run.get("server_shared_rss_bytes") or 0)


def memory_bound(size: int, clients: int) -> float:
    """The issue's server memory bound for gem: (2n + 3) * 4P bytes + 150 MB."""
    return (2 * clients + 3) * 4 * size + 150e6


def _cpu(run: Run | None, side: str = "server") -> str:
    value = float(run.get(f"{side}_cpu_ms_per_commit", math.nan)) if run else math.nan
    return f"{value:.2f}" if math.isfinite(value) else "-"


def throughput_table(data: dict[str, Any]) -> list[str]:
    runs: list[Run] = data["runs"]
    lines = [
        "| P | clients | gemps commits/s | vs echo-unary | vs echo-stream | vs memcpy ceiling | vs torch-rpc "
        "| vs torch-rpc-tcp | vs reference-p2p | bf16 commits/s (vs f32) | server CPU ms/commit | p50 / p99 ms "
        "| Jain | staleness (n-1) | server RSS MB, own (bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cells = sorted({(r["num_parameters"], r["clients"]) for r in runs if r["system"] == "gemps"})
    for size, clients in cells:
        gemps = _find(runs, "gemps", size, clients)
        assert gemps is not None
        rate = _rate(gemps)
        ratios = [_ratio(rate, _rate(_find(runs, s, size, clients))) for s in (*CEILINGS,)]
        ceiling = _ratio(rate, gemps["memory_ceiling_commits_per_second"])
        peers = [_ratio(rate, _rate(_find(runs, s, size, clients))) for s in PEERS]
        bf16 = _find(runs, "gemps-bfloat16", size, clients)
        bf16_text = f"{_rate(bf16):.2f} ({_ratio(_rate(bf16), rate)})" if bf16 else "-"
        rss = own_rss(gemps)
        lines.append(
            f"| {size:,} | {clients} | {rate:.2f} | {ratios[0]} | {ratios[1]} | {ceiling} | {' | '.join(peers)} "
            f"| {bf16_text} | {_cpu(gemps)} | {gemps['latency_p50_ms']:.0f} / {gemps['latency_p99_ms']:.0f} "
            f"| {gemps['jain_index']:.3f} | {gemps['mean_staleness']:.2f} ({clients - 1}) "
            f"| {rss / MB:.0f} ({memory_bound(size, clients) / MB:.0f}) |"
        )
    return lines


def systems_table(data: dict[str, Any]) -> list[str]:
    lines = [
        "| system | P | clients | commits/s | server CPU ms/commit | client CPU ms/commit | p50 ms | p99 ms | Jain "
        "| server peak RSS MB (of it, clients' shared memory) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["runs"]:
        rss, shared = r["server_peak_rss_bytes"], r.get("server_shared_rss_bytes") or 0
        rss_text = (f"{rss / MB:.0f}" + (f" ({shared / MB:.0f})" if shared else "")) if rss else "-"
        lines.append(
            f"| {r['system']} | {r['num_parameters']:,} | {r['clients']} | {r['commits_per_second']:.2f} | {_cpu(r)} "
            f"| {_cpu(r, 'client')} "
            f"| {r['latency_p50_ms']:.0f} | {r['latency_p99_ms']:.0f} | {r['jain_index']:.3f} | {rss_text} |"
        )
    return lines


PARTITION_SYSTEMS = {1: "gemps", 2: "gemps-2p", 4: "gemps-4p"}


def _ms(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "-"


def partitions_table(data: dict[str, Any]) -> list[str]:
    """θ split across K server processes: commits/s against K = 1 in the same run, the server's CPU
    per commit (all processes), the busiest partition's, and the commits/s K partitions would
    reach with a core each and clients that keep up (1000 / the busiest partition's ms)."""
    runs: list[Run] = data["runs"]
    lines = [
        "| P | clients | K | commits/s | vs K=1 | server CPU ms/commit (all) | busiest partition CPU ms/commit "
        "| commits/s with a core per partition | p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    cells = sorted({(r["num_parameters"], r["clients"]) for r in runs if r["system"] in PARTITION_SYSTEMS.values()})
    for size, clients in cells:
        single = _find(runs, "gemps", size, clients)
        for count, system in PARTITION_SYSTEMS.items():
            run = _find(runs, system, size, clients)
            if run is None or (count > 1 and single is None):
                continue
            total = float(run.get("server_cpu_ms_per_commit", math.nan))
            busiest = total if count == 1 else float(run.get("busiest_partition_cpu_ms_per_commit", math.nan))
            projected = 1e3 / busiest if busiest > 0 else math.nan
            lines.append(
                f"| {size:,} | {clients} | {count} | {_rate(run):.2f} | {_ratio(_rate(run), _rate(single))} "
                f"| {_ms(total)} | {_ms(busiest)} | {projected:.1f} "
                f"| {run['latency_p50_ms']:.0f} / {run['latency_p99_ms']:.0f} |"
            )
    return lines


def targets(data: dict[str, Any]) -> list[str]:
    """Each target with its number and verdict (n/a where the cells did not run)."""
    runs: list[Run] = data["runs"]
    out = ["| target | measured | verdict |", "|---|---|---|"]

    def row(name: str, measured: str, ok: bool | None) -> None:
        out.append(f"| {name} | {measured} | {_verdict(ok)} |")

    def versus(other: str, sizes: tuple[int, ...], clients: int) -> list[tuple[int, float]]:
        found = []
        for size in sizes:
            g, o = _find(runs, "gemps", size, clients), _find(runs, other, size, clients)
            if g and o:
                found.append((size, _rate(g) / _rate(o)))
        return found

    def listed(found: list[tuple[int, float]]) -> str:
        return ", ".join(f"{size / 1e6:g}M: {ratio:.2f}x" for size, ratio in found) or "not run"

    peer_sizes = (100_000, 1_000_000, 10_000_000, 50_000_000)
    for peer, at_least in (("reference-p2p", 1.5), ("torch-rpc-tcp", 1.5), ("torch-rpc", 1.0)):
        found = versus(peer, peer_sizes, 8)
        row(
            f"8 clients: >= {at_least:g}x {peer} at 0.1M, 1M, 10M, 50M",
            listed(found),
            all(r >= at_least for _, r in found) if found else None,
        )
    found = versus("echo-tcp", (100_000, 1_000_000), 8)
    row("8 clients: >= 0.5x echo-tcp at 0.1M, 1M", listed(found), all(r >= 0.5 for _, r in found) if found else None)
    at_10m = _find(runs, "gemps", 10_000_000, 8)
    share = _rate(at_10m) / at_10m["memory_ceiling_commits_per_second"] if at_10m else math.nan
    row(
        "8 clients: >= 0.35x the memory-bandwidth ceiling at 10M",
        f"{share:.2f}x" if at_10m else "not run",
        share >= 0.35 if at_10m else None,
    )
    at_1m = _find(runs, "gemps", 1_000_000, 8)
    row(
        "8 clients: server CPU per commit at 1M <= 3 ms",
        f"{_cpu(at_1m)} ms",
        None if at_1m is None else float(at_1m["server_cpu_ms_per_commit"]) <= 3.0,
    )
    for other in ("echo-unary", "gemps-grpc"):
        found = versus(other, (100_000, 1_000_000, 10_000_000), 8)
        row(f"8 clients: against {other} (reported, no target)", listed(found), None)
    for r in (r for r in runs if r["system"] == "gemps" and r["clients"] == 100):
        size = r["num_parameters"]
        g8 = _find(runs, "gemps", size, 8)
        whole = (
            f" (of whole commits {r['jain_index_whole_commits']:.3f}, the most whole counts allow "
            f"{r['jain_index_whole_commits_ceiling']:.3f})"
            if "jain_index_whole_commits" in r
            else ""
        )
        row(f"100 clients, P={size:,}: Jain >= 0.99", f"{r['jain_index']:.4f}{whole}", r["jain_index"] >= 0.99)
        row(
            f"100 clients, P={size:,}: commits/s >= 0.9x the 8-client figure",
            _ratio(_rate(r), _rate(g8)),
            g8 is not None and _rate(r) >= 0.9 * _rate(g8),
        )
    over = [
        (
            r["num_parameters"],
            r["clients"],
            own_rss(r) / memory_bound(r["num_parameters"], r["clients"]),
        )
        for r in runs
        if r["system"] == "gemps" and r["server_peak_rss_bytes"]
    ]
    worst = max(over, key=lambda t: t[2]) if over else None
    row(
        "server RSS (less the clients' shared memory it maps) <= (2n+3)*4P + 150 MB (gem), every cell",
        f"worst: P={worst[0]:,} n={worst[1]} at {worst[2]:.2f}x the bound" if worst else "not run",
        all(t[2] <= 1 for t in over) if over else None,
    )
    cost = data.get("worker_cost") or {}
    if cost:
        row(
            "worker RSS <= 1.25x bare `import torch`",
            f"{cost['rss_ratio']:.2f}x ({cost['worker_peak_rss_mb']:.0f} MB vs "
            f"{cost['bare_import_peak_rss_mb']:.0f} MB)",
            bool(cost["rss_target_met"]),
        )
        row(
            "worker start-up to first commit <= 2x bare import",
            f"{cost['startup_ratio']:.2f}x ({cost['worker_startup_to_first_commit_s']:.2f} s vs "
            f"{cost['bare_import_wall_s']:.2f} s)",
            bool(cost["startup_target_met"]),
        )
    return out


def figure(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs: list[Run] = data["runs"]
    systems = ["gemps", "gemps-tcp", "gemps-grpc", "gemps-bfloat16", "gemps-numpy", *CEILINGS, *PEERS]
    fig, (by_size, by_clients) = plt.subplots(1, 2, figsize=(12, 4.5))
    palette = plt.get_cmap("tab20")  # a colour each: more systems than the default cycle's 10
    colors = [palette(i) for i in (*range(0, 20, 2), *range(1, 20, 2))]
    for system, color in zip(systems, colors, strict=False):
        # gemps and its variants solid, the ceilings dashed-dotted, the peers dotted
        style = {"color": color, "marker": "o", "label": system}
        style["linestyle"] = "-" if system.startswith("gemps") else ("-." if system in CEILINGS else ":")
        points = sorted(
            (r["num_parameters"], r["commits_per_second"]) for r in runs if r["system"] == system and r["clients"] == 8
        )
        if points:
            by_size.plot(*zip(*points, strict=True), **style)
        points = sorted(
            (r["clients"], r["commits_per_second"])
            for r in runs
            if r["system"] == system and r["num_parameters"] == 1_000_000
        )
        if points:
            by_clients.plot(*zip(*points, strict=True), **style)
    sizes = sorted({r["num_parameters"] for r in runs})
    by_size.plot(sizes, [memory_ceiling_of(data, s) for s in sizes], "k--", label="memcpy ceiling")
    by_size.set(xscale="log", yscale="log", xlabel="parameters (float32)", ylabel="commits/s", title="8 clients")
    by_clients.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="commits/s", title="1M parameters")
    for axes in (by_size, by_clients):
        axes.grid(True, which="both", alpha=0.3)
        axes.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def memory_ceiling_of(data: dict[str, Any], size: int) -> float:
    from gemps_bench.ceilings import memory_ceiling

    return memory_ceiling(size, data["memcpy_bytes_per_second"])


def cross_host_table(data: dict[str, Any]) -> list[str]:
    """`gemps bench --link`: each system between simulated hosts, the share of its links it reached
    (payload one way over K links' rate), its commits/s per link against echo-tcp's on one link
    between the same hosts, and gemps' commits/s with K partitions (K hosts, K links) against one;
    with the share of the machine's cores busy in the window (every simulated host shares them)."""
    runs: list[Run] = data["runs"]
    link_mb = data["link_bytes_per_second"] / 1e6

    def find(system: str, size: int, clients: int, partitions: int = 1) -> Run | None:
        matches = (r for r in runs if r["partitions"] == partitions)
        return _find(matches, system, size, clients)

    lines = [
        f"| P | clients | system | K (links) | commits/s | payload MB/s each way (links: K x {link_mb:.0f}) "
        "| of the links | vs echo-tcp (per link) | vs K=1 | client CPU ms/commit "
        "| server CPU ms/commit (busiest partition) | machine's cores busy | p50 / p99 ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        size, clients, partitions = r["num_parameters"], r["clients"], r["partitions"]
        rate, echo = _rate(r), _rate(find("echo-tcp", size, clients))
        single = find(r["system"], size, clients) if partitions > 1 else None
        busiest = float(r.get("busiest_partition_cpu_ms_per_commit", math.nan))
        server = _cpu(r) + (f" ({_ms(busiest)})" if partitions > 1 else "")
        busy = r.get("machine_busy_fraction")
        lines.append(
            f"| {size:,} | {clients} | {r['system']} | {partitions} | {rate:.2f} "
            f"| {r['payload_bytes_per_second_each_way'] / 1e6:.1f} | {r['link_fraction']:.2f} "
            f"| {'-' if r['system'] == 'echo-tcp' else _ratio(rate / partitions, echo)} "
            f"| {_ratio(rate, _rate(single)) if single else '-'} | {_cpu(r, 'client')} | {server} "
            f"| {'-' if busy is None else f'{busy:.0%}'} "
            f"| {r['latency_p50_ms']:.0f} / {r['latency_p99_ms']:.0f} |"
        )
    return lines


def replicas_table(data: dict[str, Any]) -> list[str]:
    """`gemps bench --replicas`: per P and R, the medians over the repetitions (R = 1 and R = 2
    alternating), commits/s against R = 1 (the median of each repetition's own ratio, with the
    least and greatest), the primary's and the backup's CPU per commit."""
    lines = [
        "| P | R | runs | commits/s (median) | vs R=1 (range) | primary CPU ms/commit | backup CPU ms/commit "
        "| client CPU ms/commit | p50 ms | machine's cores busy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in data["summary"]:
        span = row.get("vs_single_range")
        ratio = "-" if row["replicas"] == 1 else _ratio(row["vs_single"], 1.0)
        ratio += f" ({span[0]:.2f}-{span[1]:.2f})" if span and row["replicas"] > 1 else ""
        busy = row.get("machine_busy_fraction")
        lines.append(
            f"| {row['num_parameters']:,} | {row['replicas']} | {row['repeats']} | {row['commits_per_second']:.2f} "
            f"| {ratio} | {_ms(row['primary_cpu_ms_per_commit'])} | {_ms(float(row['backup_cpu_ms_per_commit']))} "
            f"| {_ms(row['client_cpu_ms_per_commit'])} | {row['latency_p50_ms']:.0f} "
            f"| {'-' if busy is None or not math.isfinite(busy) else f'{busy:.0%}'} |"
        )
    return lines
