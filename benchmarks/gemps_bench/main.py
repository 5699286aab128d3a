"""`gemps bench`: run the suite, write the JSON, the figure and the report tables."""

from __future__ import annotations

import json
from pathlib import Path

from gemps_bench import report
from gemps_bench.suite import FULL, QUICK, run_suite

DESCRIPTION = (
    "Benchmark gemps against the gRPC transport ceiling, the memory-bandwidth ceiling and peer parameter servers "
    "(torch.distributed.rpc, the GEM reference code's transport), all in one run. The full suite takes about 20 "
    "minutes on 2 cores; docs/PERFORMANCE.md explains every figure."
)


def run_bench(out: Path, figure: Path | None = None, quick: bool = False, report_only: bool = False) -> int:
    """Run the suite (unless `report_only`), then write OUT/tables.md and the figure from OUT/results.json."""
    results_path = out / "results.json"
    if not report_only:
        run_suite(QUICK if quick else FULL, "quick" if quick else "full", results_path)
    data = json.loads(results_path.read_text())
    tables = out / "tables.md"
    sections = [
        "## Targets",
        *report.targets(data),
        "",
        "## gemps against the ceilings and peers",
        *report.throughput_table(data),
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
