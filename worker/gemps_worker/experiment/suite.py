"""Which runs make up the paper's comparisons (full) and the reduced version CI runs (quick)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gemps_proto.schema import TrainingConfig
from gemps_worker.experiment.runner import RunConfig

WORKER_COUNTS = (5, 10, 20, 30, 100)
COMPARED_RULES = ("gem", "downpour", "adaptive-staleness")
# The worker count used for the kappa and worker-mode comparisons.
REFERENCE_WORKERS = 30
# Worker counts for the misspecified learning rate: 10, where DOWNPOUR still trains at eta = 0.05,
# and the reference count.
ETA_WORKERS = (10, REFERENCE_WORKERS)
MISSPECIFIED_ETA = 0.1


def training(rule: str, **changes: Any) -> TrainingConfig:
    """The paper's training config (the defaults) with another rule and other changes."""
    return replace(TrainingConfig(rule=rule), **changes)


def full_suite(epochs: int = 10) -> list[RunConfig]:
    runs = [RunConfig("momentum-n1", 1, training("momentum"), epochs=epochs)]
    runs += [
        RunConfig(f"{rule}-n{n}", n, training(rule), epochs=epochs) for n in WORKER_COUNTS for rule in COMPARED_RULES
    ]
    eta = MISSPECIFIED_ETA
    runs.append(RunConfig(f"momentum-n1-eta{eta:g}", 1, training("momentum", learning_rate=eta), epochs=epochs))
    for n in ETA_WORKERS:
        runs += [
            RunConfig(f"{rule}-n{n}-eta{eta:g}", n, training(rule, learning_rate=eta), epochs=epochs)
            for rule in ("gem", "downpour")
        ]
    n = REFERENCE_WORKERS
    runs += [RunConfig(f"gem-n{n}-kappa{k}", n, training("gem", kappa=float(k)), epochs=epochs) for k in (2, 3, 4)]
    # Worker-side modes commit updates; the server adds them as they come (downpour).
    runs += [
        RunConfig(f"agn-n{n}", n, training("downpour", worker_mode="agn"), epochs=epochs),
        # EASGD is stable for alpha = beta / p with beta = 0.9 (Zhang et al. 2015): p elastic pulls.
        RunConfig(f"easgd-n{n}", n, training("downpour", worker_mode="easgd"), easgd_alpha=0.9 / n, epochs=epochs),
    ]
    return runs


def quick_suite() -> list[RunConfig]:
    """A few workers, few steps: checks the whole pipeline, not the paper's claims."""
    return [
        RunConfig("momentum-n1", 1, training("momentum"), epochs=2),
        RunConfig("gem-n4", 4, training("gem"), epochs=2),
        RunConfig("downpour-n4", 4, training("downpour"), epochs=2),
        RunConfig("adaptive-staleness-n4", 4, training("adaptive-staleness"), epochs=2),
        RunConfig("agn-n4", 4, training("downpour", worker_mode="agn"), epochs=2),
    ]
