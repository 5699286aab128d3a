"""`python -m gemps_bench.alternatives`: run cells of the comparison on the rig, merge them into
docs/results/alternatives/<workload>.json, and draw the figure.

    python -m gemps_bench.alternatives --scenarios b --systems gemps-gem,ddp --workload digits --seeds 0,1,2
    python -m gemps_bench.alternatives --search --systems gemps-gem,ddp --workload digits
    python -m gemps_bench.alternatives --report-only --workload digits

--search runs the learning-rate search (scenario a, seed 0, each rate of the system's grid:
`System.learning_rates`, the workload's SGD grid, or one AdamW grid shared by every Adam-path
system), records each system's best in learning_rates.json and its run as the system's (a) cell of
seed 0; runs use the recorded rate (--lr overrides it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gemps_bench.alternatives import machine, report
from gemps_bench.alternatives.contract import SNAPSHOT_EVERY
from gemps_bench.alternatives.harness import Cell, CellNotStarted, run_cell
from gemps_bench.alternatives.rig import unavailable_reason
from gemps_bench.alternatives.scenario import SCENARIOS_DIR, load
from gemps_bench.alternatives.systems.registry import system, system_names
from gemps_bench.alternatives.workloads import targets, workload

RESULTS = Path("docs/results/alternatives")


def parser() -> argparse.ArgumentParser:
    made = argparse.ArgumentParser(
        prog="alternatives", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    made.add_argument("--scenarios", default="a", help="shipped scenario names (a..f) or JSON files, comma-separated")
    made.add_argument("--systems", default="gemps-gem,ddp", help=f"comma-separated: {', '.join(system_names())}")
    made.add_argument("--workload", default="digits", help="digits or charlm")
    made.add_argument("--seeds", default="0", help="comma-separated seeds")
    made.add_argument("--lr", type=float, default=None, help="this learning rate instead of the searched one")
    made.add_argument("--duration-s", type=float, default=None, help="seconds a run lasts (default: the scenario's)")
    made.add_argument("--snapshot-every", type=float, default=SNAPSHOT_EVERY,
                      help="seconds between two snapshots of a run: the resolution of its time to target")  # fmt: skip
    made.add_argument("--target", default="target",
                      help="which of the workload's targets in targets.json: target, ci (lenient, for CI), "
                      "deep (charlm's, read from one AdamW worker's curve)")  # fmt: skip
    made.add_argument("--search", action="store_true", help="the learning-rate search instead of the cells")
    made.add_argument("--runs", type=Path, default=Path("runs/alternatives"), help="folder for the runs' files")
    made.add_argument("--results", type=Path, default=RESULTS, help="folder for the JSON and the figure")
    made.add_argument("--report-only", action="store_true", help="redraw the figure and table from the JSON")
    made.add_argument("--mixed-machines", action="store_true",
                      help="add cells to a JSON of cells run on a machine of another speed (else refused)")  # fmt: skip
    return made


def main(argv: Sequence[str] | None = None) -> int:
    # SIGTERM leaves through the rig's `with` blocks, so its groups and namespaces are removed
    signal.signal(signal.SIGTERM, lambda number, frame: sys.exit(128 + number))
    args = parser().parse_args(argv)
    if args.snapshot_every <= 0:
        print(f"alternatives: --snapshot-every must be positive, not {args.snapshot_every}", file=sys.stderr)
        return 2
    try:
        chosen = workload(args.workload)
        target = _target(chosen.name, args.target)
        scenarios = _scenarios(_names(args.scenarios))
        systems = [system(name).name for name in _names(args.systems)]
        seeds = [int(seed) for seed in _names(args.seeds)]
    except ValueError as error:
        print(f"alternatives: {error}", file=sys.stderr)
        return 2
    results = args.results / f"{chosen.name}.json"
    if not args.report_only:
        reason = unavailable_reason()
        if reason is not None:
            print(f"alternatives: {reason}", file=sys.stderr)
            return 2
        other = None if args.mixed_machines else _other_machine(results, chosen.name)
        if other is not None:  # its times would be medians with a faster or slower machine's
            print(f"alternatives: {other}: give this machine's cells their own --results folder, or "
                  "--mixed-machines", file=sys.stderr)  # fmt: skip
            return 2
        other = _other_target(results, target)
        if other is not None:  # one table's times to target would measure different things
            print(f"alternatives: {other}: give cells of --target {args.target} their own --results folder",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            failed = _sweep(chosen.name, systems, scenarios, seeds, args, target)
        except CellNotStarted as error:  # the cells before it are merged; the rest are not run
            print(f"alternatives: {error}", file=sys.stderr)
            return 1
        if failed:
            return failed
    if not results.exists():
        print(f"alternatives: no results at {results} yet: run some cells first", file=sys.stderr)
        return 2
    data = json.loads(results.read_text())
    goals = ["Against the goals (medians of the seeds):", "", *report.goals(data)]
    lines = [report.target(data), "", *report.table(data), "", *goals]
    (args.results / f"{chosen.name}.md").write_text("\n".join(lines) + "\n")
    report.figure(data, args.results / f"{chosen.name}.png", chosen.name)
    print(f"results: {results}")
    return 0


def _sweep(
    name: str,
    systems: list[str],
    scenarios: dict[str, str | None],
    seeds: list[int],
    args: argparse.Namespace,
    target: float,
) -> int:
    """The search, or the cells, asked for: 0 once run, 2 when refused before any ran."""
    results = args.results / f"{name}.json"
    rates_path = args.results / "learning_rates.json"
    rates: dict[str, dict[str, float]] = json.loads(rates_path.read_text()) if rates_path.exists() else {}
    chosen_rates = {system_name: args.lr or rates.get(name, {}).get(system_name) for system_name in systems}
    unrated = [system_name for system_name, rate in chosen_rates.items() if rate is None]
    if unrated and not args.search:  # said before any cell runs, not hours into a sweep
        print(f"alternatives: no learning rate for {', '.join(unrated)} on {name}: "
              "run --search or give --lr", file=sys.stderr)  # fmt: skip
        return 2
    if _unavailable(systems):
        return 2
    if args.search:
        for system_name in systems:  # each system's rate recorded as soon as it is searched
            run = _search(name, system_name, args, target)
            rates.setdefault(name, {})[system_name] = run["learning_rate"]
            args.results.mkdir(parents=True, exist_ok=True)
            rates_path.write_text(json.dumps(rates, indent=1) + "\n")
            _merge(results, run)  # the chosen rate's run is the system's (a) cell, seed 0
        return 0
    rated = {system_name: rate for system_name, rate in chosen_rates.items() if rate is not None}
    _run_cells(name, scenarios, seeds, rated, args, target)
    return 0


def _run_cells(
    name: str,
    scenarios: dict[str, str | None],
    seeds: list[int],
    rates: dict[str, float],
    args: argparse.Namespace,
    target: float,
) -> None:
    """Run every cell asked for (each system at its rate), merging each into the workload's JSON as
    it ends. The systems of one seed run back to back, then the next seed's: a shared host's speed
    drifts within the hour (each cell records its own), so the pair a seed decides meets one host,
    where all of one system's seeds, then all of the other's, met two (2026-12-01: 204-219 ms a
    step in gemps' cells, 149-165 in DDP's right after)."""
    results = args.results / f"{name}.json"
    for scenario, file in scenarios.items():
        for seed in seeds:
            for system_name, rate in rates.items():
                cell = Cell(scenario, system_name, name, seed, rate, args.duration_s, args.snapshot_every, file)
                result = run_cell(cell, args.runs, rate, target)
                _merge(results, result)
                print(report.line(result), flush=True)


def _unavailable(systems: list[str]) -> bool:
    """Whether a system cannot run here, each said with what is missing (before any cell runs,
    not as a cell of no worker later)."""
    reasons = [reason for reason in (system(name).unavailable() for name in systems) if reason]
    for reason in reasons:
        print(f"alternatives: {reason}", file=sys.stderr)
    return bool(reasons)


def _scenarios(given: list[str]) -> dict[str, str | None]:
    """Each scenario's name (the results' key) and the JSON file it is read from, absolute (cells
    run in their own folders); None for a shipped one given by name. ValueError for two of one
    name, or a file named as a shipped scenario: their cells would replace each other's."""
    chosen: dict[str, str | None] = {}
    for name_or_path in given:
        name, path = load(name_or_path).name, Path(name_or_path)
        file = str(path.resolve()) if path.suffix else None
        if name in chosen:
            raise ValueError(f"two scenarios are named {name!r}: their cells would share one place in the results")
        if file is not None and (SCENARIOS_DIR / f"{name}.json").is_file() and path.resolve().parent != SCENARIOS_DIR:
            raise ValueError(
                f"{name_or_path} is named {name!r}, as a shipped scenario is: give it a name of its own "
                "(its cells would replace the shipped one's in the results)"
            )
        chosen[name] = file
    return chosen


