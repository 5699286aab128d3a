"""`gemps bench`: run the suite, write the JSON, the figure and the report tables."""

from __future__ import annotations

import json
from pathlib import Path

from gemps_bench import report
from gemps_bench.cross_host import CrossHostSpec, run_cross_host
from gemps_bench.failover import FailoverSpec, run_failover
from gemps_bench.failover import table as failover_table
from gemps_bench.replicas import ReplicasSpec, run_replicas
from gemps_bench.suite import FULL, QUICK, SuiteSpec, run_suite

DESCRIPTION = (
    "Benchmark gemps against the gRPC transport ceiling, the memory-bandwidth ceiling and peer parameter servers "
    "(torch.distributed.rpc, the GEM reference code's transport), all in one run. The full suite takes about 20 "
    "minutes on 2 cores; docs/PERFORMANCE.md explains every figure."
)


def run_bench(out: Path, spec: SuiteSpec | None = None, figure: Path | None = None) -> int:
    """Run `spec` (none: rebuild the report from OUT/results.json), then write OUT/tables.md and the figure."""
    results_path = out / "results.json"
    if spec is not None:
        run_suite(spec, "quick" if spec.sizes == QUICK.sizes else "full" if spec == FULL else "subset", results_path)
    data = json.loads(results_path.read_text())
    tables = out / "tables.md"
    sections = [
        "## Targets",
        *report.targets(data),
        "",
        "## gemps against the ceilings and peers",
        *report.throughput_table(data),
        "",
        "## Partitions of θ (K server processes)",
        *report.partitions_table(data),
        "",
        "## Every run",
        *report.systems_table(data),
    ]
    if data["skipped"]:
        sections += [
            "",
            "## Skipped",
            *[_skipped_line(skip) for skip in data["skipped"]],
        ]
    tables.write_text("\n".join(sections) + "\n")
    report.figure(data, figure or out / "performance.png")
    print(f"results: {results_path}\ntables: {tables}")
    return 0


def run_cross_host_bench(out: Path, spec: CrossHostSpec | None = None) -> int:
    """`gemps bench --link RATE`: run `spec` between simulated hosts (none: rebuild the table from
    OUT/cross-host.json), then write OUT/cross-host.md."""
    results_path = out / "cross-host.json"
    data = run_cross_host(spec, results_path) if spec is not None else json.loads(results_path.read_text())
    rate = data["rate"]
    sections = [f"## Between hosts (simulated, {rate} links)", *report.cross_host_table(data)]
    if data["skipped"]:
        sections += ["", "## Skipped", *[_skipped_line(skip) for skip in data["skipped"]]]
    tables = out / "cross-host.md"
    tables.write_text("\n".join(sections) + "\n")
    print(f"results: {results_path}\ntables: {tables}")
    return 0


def replicas_path(out: Path, mode: str) -> Path:
    """Where `gemps bench --replicas` writes one mode's results: OUT/replicas-loopback.json,
    OUT/replicas-1gbit.json (a quick run: -quick appended)."""
    return out / f"replicas-{mode.replace('cross-host ', '').replace(' ', '-')}.json"


def run_replicas_bench(out: Path, spec: ReplicasSpec | None = None, mode: str = "loopback") -> int:
    """`gemps bench --replicas 1,2 [--link RATE]`: run `spec` (none: rebuild the table from the
    mode's JSON), then write its table next to it (.md)."""
    results_path = replicas_path(out, spec.mode if spec is not None else mode)
    data = run_replicas(spec, results_path) if spec is not None else json.loads(results_path.read_text())
    where = "over loopback" if data["rate"] is None else f"between simulated hosts, {data['rate']} links"
    where += ", every process on mutual TLS" if data.get("tls") else ""
    sections = [f"## Replicas ({where}, {data['clients']} clients)", *report.replicas_table(data)]
    if data["skipped"]:
        sections += ["", "## Skipped", *[_skipped_line(skip) for skip in data["skipped"]]]
    tables = results_path.with_suffix(".md")
    tables.write_text("\n".join(sections) + "\n")
    print(f"results: {results_path}\ntables: {tables}")
    return 0


def run_failover_bench(out: Path, spec: FailoverSpec | None = None) -> int:
    """`gemps bench --failover`: run `spec` (none: rebuild the table from OUT/failover.json), then
    write OUT/failover.md."""
    results_path = out / "failover.json"
    data = run_failover(spec, results_path) if spec is not None else json.loads(results_path.read_text())
    tables = out / "failover.md"
    tables.write_text("\n".join(["## Failover (two replicas over loopback, one worker)", *failover_table(data)]) + "\n")
    print(f"results: {results_path}\ntables: {tables}")
    return 0


def _skipped_line(skip: dict[str, object]) -> str:
    where = (
        f" K={skip['partitions']}" if "partitions" in skip else f" R={skip['replicas']}" if "replicas" in skip else ""
    )
    return f"- {skip['system']}{where} P={skip['num_parameters']:,} n={skip['clients']}: {skip['why']}"
