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

from gemps_worker.on_ray.faults import JobFailed
from gemps_worker.on_ray.job import RayJob
from gemps_worker.on_ray.options import RayJobOptions
from gemps_worker.on_ray.records import WorkerContext
from gemps_worker.on_ray.run import RayJobResult, run_job

__all__ = ["JobFailed", "RayJob", "RayJobOptions", "RayJobResult", "WorkerContext", "run_job"]
