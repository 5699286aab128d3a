"""Where a server's time goes: closed-loop clients, py-spy on the server, samples per thread.

    .venv/bin/python scripts/profile_server.py --system gemps --size 100K --seconds 10 --raw /tmp/gemps.txt
    .venv/bin/python scripts/profile_server.py --system echo --size 100K
    .venv/bin/python scripts/profile_server.py --system gemps --size 1M --partitions 2
    .venv/bin/python scripts/profile_server.py --system gemps --size 1M --clients 8   # the bench's load

Starts a real `gemps server` with its defaults (or the benchmark's bare gRPC echo), commits a
fixed gradient in a closed loop from this process through the SDK (or the echo client; with
`--clients N`, N SDK clients in the bench's load generator, two processes), and
records the server with `py-spy record --threads --native` (py-spy is in the dev extra; it needs
ptrace rights over its own children, which most containers allow). Prints commits/s, the server's
and this client's CPU milliseconds per commit, and for each server thread its busy samples (not
waiting in epoll, a futex, a condition or the GIL) with the frames that hold them. With
`--partitions K` the server is a supervisor and K partition processes: py-spy follows them
(`--subprocesses`), CPU is summed over all of them, and threads are named by their partition.
`--count-calls` counts instead the calls the data plane's thread makes per commit, every Python
function and C function by name (scripts/call_counts/: a profile hook in the server, exact but
slow, so the rates it prints then are not the server's):

    .venv/bin/python scripts/profile_server.py --size 100K --clients 8 --seconds 5 --count-calls

docs/PERFORMANCE.md keeps the profiles this printed.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, MutableMapping
from pathlib import Path

import numpy as np
from gemps_bench.counts import parse_counts
from gemps_bench.echo import EchoClient, EchoServer
from gemps_bench.gemps_load import GempsClientFactory
from gemps_bench.loadgen import LoadPlan, run_load
from gemps_bench.procfs import cpu_seconds, partition_pids

import gemps
from gemps_worker.cluster import ServerProcess

# Leaf frames that mean a thread is waiting, not working.
IDLE_FRAMES = (
    "epoll_wait",
    "futex",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "sem_wait",
    "poll",
    "select",
    "take_gil",
    "PyThread_acquire_lock_timed",
    "clock_nanosleep",
)
WARM_UP_COMMITS = 20
CALL_COUNTER = Path(__file__).resolve().parent / "call_counts"  # its sitecustomize.py


def tree_cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds used so far by each named process (0 for one that is gone)."""
    return {name: cpu_seconds(pid) or 0.0 for name, pid in pids.items()}


