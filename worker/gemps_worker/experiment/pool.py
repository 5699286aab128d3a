"""One process running many worker loops as threads, each its own Client and shard.

100 worker processes would need ~25 GB here (torch per process); threads share one torch and
one copy of the data. What differs from 100 containers: the loops share this process's GIL and
CPU cores, so per-worker step times stretch and staleness is set by the scheduler rather than by
independent machines; every worker still has its own connection, registration, lease, shard and
per-worker GEM state on the server.

    python -m gemps_worker.experiment.pool SPEC_JSON   (written by single_run.py)
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from gemps.client import Client
from gemps.errors import GempsError
from gemps.records import Registration
from gemps_proto.reasons import Reason
from gemps_worker.datasets import load_dataset
from gemps_worker.training import StepRecord, WorkerHooks, WorkerOptions, run_worker

# How long the pool waits for every worker of the run to register before training starts.
START_TIMEOUT = 300.0


@dataclass(frozen=True)
class PoolSpec:
    server: str
    first_index: int  # global index of this pool's first worker
    threads: int
    total_workers: int  # across all pools: training starts once all have registered
    options: dict[str, object]  # WorkerOptions fields shared by every loop
    records_path: str
    seed: int = 0  # the run's: worker k's data-order seed is seed * SEED_STRIDE + k


# Apart enough that no two runs' workers share a data-order seed (runs have far fewer workers).
SEED_STRIDE = 100_000


def data_seed(run_seed: int, index: int) -> int:
    """The data-order seed of the run's worker `index` (seed 0: the index, as before seeds)."""
    return run_seed * SEED_STRIDE + index


def wait_until_registered(server: str, count: int, timeout: float = START_TIMEOUT) -> None:
    """Until `count` workers have registered. A commit (version > 0) also tells: no worker trains
    before all have registered, and with few, short loops another pool's workers can register,
    train and leave between two polls of this one (it then waited START_TIMEOUT and lost its loops)."""
    deadline = time.monotonic() + timeout
    with Client(server) as client:
        while (status := client.status()).active_workers < count and status.version == 0:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {count} workers registered after {timeout:.0f}s")
            time.sleep(0.05)


def run_pool(spec: PoolSpec) -> int:
    torch.set_num_threads(1)
    base = WorkerOptions(**spec.options)  # type: ignore[arg-type]
    data = load_dataset(base.dataset, base.data_dir, base.download)
    barrier = threading.Barrier(spec.threads, action=lambda: wait_until_registered(spec.server, spec.total_workers))
    lock = threading.Lock()
    outcomes: dict[int, str] = {}
    with open(spec.records_path, "w") as records:

        def loop(index: int) -> None:
            def on_registered(registration: Registration) -> None:
                barrier.wait()  # all loops of all pools start training together

            def on_step(record: StepRecord) -> None:
                line = json.dumps({"worker": index, **asdict(record)})
                with lock:
                    records.write(line + "\n")

            options = WorkerOptions(**{**asdict(base), "seed": data_seed(spec.seed, index), "name": f"worker-{index}"})
            try:
                summary = run_worker(options, hooks=WorkerHooks(on_registered, on_step), data=data)
                outcome = "diverged" if summary.diverged else "done"
            except GempsError as error:  # e.g. the server refused a non-finite gradient
                outcome = "diverged" if error.reason == Reason.NON_FINITE else f"error: {error}"
                barrier.abort()
            except threading.BrokenBarrierError:
                outcome = "error: the run could not start (another worker failed to register)"
            except TimeoutError as error:  # raised by the barrier's action, in one loop's thread
                outcome = f"error: {error}"
                barrier.abort()
            with lock:
                outcomes[index] = outcome

        threads = [
            threading.Thread(target=loop, args=(spec.first_index + i,), name=f"worker-{spec.first_index + i}")
            for i in range(spec.threads)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    Path(spec.records_path + ".outcomes").write_text(json.dumps(outcomes))
    failed = {i: o for i, o in outcomes.items() if o.startswith("error")}
    for index, outcome in failed.items():
        print(f"worker {index}: {outcome}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(run_pool(PoolSpec(**json.loads(Path(sys.argv[1]).read_text()))))
