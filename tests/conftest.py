"""What every test shares: how the suite is split between parallel runners (pytest-xdist).

`make test` runs the suite on several xdist workers with `--dist loadgroup`: a test with an
`xdist_group` runs on the one worker that runs its whole group, one test at a time, while the
other workers take the rest. The groups below are the tests that must not overlap with each
other: they share one machine-wide resource (podman's images and containers, a Ray cluster's
memory, the simulated hosts' links and the CPU they are measured with).

Tests that inject faults (killed processes, parted links, full disks, hostile peers) are marked
`faults`; `make test-fast` leaves them out for the inner loop. Tests whose figures need the
machine to themselves are marked `alone`: they run after the parallel run, one at a time.

The long suites' reduced runs are marked `long`: `make test` leaves them out, `make test-long` runs
them, and CI (.ci/run) runs both. They are the serial groups' modules (containers, Ray clusters,
simulated hosts), the `alone` tests, and the experiments and peers named in LONG_MODULES: 65 % of
the suite's test time in 31 of its 275 modules (2026-12-05), where `make test` must fit 25 minutes
on a host at half this one's speed (docs/guides/testing.md).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reserved_ports import reserve, restore

# The servers a run starts claim memory in a folder of this process's own (memory_claims.py): the
# servers of other runners and other runs on this host, whose models come and go, are not jobs to
# budget against (one claiming all the host would leave the others' budgets at nothing).
os.environ["GEMPS_MEMORY_CLAIMS_DIR"] = tempfile.mkdtemp(prefix="gemps-tests-memory-claims-")
atexit.register(shutil.rmtree, os.environ["GEMPS_MEMORY_CLAIMS_DIR"], ignore_errors=True)

# Module -> group: tests of one group never run at the same time as each other.
SERIAL_GROUPS = {
    "test_containers.py": "containers",
    "test_containers_partitioned.py": "containers",
    "test_containers_replicated.py": "containers",
    "test_getting_started.py": "containers",  # the tutorial's stack: podman's images and ports with the others
    "test_install_system_deps.py": "containers",  # reinstalls what the container tests run
    "test_ray.py": "ray",
    "test_ray_node_loss.py": "ray",
    "test_ray_replicas.py": "ray",
    "test_simulated_hosts.py": "hosts",
    "test_replica_faults.py": "hosts",
    "test_bench_cross_host.py": "hosts",
    "test_bench_replicas.py": "hosts",
    "test_jepsen_replicas.py": "hosts",
    "test_experiment_on_links.py": "hosts",
    "test_bench.py": "hosts",  # measures throughput: alone with the simulated hosts, not beside them
    "test_data_plane_patience.py": "hosts",
}

# Modules whose figures depend on having the machine to themselves (how many workers' steps
# interleave, so staleness, π and the noise scale the demo shows; a speed-up): `make test` runs them
# after the parallel run, alone.
# The tuning sweep too: it judges a recipe by training runs whose interleaving is the machine's. And
# the Ray replica tests, which count failovers: beside the soak's 100 clients partition 0's leases
# lapsed and its primary changed 3-4 times where one node loss means once (at 9682296 too).
# The rig's CI cells too: their CPU quotas add up to the machine (1.9 of 2 cores), so beside the
# parallel run its workers got less than their quotas (the cells took 209 s where 88 s alone, and
# gemps reached the CI target in 10.5 s where 3 s alone). The AdamW workers' comparison likewise
# (4 workers in 1.6 cores of quotas).
ALONE_MODULES = frozenset(
    {
        "test_experiment.py",
        "test_speedup_experiment.py",
        "test_demo.py",
        "test_tuning_sweep.py",
        "test_ray_replicas.py",
        "test_alternatives_rig.py",
        "test_adam_workers.py",
    }
)

# Long suites' reduced runs beyond the groups and the alone tests (`make test-long`): the comparison's
# peers (each run for a fixed deadline), the soak's 100 clients, and the experiments' scripts run
# reduced (the Adam replay, local steps' accuracy, the Trainer's classifier, the GPT-2 job on CPU,
# the noise scale along a run, ResNet's batch norm).
LONG_MODULES = frozenset(
    {
        "test_alternatives_peers.py",
        "test_soak.py",
        "test_adam_replay.py",
        "test_local_steps_accuracy.py",
        "test_hf_classifier.py",
        "test_gpu_job.py",
        "test_noise_scale_script.py",
        "test_resnet_batchnorm.py",
        *SERIAL_GROUPS,
        *ALONE_MODULES,
    }
)

# Modules whose tests inject faults (left out of `make test-fast`).
FAULT_MODULES = frozenset(
    {
        "test_chaos.py",
        "test_process_titles.py",
        "test_worker_patience.py",
        "test_replica_faults.py",
        "test_jepsen_replicas.py",
        "test_simulated_hosts.py",
        "test_shutdown.py",
        "test_data_plane_durability.py",
        "test_data_plane_patience.py",
        "test_data_plane_hostile.py",
        "test_data_plane_starvation.py",
        "test_hostile_budgets.py",
        "test_hostile_input.py",
        "test_hostile_options.py",
        "test_hostile_ownership.py",
        "test_hostile_slow_streams.py",
        "test_replication_hostile.py",
        "test_reliability_connections.py",
        "test_reliability_disk.py",
        "test_reliability_identity.py",
        "test_reliability_memory.py",
        "test_reliability_overflow.py",
        "test_reliability_tls_health.py",
        "test_worker_presence.py",
    }
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "faults: injects a fault (left out of `make test-fast`)")
    config.addinivalue_line("markers", "alone: needs the machine to itself (run after the rest, one at a time)")
    config.addinivalue_line("markers", "long: a long suite's reduced run (`make test-long`, which CI runs)")


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = Path(str(item.path)).name
        if module in SERIAL_GROUPS:
            item.add_marker(pytest.mark.xdist_group(SERIAL_GROUPS[module]))
        if module in ALONE_MODULES:
            item.add_marker(pytest.mark.alone)
        if module in FAULT_MODULES:
            item.add_marker(pytest.mark.faults)
        if module in LONG_MODULES or item.get_closest_marker("alone") is not None:  # alone: also a test's own mark
            item.add_marker(pytest.mark.long)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Each phase of `make test` and `make test-long` reads only the modules that can hold its tests:
    importing the whole suite to deselect all but 17 of its 2,169 tests took 24 s of CPU in the
    alone phase. None: other hooks and options still decide."""
    markexpr = config.getoption("markexpr")
    if not _is_test_module(collection_path):
        return None
    if markexpr == "not long":  # `make test`
        return True if collection_path.name in LONG_MODULES else None
    if markexpr == "long and not alone":  # `make test-long`'s parallel phase: elsewhere only alone tests are long
        return None if collection_path.name in LONG_MODULES else True
    if markexpr == "alone":  # its serial phase
        holds_alone = collection_path.name in ALONE_MODULES or "pytest.mark.alone" in collection_path.read_text()
        return None if holds_alone else True
    return None