def closed_loop(commit: Callable[[], object], server_pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Commit back to back for `seconds`; rates, and CPU per commit of the server's processes
    (together, and the busiest one) and of this process."""
    for _ in range(WARM_UP_COMMITS):
        commit()
    commits, began, server_began, mine_began = 0, time.monotonic(), tree_cpu_seconds(server_pids), time.process_time()
    while time.monotonic() - began < seconds:
        commit()
        commits += 1
    elapsed = time.monotonic() - began
    server_used = {name: used - server_began[name] for name, used in tree_cpu_seconds(server_pids).items()}
    figures = {
        "commits_per_second": commits / elapsed,
        "server_cpu_ms_per_commit": 1e3 * sum(server_used.values()) / commits,
        "client_cpu_ms_per_commit": 1e3 * (time.process_time() - mine_began) / commits,
    }
    if len(server_pids) > 1:
        figures["busiest_process_cpu_ms_per_commit"] = 1e3 * max(server_used.values()) / commits
    return figures


def record(pid: int, seconds: float, raw: Path, subprocesses: bool) -> subprocess.Popen[bytes]:
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    command = [spy, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--rate", "200"]
    command += ["--threads", "--native", "--format", "raw", "--output", str(raw)]
    command += ["--subprocesses"] if subprocesses else []
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def thread_of(frames: list[str], process_names: dict[int, str]) -> tuple[str, list[str]]:
    """The sampled thread's name and its stack. Under `--subprocesses` py-spy puts the process
    chain first (`process PID:"command"`), and the innermost process names the thread."""
    process = ""
    while frames and frames[0].startswith("process "):
        pid = int(frames[0].split(":", 1)[0].split()[1])
        process = process_names.get(pid, f"process {pid}") + " "
        frames = frames[1:]
    return process + frames[0].split(":")[-1].strip(), frames


def summarize(raw: Path, process_names: dict[int, str] | None = None, top: int = 12) -> str:
    """Per thread: samples, busy samples, the busiest leaf frames and inclusive frames."""
    samples: collections.Counter[str] = collections.Counter()
    busy: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        thread, frames = thread_of(stack.split(";"), process_names or {})
        samples[thread] += count
        leaf = re.sub(r"\s*\(.*", "", frames[-1])
        if any(word in frame for frame in frames[-4:] for word in IDLE_FRAMES):  # unnamed libc leaves too
            continue
        busy[thread] += count
        leaves[thread][leaf] += count
        for name in {re.sub(r"\s*\((.*?):\d+\)", r" (\1)", frame) for frame in frames[1:]}:
            inclusive[thread][name] += count
    lines = []
    for thread, total in samples.most_common():
        lines.append(f"== thread {thread}: {total} samples, {busy[thread]} busy")
        lines += [f"   self {n:6d}  {name}" for name, n in leaves[thread].most_common(top)]
        lines += [
            f"   incl {n:6d}  {name[:140]}"
            for name, n in inclusive[thread].most_common(3 * top)
            if n >= 0.05 * max(busy[thread], 1) and not name.startswith("0x")
        ]
    return "\n".join(lines)


def count_calls(environment: MutableMapping[str, str]) -> Path:
    """Have the server processes started from here count their data-plane thread's calls (into
    files beside the path returned, one a process: call_counts/sitecustomize.py)."""
    counts = Path(tempfile.mkdtemp(prefix="gemps-calls-")) / "calls"
    paths = [str(CALL_COUNTER), *filter(None, [environment.get("PYTHONPATH")])]
    environment.update(GEMPS_COUNT_CALLS=str(counts), PYTHONPATH=os.pathsep.join(paths))
    return counts


def calls_per_commit(counts: Path, top: int = 40) -> str:
    """The counts' table per commit: the process whose data-plane thread applied commits (counted
    by CommitCore.commit_and_reply), its calls a commit in all, Python's apart, and the `top` rows."""
    for found in sorted(counts.parent.glob(counts.name + ".*")):
        rows = [line.split("\t") for line in found.read_text().splitlines()]
        commits = sum(int(n) for n, where, name in rows if name == "commit_and_reply" and where.endswith("core.py"))
        if not commits:
            continue
        every = sum(int(n) for n, _, _ in rows) / commits
        python = sum(int(n) for n, where, _ in rows if where != "C") / commits
        lines = [f"{commits} commits on the data plane's thread: {every:.1f} calls a commit, {python:.1f} of Python"]
        here = str(Path(__file__).resolve().parents[1]) + os.sep  # a file of this checkout by its path in it
        lines += [f"  {int(n) / commits:7.2f}  {where.removeprefix(here)}  {name}" for n, where, name in rows[:top]]
        return "\n".join(lines)
    return f"no process counted a commit on the data plane's thread ({counts.parent})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("gemps", "echo"), default="gemps")
    parser.add_argument("--size", default="100K", help="float32 parameters, e.g. 100K or 1M")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the measured loop")
    parser.add_argument("--partitions", type=int, default=1, help="run the server as K partition processes")
    parser.add_argument("--rule", default="gem", help="the gemps server's --rule (e.g. adamw: rounds of the clients)")
    parser.add_argument(
        "--clients", type=int, default=1, help="more than 1: that many SDK clients from the bench's load generator"
    )
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's raw samples here")
    parser.add_argument("--no-profile", action="store_true", help="measure rates and CPU only")
    parser.add_argument("--summarize", type=Path, default=None, help="only print the summary of this raw file")
    parser.add_argument(
        "--count-calls", action="store_true", help="count the data plane's calls per commit instead (no py-spy)"
    )
    args = parser.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        return
    if args.partitions < 1 or (args.partitions > 1 and args.system != "gemps"):
        parser.error("--partitions must be at least 1, and more than 1 only with --system gemps")
    if args.clients < 1 or (args.clients > 1 and (args.system != "gemps" or args.partitions > 1)):
        parser.error("--clients must be at least 1, and more than 1 only with --system gemps and one partition")
    size = parse_counts(args.size)[0]
    if args.count_calls and args.system != "gemps":
        parser.error("--count-calls counts a gemps server's data plane: give it with --system gemps")
    counts = count_calls(os.environ) if args.count_calls else None
    if args.rule != "gem" and args.system != "gemps":
        parser.error("--rule is a gemps server's: give it with --system gemps")
    if args.clients > 1:
        profile_under_load(size, args, args.no_profile or counts is not None)
    else:
        profile_one(args, size, args.no_profile or counts is not None)
    if counts is not None:
        print(calls_per_commit(counts))


