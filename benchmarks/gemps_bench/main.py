"""`gemps bench`: run the suite, write the JSON, the figure and the report tables."""

from __future__ import annotations

import json
from pathlib import Path

from gemps_bench import report
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


def _skipped_line(skip: dict[str, object]) -> str:
    return f"- {skip['system']} P={skip['num_parameters']:,} n={skip['clients']}: {skip['why']}"
