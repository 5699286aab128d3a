"""Which runs make up the paper's comparisons (full) and the reduced version CI runs (quick)."""

from __future__ import annotations

from gemps_worker.experiment.runner import RunConfig

WORKER_COUNTS = (5, 10, 20, 30, 100)
COMPARED_RULES = ("gem", "downpour", "adaptive-staleness")
# The worker count used for the kappa and worker-mode comparisons.
REFERENCE_WORKERS = 30
# Worker counts for the misspecified learning rate: 10, where DOWNPOUR still trains at eta = 0.05,
# and the reference count.
ETA_WORKERS = (10, REFERENCE_WORKERS)
MISSPECIFIED_ETA = 0.1


def full_suite(epochs: int = 10) -> list[RunConfig]:
    runs = [RunConfig("momentum-n1", "momentum", 1, epochs=epochs)]
    runs += [RunConfig(f"{rule}-n{n}", rule, n, epochs=epochs) for n in WORKER_COUNTS for rule in COMPARED_RULES]
    eta = MISSPECIFIED_ETA
    runs.append(RunConfig(f"momentum-n1-eta{eta:g}", "momentum", 1, learning_rate=eta, epochs=epochs))
    for n in ETA_WORKERS:
        runs += [
            RunConfig(f"{rule}-n{n}-eta{eta:g}", rule, n, learning_rate=eta, epochs=epochs)
            for rule in ("gem", "downpour")
        ]
    n = REFERENCE_WORKERS
    runs += [RunConfig(f"gem-n{n}-kappa{k}", "gem", n, kappa=float(k), epochs=epochs) for k in (2, 3, 4)]
    # Worker-side modes commit updates; the server adds them as they come (downpour).
    runs += [
        RunConfig(f"agn-n{n}", "downpour", n, mode="agn", epochs=epochs),
        # EASGD is stable for alpha = beta / p with beta = 0.9 (Zhang et al. 2015): p elastic pulls.
        RunConfig(f"easgd-n{n}", "downpour", n, mode="easgd", easgd_alpha=0.9 / n, epochs=epochs),
    ]
    return runs


def quick_suite() -> list[RunConfig]:
    """A few workers, few steps: checks the whole pipeline, not the paper's claims."""
    return [
        RunConfig("momentum-n1", "momentum", 1, epochs=2),
        RunConfig("gem-n4", "gem", 4, epochs=2),
        RunConfig("downpour-n4", "downpour", 4, epochs=2),
        RunConfig("adaptive-staleness-n4", "adaptive-staleness", 4, epochs=2),
        RunConfig("agn-n4", "downpour", 4, mode="agn", epochs=2),
    ]


SUITES = {"full": full_suite, "quick": quick_suite}
