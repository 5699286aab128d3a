"""gemps on a Ray cluster (`pip install 'gemps[ray,server,torch]'`): the partitions, workers and evaluator of a
job as Ray actors, placed across nodes, restarted by Ray, collected to the driver.

    from gemps_worker.on_ray import RayJobOptions, run_job

    result = run_job(RayJobOptions(partitions=2, workers=8, epochs=4))
    result.final.accuracy, result.export.tensors  # held-out figures; θ by name

A user's training loop runs in the worker actors instead of the reference worker:

    def train(context):  # in each worker actor; the SDK unchanged
        optimizer = RemoteOptimizer(model, Client(context.target, stop=context.stop))  # follows partition 0
        ...

    run_job(RayJobOptions(workers=8, evaluate=False), train=train)

This package is the only part of gemps that imports Ray (an import-linter contract holds it to
that); `gemps ray` is its command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gemps_worker.on_ray.faults import JobFailed
    from gemps_worker.on_ray.job import RayJob
    from gemps_worker.on_ray.options import RayJobOptions
    from gemps_worker.on_ray.records import WorkerContext
    from gemps_worker.on_ray.run import RayJobResult, run_job

# Imported when first used, not with the package: a partition's actor process imports
# `gemps_worker.on_ray.actors` through it, and the job's modules would bring torch (the model zoo,
# for the options' model names) into an actor that never trains: 2.1 s of CPU and 180 MB a life here.
_HOMES = {
    "JobFailed": "gemps_worker.on_ray.faults",
    "RayJob": "gemps_worker.on_ray.job",
    "RayJobOptions": "gemps_worker.on_ray.options",
    "WorkerContext": "gemps_worker.on_ray.records",
    "RayJobResult": "gemps_worker.on_ray.run",
    "run_job": "gemps_worker.on_ray.run",
}
__all__ = ["JobFailed", "RayJob", "RayJobOptions", "RayJobResult", "WorkerContext", "run_job"]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
