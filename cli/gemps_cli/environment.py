"""GEMPS_* variables that configure nothing: a warning naming the closest option, or with
--strict-env (or GEMPS_STRICT_ENV=1) an error before the command starts.

Containers and Kubernetes configure gemps through the environment alone, where a misspelled
variable (GEMPS_LERNING_RATE) would otherwise leave its option at the default without a word. One
environment (a compose file's, a ConfigMap's) often serves several commands, so a variable is
known when it is an option of any gemps command, or one of the variables read elsewhere
(NOT_OPTIONS), not only of the command that runs.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from collections.abc import Mapping

from gemps import options, variables
from gemps_server.config import ServerConfig
from gemps_server.domain.rules import rule_catalog

log = logging.getLogger("gemps.config")

STRICT_VARIABLE = "GEMPS_STRICT_ENV"

# The options of the commands that train (worker, evaluate, demo, ray) that the server lacks.
# Written out because their dataclasses import torch, which `gemps server` must not;
# tests/unit/test_env_options.py keeps this equal to what those dataclasses declare.
TRAINING_OPTIONS = frozenset(
    {
        "GEMPS_ADDRESS",
        "GEMPS_AGN_STEPS",
        "GEMPS_BATCH_DELAY",
        "GEMPS_COMPRESSION",
        "GEMPS_DATASET",
        "GEMPS_DATA_DIR",
        "GEMPS_DEVICE",
        "GEMPS_DOWNLOAD",
        "GEMPS_DYLU_STEPS",
        "GEMPS_DYNSGD_STEPS",
        "GEMPS_EASGD_ALPHA",
        "GEMPS_EASGD_PERIOD",
        "GEMPS_EPOCHS",
        "GEMPS_EVALUATE",
        "GEMPS_EVALUATOR_CPUS",
        "GEMPS_INTERVAL",
        "GEMPS_LOCAL_LEARNING_RATE",
        "GEMPS_LOCAL_OPTIMIZER",
        "GEMPS_LOG_EVERY",
        "GEMPS_MAX_EVALUATIONS",
        "GEMPS_MAX_SECONDS",
        "GEMPS_MAX_STEPS",
        "GEMPS_MODE",
        "GEMPS_MODEL",
        "GEMPS_NAME",
        "GEMPS_OUT",
        "GEMPS_OUTER_LEARNING_RATE",
        "GEMPS_OVERLAP",
        "GEMPS_PACK_REPLICAS",
        "GEMPS_PARTITION_CPUS",
        "GEMPS_PARTITION_RESTARTS",
        "GEMPS_PATIENCE",
        "GEMPS_PLANE",
        "GEMPS_REPLY_COMPRESSION",
        "GEMPS_REPORT_FILE",
        "GEMPS_SEED",
        "GEMPS_SERVER",
        "GEMPS_STARTUP_TIMEOUT",
        "GEMPS_SUPERVISE",
        "GEMPS_THREADS",
        "GEMPS_WIRE_DTYPE",
        "GEMPS_WORKERS",
        "GEMPS_WORKER_CPUS",
        "GEMPS_WORKER_GPUS",
        "GEMPS_WORKER_RESTARTS",
        "GEMPS_WORK_DIR",
    }
)


@functools.cache  # what the code declares: the same for the process' life (NOT_OPTIONS asks once a name)
def known_options() -> frozenset[str]:
    """Every GEMPS_* variable that is an option of some gemps command."""
    server = options.options_of(ServerConfig, rule_catalog().fields)
    return TRAINING_OPTIONS | {options.env_var(f.name) for f in server}


# GEMPS_* variables that are no command's option, and who reads them (the SDK's others, such as
# GEMPS_PLANE, and docker compose's GEMPS_WORKER_CPUS are options of `gemps worker` and `gemps ray`).
NOT_OPTIONS: Mapping[str, str] = {
    STRICT_VARIABLE: "this check",
    **{name: "the SDK" for name in variables.READ_BY_THE_SDK if name not in known_options()},  # the reference says how
    "GEMPS_BIND_ADDRESS": "docker compose: the host address ports are published on",
    "GEMPS_HOST_PORT": "docker compose: a host port",
    "GEMPS_HOST_DATA_PORT": "docker compose: a host port",
    "GEMPS_HOST_PORT_1": "docker compose (replicas): a host port",
    "GEMPS_HOST_DATA_PORT_1": "docker compose (replicas): a host port",
    "GEMPS_WORKER_MEMORY": "docker compose: a worker container's memory limit",
    "GEMPS_EVAL_INTERVAL": "docker compose: the evaluator's GEMPS_INTERVAL",
    "GEMPS_REQUIRE_ETCD": "the tests: fail, not skip, without etcd",
    "GEMPS_REQUIRE_PROMETHEUS": "the tests: fail, not skip, without Prometheus",
    "GEMPS_REQUIRE_CONTAINERS": "the tests: fail, not skip, without the container tests' base images (CI)",
    "GEMPS_REQUIRE_PEERS": "the tests: fail, not skip, without the comparison peers' virtualenv (CI)",
    "GEMPS_SKIP_CONTAINER_TESTS": "the tests: skip the container tests",
    "GEMPS_TEST_CRASH_FROM": "the tests: a server that crashes on purpose",
    "GEMPS_COUNT_CALLS": "scripts/profile_server.py --count-calls: a server counting its data plane's calls",
    "GEMPS_CONTAINER_RIG": "tools/install-system-deps",
    "GEMPS_TOOLS_DIR": "tools/install-system-deps",
    "GEMPS_TOOLS_BIN": "tools/install-system-deps",
}


def add_strict_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--strict-env",
        action="store_true",
        default=None,
        help=f"an unknown GEMPS_* variable is an error (exit 2), not a warning (env {STRICT_VARIABLE})",
    )


def screen(command: str, args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> bool:
    """Warn of each GEMPS_* variable nothing reads, naming the closest known one; with
    --strict-env or GEMPS_STRICT_ENV, say so on stderr and return False (the command exits 2)."""
    environ = os.environ if environ is None else environ
    try:
        strict = bool(getattr(args, "strict_env", None)) or options.parse_bool(environ.get(STRICT_VARIABLE, ""))
    except ValueError as error:
        print(f"gemps {command}: {STRICT_VARIABLE}: {error}", file=sys.stderr)
        return False
    unknown = options.unknown_variables(environ, known_options(), NOT_OPTIONS)
    if strict and unknown:
        print(f"gemps {command}: {'; '.join(map(str, unknown))}; strict: unknown variables are errors", file=sys.stderr)
        return False
    for variable in unknown:
        log.warning("%s; it is ignored", variable)
    return True