def profile_one(args: argparse.Namespace, size: int, no_profile: bool) -> None:
    """One client (this process) in a closed loop; py-spy on the server unless `no_profile`."""
    gradient = np.random.default_rng(0).standard_normal(size, dtype=np.float32) * np.float32(1e-3)
    raw = args.raw or Path(tempfile.mkdtemp(prefix="gemps-profile-")) / "server.txt"
    with contextlib.ExitStack() as running:
        if args.system == "gemps":
            partitioned = {"partitions": args.partitions} if args.partitions > 1 else {}
            server = running.enter_context(
                ServerProcess(rule=args.rule, metrics_port=-1, log_level="warning", **partitioned)
            )
            client = running.enter_context(gemps.Client(server.target))
            client.register({"theta": np.zeros(size, np.float32)})
            pids = {"server": server.pid}
            pids.update({f"partition {index}": pid for index, pid in sorted(partition_pids(server.pid).items())})
            commit: Callable[[], object] = functools.partial(client.commit, gradient)
        else:
            echo = running.enter_context(EchoServer())
            echo_client = EchoClient(echo.target, streamed=False, chunk_bytes=1 << 20)
            running.callback(echo_client.close)
            pids, commit = {"server": echo.pid}, functools.partial(echo_client.commit, gradient)
        spy = None if no_profile else record(pids["server"], args.seconds - 1, raw, len(pids) > 1)
        figures = closed_loop(commit, pids, args.seconds)
        if spy is not None:
            spy.wait()  # before the server stops: its shutdown is not part of the profile
    shape = f" K={args.partitions}" if args.partitions > 1 else ""
    print(f"{args.system}{shape} P={size:,}: " + ", ".join(f"{name} {value:.3f}" for name, value in figures.items()))
    if spy is not None:
        if raw.exists():
            print(f"py-spy raw samples: {raw}")
            print(summarize(raw, {pid: name for name, pid in pids.items()}))
        else:
            print("py-spy recorded nothing (no ptrace rights here?)", file=sys.stderr)


def profile_under_load(size: int, args: argparse.Namespace, no_profile: bool) -> None:
    """The bench's closed loop (gemps_bench.loadgen), `args.clients` SDK clients; py-spy on the
    server through the measured window (after a warm-up)."""
    warmup, clients, seconds = 3.0, args.clients, args.seconds
    raw = args.raw or Path(tempfile.mkdtemp(prefix="gemps-profile-")) / "server.txt"
    spies: list[subprocess.Popen[bytes]] = []
    with ServerProcess(rule=args.rule, metrics_port=-1, log_level="warning", max_workers=max(256, clients)) as server:
        if not no_profile:
            timer = threading.Timer(warmup, lambda: spies.append(record(server.pid, seconds - 1, raw, False)))
            timer.start()
        plan = LoadPlan(num_parameters=size, clients=clients, duration=seconds, warmup=warmup)
        result = run_load("gemps", GempsClientFactory(server.target, size), plan, server.pid)
        for spy in spies:
            spy.wait()
    summary = result.summary()
    figures = ("commits_per_second", "server_cpu_ms_per_commit", "client_cpu_ms_per_commit", "jain_index")
    print(f"gemps P={size:,} n={clients}: " + ", ".join(f"{name} {summary[name]:.3f}" for name in figures))
    if spies and raw.exists():
        print(f"py-spy raw samples: {raw}")
        print(summarize(raw, {server.pid: "server"}))


if __name__ == "__main__":
    main()
