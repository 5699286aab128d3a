"""Soak test: many clients against one `gemps server` for a long time.

    .venv/bin/python scripts/soak.py --clients 100 --duration 600 --out docs/results/soak.json

Starts a real server (checkpoints on, as in production) and N concurrent clients in this
process (grpc.aio, one connection each). Every client registers, commits gradients in a loop
(each commit with a request id, retried on UNAVAILABLE / DEADLINE_EXCEEDED with the same id),
pulls now and then, and leaves and registers again every so often (churn frees and re-creates
GEM state). Meanwhile the server's resident memory is sampled from /proc.

Pass criteria (exit 0, `"passed": true` in the JSON): no errors; the server's commit count
equals the number of commits the clients saw acknowledged; resident memory after warm-up grows
by less than 5% (median of the last tenth of the samples against the median of the first tenth
after warm-up; `--max-growth-pct` for short runs, in which the allocator is still settling);
the server shuts down cleanly on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_worker.cluster import ServerProcess

RETRIED = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A call is retried for this long, as the SDK retries for its patience (300 s by default): 10
# attempts (up to about 15 s) ran out once in a full `make test`, the soak's 100 clients beside the
# other runner's tests on 2 cores ("Stream removed", REFUSED_STREAM, for one client).
RETRY_FOR_SECONDS = 60.0
RPC_TIMEOUT = 30.0
CHURN_EVERY = 200  # commits between a client's leave + register
PULL_EVERY = 25  # commits between pulls
RSS_LIMIT_PCT = 5.0  # the ten-minute run's bound; short runs pass a looser one (--max-growth-pct)


@dataclass
class Totals:
    acked: int = 0
    retries: int = 0
    registrations: int = 0
    pulls: int = 0
    errors: list[str] = field(default_factory=list)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def call(method: Any, request: Any, totals: Totals) -> Any:
    """One RPC with a deadline, retried with backoff and jitter on UNAVAILABLE/DEADLINE_EXCEEDED
    for up to RETRY_FOR_SECONDS."""
    give_up = time.monotonic() + RETRY_FOR_SECONDS
    attempt = 0
    while True:
        try:
            return await method(request, timeout=RPC_TIMEOUT)
        except grpc.aio.AioRpcError as error:
            if error.code() not in RETRIED or time.monotonic() >= give_up:
                raise
            totals.retries += 1
            await asyncio.sleep(random.uniform(0, min(2.0, 0.05 * 2**attempt)))
            attempt += 1


async def client(index: int, target: str, parameters: int, stop: asyncio.Event, totals: Totals, seed: int) -> None:
    rng = np.random.default_rng(seed + index)
    initial = tensor_to_proto(rng.normal(scale=0.01, size=parameters).astype(np.float32))
    gradient = tensor_to_proto(rng.normal(scale=0.001, size=parameters).astype(np.float32))
    spec = [pb.ParameterSpec(name="w", shape=[parameters], dtype=pb.DTYPE_FLOAT32)]
    async with grpc.aio.insecure_channel(
        target, options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        stub = pb_grpc.ParameterServerStub(channel)
        worker_id, version, commits = "", 0, 0
        try:
            while not stop.is_set():
                if not worker_id or (commits % CHURN_EVERY == 0 and commits):
                    if worker_id:
                        await call(stub.Leave, pb.LeaveRequest(worker_id=worker_id), totals)
                    reply = await call(
                        stub.Register,
                        pb.RegisterRequest(spec=spec, initial_parameters=initial, worker_name=f"soak-{index}"),
                        totals,
                    )
                    worker_id, version = reply.worker_id, reply.version
                    totals.registrations += 1
                request = pb.CommitRequest(
                    worker_id=worker_id,
                    base_version=version,
                    kind=pb.PAYLOAD_KIND_GRADIENT,
                    payload=gradient,
                    loss=1.0,
                    num_samples=64,
                    request_id=uuid.uuid4().hex,
                )
                result = await call(stub.Commit, request, totals)
                version = result.version
                commits += 1
                totals.acked += 1
                if commits % PULL_EVERY == 0:
                    pulled = await call(stub.Pull, pb.PullRequest(worker_id=worker_id, known_version=version), totals)
                    version = pulled.version
                    totals.pulls += 1
            if worker_id:
                await call(stub.Leave, pb.LeaveRequest(worker_id=worker_id), totals)
        except grpc.aio.AioRpcError as error:
            totals.errors.append(f"client {index}: {error.code().name}: {error.details()}")


async def sample_memory(pid: int, started: float, stop: asyncio.Event, interval: float, out: list[list[float]]) -> None:
    while True:
        out.append([round(time.monotonic() - started, 2), rss_bytes(pid)])
        try:
            await asyncio.wait_for(stop.wait(), interval)
            return
        except asyncio.TimeoutError:
            pass


def memory_growth(samples: list[list[float]], warmup: float) -> dict[str, float]:
    after = [rss for t, rss in samples if t >= warmup]
    if len(after) < 10:
        raise RuntimeError(f"only {len(after)} memory samples after warm-up: run longer")
    tenth = max(1, len(after) // 10)
    baseline = statistics.median(after[:tenth])
    end = statistics.median(after[-tenth:])
    return {
        "rss_baseline_mb": round(baseline / 2**20, 2),
        "rss_end_mb": round(end / 2**20, 2),
        "rss_peak_after_warmup_mb": round(max(after) / 2**20, 2),
        "rss_growth_pct": round(100 * (end - baseline) / baseline, 3),
    }


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    checkpoints = tempfile.TemporaryDirectory(prefix="gemps-soak-")
    server = ServerProcess(
        max_workers=max(256, args.clients),
        checkpoint_dir=checkpoints.name,
        checkpoint_every=args.checkpoint_every,
        log_path=Path(args.out).with_suffix(".server.log") if args.keep_log else None,
    ).start()
    totals = Totals()
    samples: list[list[float]] = []
    stop, stop_sampling = asyncio.Event(), asyncio.Event()
    started = time.monotonic()
    sampler = asyncio.create_task(sample_memory(server.pid, started, stop_sampling, args.sample_interval, samples))
    try:
        tasks = [
            asyncio.create_task(client(i, server.target, args.parameters, stop, totals, args.seed))
            for i in range(args.clients)
        ]
        progress_at = started
        while time.monotonic() - started < args.duration:
            await asyncio.sleep(min(1.0, args.duration - (time.monotonic() - started)))
            if time.monotonic() - progress_at >= 30:
                progress_at = time.monotonic()
                print(
                    f"{progress_at - started:6.0f}s  acked {totals.acked}  rss {samples[-1][1] / 2**20:.1f} MiB  "
                    f"errors {len(totals.errors)}",
                    file=sys.stderr,
                )
        stop.set()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - started
        stop_sampling.set()
        await sampler
        async with grpc.aio.insecure_channel(server.target) as channel:
            status = await pb_grpc.ParameterServerStub(channel).Status(pb.StatusRequest(), timeout=RPC_TIMEOUT)
        metrics = scrape(server.metrics_port)
    finally:
        stop.set()
        stop_sampling.set()
        exit_code = server.stop()
        log = server.log()
        checkpoints.cleanup()
    warmup = args.duration * args.warmup
    memory = memory_growth(samples, warmup)
    result: dict[str, Any] = {
        "clients": args.clients,
        "duration_s": round(elapsed, 1),
        "parameters": args.parameters,
        "warmup_s": warmup,
        "commits_acked": totals.acked,
        "server_commits_applied": status.commits_applied,
        "server_commits_rejected": status.commits_rejected,
        "server_version": status.version,
        "commits_per_second": round(totals.acked / elapsed, 1),
        "registrations": totals.registrations,
        "pulls": totals.pulls,
        "retries": totals.retries,
        "duplicates_answered": metrics.get("gemps_duplicate_commits_total", math.nan),
        "checkpoints_written": metrics.get('gemps_checkpoints_total{outcome="written"}', math.nan),
        "errors": len(totals.errors),
        "error_samples": totals.errors[:10],
        "server_exit_code": exit_code,
        "server_tracebacks": log.count("Traceback"),
        **memory,
        "rss_samples": [[t, round(rss / 2**20, 2)] for t, rss in samples],
    }
    result["rss_limit_pct"] = args.max_growth_pct
    result["criteria"] = {
        "no_errors": result["errors"] == 0 and result["server_tracebacks"] == 0,
        "acked_equals_applied": totals.acked == status.commits_applied,
        "rss_growth_within_limit": memory["rss_growth_pct"] < args.max_growth_pct,
        "clean_shutdown": exit_code == 0,
    }
    result["passed"] = all(result["criteria"].values())
    return result


def scrape(port: int) -> dict[str, float]:
    """The server's /metrics as {series: value} (only what this script reads)."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=RPC_TIMEOUT) as reply:
        text = reply.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--parameters", type=int, default=50_000, help="size of the central variable")
    parser.add_argument("--warmup", type=float, default=0.2, help="fraction of the duration before memory counts")
    parser.add_argument(
        "--max-growth-pct",
        type=float,
        default=RSS_LIMIT_PCT,
        help="RSS growth after warm-up that fails the run, in %% (short runs see the allocator settle, not a leak)",
    )
    parser.add_argument("--sample-interval", type=float, default=1.0, help="seconds between memory samples")
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-log", action="store_true", help="keep the server log next to --out")
    parser.add_argument("--out", default="docs/results/soak.json")
    args = parser.parse_args(argv)
    result = asyncio.run(soak(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    summary = {k: v for k, v in result.items() if k != "rss_samples"}
    print(json.dumps(summary, indent=1))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
