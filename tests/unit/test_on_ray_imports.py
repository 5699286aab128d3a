"""A partition's actor process imports `gemps_worker.on_ray.actors` through its package: that brings
neither torch nor the job's modules into an actor that never trains (2.1 s of CPU and 180 MB a life
before). The package's names still come from it as its docstring shows."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("ray")

import gemps_worker.on_ray as on_ray
from gemps_worker.on_ray import faults, job, options, records, run

HEAVY = ("torch", "gemps_worker.models", "gemps_worker.on_ray.job")


def test_the_partition_actors_module_imports_without_torch_or_the_job() -> None:
    code = f"import sys, gemps_worker.on_ray.actors; print([m for m in {HEAVY!r} if m in sys.modules])"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert found.strip() == "[]", found


def test_the_packages_names_are_those_of_their_modules() -> None:
    assert on_ray.RayJob is job.RayJob and on_ray.RayJobOptions is options.RayJobOptions
    assert on_ray.JobFailed is faults.JobFailed and on_ray.WorkerContext is records.WorkerContext
    assert on_ray.run_job is run.run_job and on_ray.RayJobResult is run.RayJobResult
    assert set(on_ray.__all__) <= set(dir(on_ray))
    with pytest.raises(AttributeError, match="has no attribute 'RayJobs'"):
        on_ray.RayJobs  # noqa: B018
