"""A Jepsen-style fault suite for replicated partitions (issue 41): `--trials` trials on simulated
hosts, each a replicated job (R = 2, some R = 3) whose primary, backups and etcd are killed, paused,
parted, slowed and healed, and etcd restarted empty, in an order drawn from the trial's seed;
counting workers commit throughout, and a checker compares what they were told with what the
replicas hold (gemps_bench.jepsen). Beside it, unless `--second-job none`, a second job (issue 77,
item 1): two replicas of its own under another etcd job name, a counting worker, faults on its
primary and backup drawn after the first job's; each job's workers' replica list ends with the
other job's primary. The checker then also says when a job's θ holds commits its own workers
cannot account for (wrong θ).

    sudo .venv/bin/python scripts/jepsen_replicas.py [--trials 20] [--seed 1] [--second-job 2] \
        [--out docs/results/jepsen_replicas.json]

Trial i runs seed `--seed` + i (its plan: `--seed S --trials 1` runs it again). Progress goes to
stdout as it runs; the record of every trial (its plan, the faults as applied, the verdict) to
`--out`, rewritten after each trial; a table at the end. Exits 1 when any trial found a violation.
Needs root (network namespaces) and etcd.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gemps_bench.jepsen.plan import LONG_PAUSE, draw
from gemps_bench.jepsen.report import clean, summary, table, totals
from gemps_bench.jepsen.trial import TrialOptions, run_trial

from gemps_worker.simulated_hosts import unavailable_reason

ROOT = Path(__file__).resolve().parents[1]


def _span(text: str) -> tuple[float, float] | None:
    """ "LOW,HIGH" seconds (LOW <= HIGH), or "0": none."""
    if text.strip() == "0":
        return None
    low, high = (float(part) for part in text.split(","))
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"a span LOW,HIGH of seconds with 0 < LOW <= HIGH, not {text!r}")
    return low, high


def _second_job(text: str) -> int | None:
    """A count of faults (0 or more) on the second job, or "none": no second job."""
    if text.strip() == "none":
        return None
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"a count of faults (0 or more) or none, not {text!r}")
    return int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trials", type=int, default=20, help="how many trials (default 20)")
    parser.add_argument("--seed", type=int, default=1, help="trial i runs seed SEED + i (default 1)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs/results/jepsen_replicas.json")
    parser.add_argument("--episodes", type=int, default=4, help="fault episodes per trial (default 4)")
    parser.add_argument("--replicas", default="2,2,3", help="R drawn per trial from these (default 2,2,3)")
    parser.add_argument("--stale-wipe", type=float, default=0.25,
                        help="chance an episode is the stale-backup etcd wipe of issue 41 (default 0.25)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=3, help="counting workers (default 3)")
    low, high = LONG_PAUSE
    parser.add_argument("--long-pause", type=_span, default=LONG_PAUSE,
                        help=f"each trial ends with the primary paused LOW,HIGH seconds (default {low:g},{high:g}); "
                        "0 for none")  # fmt: skip
    parser.add_argument("--second-job", type=_second_job, default=2, metavar="FAULTS",
                        help="a second job beside the first, with FAULTS faults on its primary or backup (default 2); "
                        "none: a single job")  # fmt: skip
    parser.add_argument("--second-job-workers", type=int, default=1, help="the second job's workers (default 1)")
    wedged = "a worker waiting this many seconds while a safe primary existed is wedged (default 10)"
    parser.add_argument("--wedge-after", type=float, default=10.0, help=wedged)
    parser.add_argument("--keep", action="store_true", help="keep every trial's logs (default: failed trials' only)")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason is not None:
        sys.exit(f"jepsen_replicas: {reason}")
    replicas = tuple(int(r) for r in args.replicas.split(","))
    if args.workers < 1 or args.second_job_workers < 1:
        parser.error(f"--workers and --second-job-workers: 1 or more, not {args.workers}, {args.second_job_workers}")
    options = TrialOptions(
        workers=args.workers, second_job_workers=args.second_job_workers, wedge_after=args.wedge_after
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    results: list[dict[str, Any]] = []
    commit = _commit()  # before the first record is written: --out may be a tracked file
    for index in range(args.trials):
        seed = args.seed + index
        plan = draw(seed, episodes=args.episodes, replicas=replicas, stale_wipe=args.stale_wipe,
                    long_pause=args.long_pause, second_job=args.second_job)  # fmt: skip
        print(
            f"trial {index + 1}/{args.trials}: seed {seed}, R = {plan.replicas}, {' '.join(plan.kinds())}", flush=True
        )
        folder = Path(tempfile.mkdtemp(prefix=f"jepsen-{seed}-"))
        began = time.monotonic()
        try:
            result = run_trial(plan, folder, options, env, say=lambda line: print(line, flush=True))
        except Exception as error:  # the rig failed, not a verdict: say so and go on
            result = {"seed": seed, "replicas": plan.replicas, "plan": plan.to_json(), "error": repr(error)[:2000]}
        result["seconds"] = round(time.monotonic() - began, 1)
        if clean(result) and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            result["logs"] = str(folder)
        results.append(result)
        print(f"  {_line(result)}", flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"commit": commit, "argv": sys.argv[1:], "totals": totals(results), "trials": results}
        args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(table(results))
    sys.exit(0 if all(clean(r) for r in results) else 1)


def _commit() -> str:
    """The checkout's commit (with "+" when it has changes), or "" outside a git checkout."""
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True)  # fmt: skip
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "") if head.returncode == 0 else ""


def _line(result: dict[str, Any]) -> str:
    if not result.get("verdict"):
        return f"rig error after {result['seconds']} s: {result['error'][:300]}"
    return f"{summary(result)} ({result['seconds']} s)"


if __name__ == "__main__":
    main()
