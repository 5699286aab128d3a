"""The load of a `gemps bench --replicas` run on its replicas (gemps_bench.replica_servers), and
what it measures beside the load's own figures: the replicas' processes under py-spy, the bytes
the replicas' direct cables carried."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from gemps_bench.cross_host import LOAD_GRACE
from gemps_bench.loadgen import LoadPlan
from gemps_bench.results import LoadResult
from gemps_worker.simulated_hosts import Host


def sent_bytes(host: Host, device: str) -> int:
    """Bytes `device` inside `host` has sent."""
    found = subprocess.run(
        ["ip", "-n", host.namespace, "-s", "-j", "link", "show", "dev", device],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(json.loads(found.stdout)[0]["stats64"]["tx"]["bytes"])


def load_in(host: Host, target: str, plan: LoadPlan, pids: Sequence[int]) -> LoadResult:
    """The cross-host bench's load process (gemps' clients) inside `host`."""
    argv = [
        *(sys.executable, "-m", "gemps_bench.cross_host", "--system", "gemps", "--target", target),
        *("--size", str(plan.num_parameters), "--clients", str(plan.clients)),
        *("--warmup", str(plan.warmup), "--window", str(plan.duration)),
        *("--server-pids", ",".join(str(pid) for pid in pids)),
    ]
    done = subprocess.run(
        host.command(argv), capture_output=True, text=True, timeout=plan.warmup + plan.duration + LOAD_GRACE
    )
    if done.returncode != 0:
        raise RuntimeError(f"the load process exited with {done.returncode}: {done.stderr[-2000:]}")
    return LoadResult(**json.loads(done.stdout.splitlines()[-1]))


@contextlib.contextmanager
def recording(pids: Sequence[int], plan: LoadPlan, profile: Path | None) -> Iterator[None]:
    """With `profile` (a file name's stem): py-spy on each of `pids` (the primary first) for the
    load's warm-up and window, raw samples by thread to STEM-primary.txt, STEM-backup1.txt, ..."""
    if profile is None:
        yield
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    seconds = str(max(1, int(plan.warmup + plan.duration)))
    recorders = []
    for index, pid in enumerate(pids):
        raw = profile.with_name(f"{profile.name}-{'primary' if index == 0 else f'backup{index}'}.txt")
        command = [spy, "record", "--pid", str(pid), "--duration", seconds, "--rate", "100"]
        command += ["--threads", "--native", "--format", "raw", "--output", str(raw)]
        recorders.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
    try:
        yield
    finally:
        for recorder in recorders:
            try:
                recorder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                recorder.kill()
                recorder.wait()


def primary_first(pids: list[int], primary: int) -> list[int]:
    return [pids[primary], *(pid for index, pid in enumerate(pids) if index != primary)]