def _search(name: str, system_name: str, args: argparse.Namespace, target: float) -> dict[str, Any]:
    """The system's run in scenario a, seed 0, at the rate of its grid with the shortest time to
    target (none reaching it: the best final held-out metric)."""
    chosen = workload(name)
    results = []
    for rate in system(system_name).learning_rates(chosen):
        cell = Cell("a", system_name, name, 0, rate, args.duration_s, args.snapshot_every)
        results.append(run_cell(cell, args.runs / "search", rate, target))
        print(report.line(results[-1]), flush=True)
    return report.search_best(results, chosen.metric)


def _target(name: str, which: str) -> float:
    """The workload's held-out target called `which` in targets.json; ValueError naming the choices."""
    known = targets()[name]
    if which not in known:
        raise ValueError(f"no target {which!r} for {name} in targets.json: choose from {', '.join(known)}")
    return known[which]


def _other_target(results: Path, target: float) -> str | None:
    """Why `target` is not the one the recorded cells in `results` were measured to (None: it is)."""
    if not results.exists():
        return None
    recorded = report.recorded_targets(json.loads(results.read_text()))
    if recorded in ([], [target]):
        return None
    return f"{results} holds cells measured to {', '.join(f'{t:g}' for t in recorded)}, not {target:g}"


def _other_machine(results: Path, name: str) -> str | None:
    """Why this machine is not the one the workload's recorded cells ran on (None: it is)."""
    if not results.exists():
        return None
    cells = json.loads(results.read_text())["cells"].values()
    found = machine.mismatch(machine.fingerprint(name), cells)
    return None if found is None else f"{results}: {found}"


def _merge(path: Path, result: dict[str, Any]) -> None:
    """Put a cell's result into the workload's JSON, replacing an earlier run of the same cell."""
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"cells": {}}
    cell = result["cell"]
    key = f"{cell['scenario']}/{cell['system']}/{cell['seed']}"
    data["cells"][key] = {k: v for k, v in result.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


if __name__ == "__main__":
    sys.exit(main())
