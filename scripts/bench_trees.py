"""`gemps bench` on several git trees of this repository, alternated in one run: a change on the
commit path, before and after, measured on the same machine at the same time (its load drifts).

    .venv/bin/python scripts/bench_trees.py 3cca615 HEAD --sizes 100K,1M --clients 8 --rounds 2
    .venv/bin/python scripts/bench_trees.py 3cca615 16a1039 --systems gemps,echo-tcp --json /tmp/ab.json
    .venv/bin/python scripts/bench_trees.py HEAD . --quick --sizes 10K --clients 1   # do both trees run? (seconds)
    .venv/bin/python scripts/bench_trees.py HEAD . --link 1gbit --sizes 10M --clients 2 --systems gemps
    .venv/bin/python scripts/bench_trees.py HEAD . --replicas 1,2 --repeats 2 --sizes 100K,1M   # replication's cost

Each ref is checked out once as a detached worktree under --trees (the working tree itself with
`.`: uncommitted changes included), its compiled loops built in place from the sources its own
pyproject.toml lists (the build an install makes), and its `gemps bench` run with that tree first
on PYTHONPATH: the same virtualenv, the tree's own server, SDK and load generator. Rounds alternate
the trees (A B A B ...), so a drift in the machine's load falls on both. Prints a table of the
medians per tree and size: server and client CPU milliseconds per commit, commits/s and, where
echo-tcp ran in the same invocation, commits/s as a ratio to it. With --replicas, `gemps bench
--replicas` instead (fresh servers for each run, the replica counts alternated inside each
invocation): the primary's and the backups' CPU per commit, and the primary's over the lone
server's of the same invocation and repeat. docs/PERFORMANCE.md keeps the tables this printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("proto", "server", "client_sdk", "worker", "cli", "benchmarks")
FIGURES = ("server_cpu_ms_per_commit", "client_cpu_ms_per_commit", "commits_per_second")
REPLICA_FIGURES = ("replicas", "repeat", "primary_cpu_ms_per_commit", "backup_cpu_ms_per_commit", "commits_per_second")


def tree_of(ref: str, trees: Path) -> Path:
    """A checkout of `ref` (the working tree for "."), with its compiled loops built."""
    if ref == ".":
        return REPO
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--short=10", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        raise SystemExit(f"bench_trees.py: {ref!r} names no commit of this repository (git rev-parse)")
    commit = found.stdout.strip()
    tree = trees / commit
    if not tree.exists():
        trees.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), commit], check=True)
    build_native(tree)
    return tree


def build_native(tree: Path) -> None:
    """Compile the tree's extension modules (pyproject.toml's ext-modules) in place, as an install would."""
    project = tomllib.loads((tree / "pyproject.toml").read_text())
    for module in project.get("tool", {}).get("setuptools", {}).get("ext-modules", []):
        package, _, name = module["name"].rpartition(".")
        folder = next(d for d in PACKAGE_DIRS if (tree / d / package.split(".")[0]).is_dir())
        target = tree / folder / Path(*package.split(".")) / (name + sysconfig.get_config_var("EXT_SUFFIX"))
        sources = [tree / source for source in module["sources"]]
        newest = max(path.stat().st_mtime for path in sources + [tree / dep for dep in module.get("depends", [])])
        if target.exists() and target.stat().st_mtime > newest:
            continue
        flags = module.get("extra-compile-args", [])
        include = sysconfig.get_paths()["include"]
        command = ["gcc", "-shared", "-fPIC", *flags, f"-I{include}", *map(str, sources), "-o", str(target)]
        subprocess.run(command, check=True)


def run_bench(tree: Path, args: argparse.Namespace, out: Path) -> list[dict[str, object]]:
    """One `gemps bench` of `tree`'s code; its runs (results.json)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(tree / d) for d in PACKAGE_DIRS))
    command = [sys.executable, "-m", "gemps_cli", "bench", "--sizes", args.sizes, "--clients", args.clients]
    command += ["--systems", args.systems, "--out", str(out), *(["--quick"] if args.quick else [])]
    if args.link:  # between simulated hosts (root): a partition count is a system of its own here
        command += ["--link", args.link, "--partitions", args.partitions]
    if args.replicas:
        command = [sys.executable, "-m", "gemps_cli", "bench", "--replicas", args.replicas, "--sizes", args.sizes]
        command += ["--repeats", str(args.repeats), "--out", str(out)]
    subprocess.run(command, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    results = "replicas-loopback.json" if args.replicas else "cross-host.json" if args.link else "results.json"
    runs: list[dict[str, object]] = json.loads((out / results).read_text())["runs"]
    for run in runs:  # between hosts gemps' partition counts are one system's cells: named as loopback's
        if args.link and int(str(run.get("partitions") or 1)) > 1:
            run["system"] = f"{run['system']}-{run['partitions']}p"
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("refs", nargs="+", help="git refs ('.': the working tree, uncommitted changes too)")
    parser.add_argument("--sizes", default="100K,1M")
    parser.add_argument("--clients", default="8")
    parser.add_argument("--systems", default="gemps,echo-tcp", help="bench systems run for each tree")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each tree, alternated")
    parser.add_argument("--trees", type=Path, default=Path("/tmp/gemps-trees"), help="where worktrees are made")
    parser.add_argument("--json", type=Path, help="write every run here too")
    parser.add_argument("--quick", action="store_true", help="gemps bench --quick's windows (1 s): do the trees run?")
    parser.add_argument("--link", help="gemps bench --link RATE: between simulated hosts (root), e.g. 1gbit")
    parser.add_argument("--partitions", default="1,2,4", help="with --link: gemps' partition counts")
    parser.add_argument("--replicas", help="gemps bench --replicas R,R (loopback): replication's cost instead")
    parser.add_argument("--repeats", type=int, default=2, help="with --replicas: runs of each replica count")
    args = parser.parse_args()
    trees = {ref: tree_of(ref, args.trees) for ref in args.refs}
    every: list[dict[str, object]] = []
    for round_index in range(args.rounds):
        for ref, tree in trees.items():
            out = args.trees / "out" / f"{ref.replace('/', '_')}-{round_index}"
            try:
                runs = run_bench(tree, args, out)
            except subprocess.CalledProcessError as failed:  # a tree that does not run (a commit mid-merge)
                print(f"{ref}: gemps bench exited with {failed.returncode}: not in round {round_index}", flush=True)
                continue
            for run in runs:
                run.update(ref=ref, round=round_index)
                every.append(run)
                shown = REPLICA_FIGURES if args.replicas else ("system", *FIGURES)
                print(json.dumps({k: run[k] for k in ("ref", "num_parameters", *shown)}), flush=True)
            if args.json:  # as it goes: a run stopped part-way keeps what it measured
                args.json.write_text(json.dumps(every, indent=1))
    print(replicas_table(every, args.refs) if args.replicas else table(every, args.refs))


def table(runs: list[dict[str, object]], refs: list[str]) -> str:
    """Medians per (gemps system, size, ref): its figures, and its commits/s over echo-tcp's of the
    same round. Every gemps variant the runs hold (gemps-int8, gemps-tcp, ...), not gemps alone."""
    lines = [
        "| tree | system | P | server CPU ms/commit | client CPU ms/commit | commits/s | vs echo-tcp (same round) |",
        "|---|---|---|---|---|---|---|",
    ]
    systems = sorted({str(r["system"]) for r in runs if str(r["system"]).startswith("gemps")})
    sizes = sorted({int(str(r["num_parameters"])) for r in runs})
    for system in systems:
        for size in sizes:
            for ref in refs:
                mine = [r for r in runs if r["ref"] == ref and r["num_parameters"] == size and r["system"] == system]
                if mine:
                    lines.append(_row(runs, mine, ref, system, size))
    return "\n".join(lines)


def replicas_table(runs: list[dict[str, object]], refs: list[str]) -> str:
    """Medians per (size, ref, replica count): the primary's and the backups' CPU per commit, and
    the primary's over the lone server's (R = 1) of the same invocation and repeat, each pair."""
    lines = [
        "| tree | P | R | primary CPU ms/commit | backup CPU ms/commit | commits/s | primary / lone (each pair) |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in sorted({int(str(r["num_parameters"])) for r in runs}):
        for ref in refs:
            mine = [r for r in runs if r["ref"] == ref and r["num_parameters"] == size]
            for count in sorted({int(str(r["replicas"])) for r in mine}):
                cells = [r for r in mine if r["replicas"] == count]
                primary = statistics.median(float(str(r["primary_cpu_ms_per_commit"])) for r in cells)
                backups = [float(str(r["backup_cpu_ms_per_commit"])) for r in cells if r["backup_cpu_ms_per_commit"]]
                backup = f"{statistics.median(backups):.3f}" if backups else "-"
                rate = statistics.median(float(str(r["commits_per_second"])) for r in cells)
                ratios = sorted(
                    float(str(r["primary_cpu_ms_per_commit"])) / float(str(lone["primary_cpu_ms_per_commit"]))
                    for r in cells
                    for lone in mine
                    if lone["replicas"] == 1 and (lone["round"], lone["repeat"]) == (r["round"], r["repeat"])
                )
                ratio = (
                    f"{statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})" if count > 1 else ""
                )
                lines.append(f"| {ref} | {size:,} | {count} | {primary:.3f} | {backup} | {rate:.1f} | {ratio} |")
    return "\n".join(lines)


def _row(runs: list[dict[str, object]], mine: list[dict[str, object]], ref: str, system: str, size: int) -> str:
    medians = [statistics.median(float(str(r[f])) for r in mine) for f in FIGURES]
    ratios = []
    for r in mine:
        echo = [
            e
            for e in runs
            if e["system"] == "echo-tcp" and e["ref"] == ref and e["round"] == r["round"]
            if e["num_parameters"] == size
        ]
        if echo:
            ratios.append(float(str(r["commits_per_second"])) / float(str(echo[0]["commits_per_second"])))
    ratio = f"{min(ratios):.2f}-{max(ratios):.2f}x" if ratios else "n/a"
    return f"| {ref} | {system} | {size:,} | {medians[0]:.3f} | {medians[1]:.3f} | {medians[2]:.1f} | {ratio} |"


if __name__ == "__main__":
    main()
