"""The sizing guide's projection tables (docs/guides/sizing.md) are what `gemps plan` projects now:
each row's job (model, step, link, encoding) planned again with the default calibration, under the
transformer recipe's rule (downpour) and the many workers' rounds (adamw)."""

from __future__ import annotations

from pathlib import Path

from gemps_bench.capacity import Job, plan
from gemps_bench.counts import parse_counts
from gemps_bench.measured_costs import MEASURED

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guides" / "sizing.md"
WORKERS = 16  # the tables' jobs: 16 workers


def projected_row(model: str, step: float, gigabits: int, encoding: str, rule: str) -> str:
    (parameters,) = parse_counts(model)
    job = Job(parameters, WORKERS, step, gigabits * 1e9 / 8, rule=rule, encoding=encoding)
    result = plan(job, MEASURED)
    seconds = result.seconds_per_commit
    cells = [
        model, f"{step:g}", str(gigabits), encoding, str(result.partitions), str(result.local_steps),
        f"{result.server_memory_bytes / 2**30:.1f}", f"{result.commits_per_s:.2f}", f"{result.waiting_share:.0%}",
        f"{seconds['client CPU']:.2f}", f"{seconds['transfer']:.2f}", f"{seconds['server CPU']:.2f}",
        f"{seconds['server hold']:.2f}",
    ]  # fmt: skip
    if "round step" in seconds:  # under rounds, the round's step on the busiest partition
        cells.append(f"{seconds['round step']:.2f}")
    return "| " + " | ".join(cells) + " |"


def table_rows(name: str) -> list[str]:
    text = GUIDE.read_text()
    table = text[text.index(f"<!-- {name} table -->") : text.index(f"<!-- end of {name} table -->")]
    return [line for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]


def test_every_row_of_the_projection_tables_is_what_the_planner_projects() -> None:
    for name, rule, count in (("projection", "downpour", 12), ("rounds", "adamw", 6)):
        rows = table_rows(name)
        assert len(rows) == count, name  # 124M, 1.3G and 7G parameters, on 10 and 100 Gbit/s (downpour: and int8)
        for row in rows:
            model, step, gigabits, encoding = (cell.strip() for cell in row.strip("|").split("|")[:4])
            assert row == projected_row(model, float(step), int(gigabits), encoding, rule)