def _is_test_module(path: Path) -> bool:
    return path.suffix == ".py" and path.name.startswith("test_") and path.is_file()


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: none without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """`--dist loadgroup`, the groups read from SERIAL_GROUPS by each test's module. xdist's own reads
    them from a suffix it writes into the test ids in the workers, which pytest 9.2 no longer keeps
    (pytest-xdist issue 1386): every test was its own unit, a group's tests ran on both workers at
    once (two container stacks on one host port, two Ray clusters), and a module's shared fixture
    was set up on each."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleGroups(LoadGroupScheduling):  # type: ignore[misc]  # xdist has no type information
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return SERIAL_GROUPS.get(module) or super()._split_scope(nodeid)

    return ModuleGroups(config, log)


@pytest.fixture(autouse=True, scope="session")
def etcd_ports_from_the_band() -> Iterator[None]:
    """The etcds a test process starts take their loopback ports from the suite's band
    (tests.helpers.free_port), as servers that restart on their port do: an etcd restarted on its
    ports (test_etcd_loss's, a private etcd started again on its data) leaves them free a moment,
    and in a fresh clone's run another etcd's client then met a peer listener there ("Method Not
    Allowed"). Ports of other hosts' addresses stay the kernel's."""
    from gemps_server.replication import local_etcd
    from tests.helpers import free_port

    ephemeral = local_etcd._free_port
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            local_etcd, "_free_port", lambda host="127.0.0.1": free_port() if host == "127.0.0.1" else ephemeral(host)
        )
        yield


def pytest_sessionstart(session: pytest.Session) -> None:
    """Once per run, in the process that leads it (not in each xdist worker)."""
    if not hasattr(session.config, "workerinput"):
        session.config.stash[_RESERVED] = reserve()


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not hasattr(session.config, "workerinput"):
        restore(session.config.stash.get(_RESERVED, None))


_RESERVED = pytest.StashKey[str | None]()
