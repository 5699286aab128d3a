"""Memory admission of registrations (issue 49, item 4): the rule's per-worker state is allocated
before the worker enters the registry, a registration past the memory budget is refused
RESOURCE_EXHAUSTED (memory_budget) and one whose allocation fails anyway (a real MemoryError, under
a real RLIMIT_AS in a child process) out_of_memory; either way nothing is left behind: no worker,
no rule state, no journal entry, no θ initialised by a refused first worker."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from gemps_cli.partitions import child_config

from gemps_proto.reasons import Reason
from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_server.domain.errors import ResourceExhausted
from gemps_server.domain.journal import Joined
from gemps_server.domain.records import Commit
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.memory_budget import GIB, MIB, Headroom, MemoryBudget, cgroup, headroom
from tests.helpers import KeptJournal as Entries
from tests.helpers import encoded, replication_secret_file, server_config, training
from tests.unit.test_journal_replay import Clock

P = 1 << 17  # θ of 512 KiB: GEM holds 1 MiB (m_i and s_i) per worker
SPEC = (ParameterSpec("w", (P,)),)
THETA = np.linspace(-1.0, 1.0, P, dtype=np.float32)


def new_state(budget: MemoryBudget, clock: Clock | None = None) -> tuple[ServerState, Entries]:
    registry = WorkerRegistry(8, lease_ttl=10.0, clock=clock or Clock())
    state = ServerState(training("gem", learning_rate=0.1), registry, memory=budget)
    journal = Entries()
    state.core.journal = journal
    return state, journal


def refused(state: ServerState, reason: Reason, client_id: str = "") -> str:
    initial = None if state.core.initialized else encoded(THETA)
    with pytest.raises(ResourceExhausted) as refusal:
        state.register("late", SPEC, initial, client_id=client_id)
    assert refusal.value.reason is reason
    return refusal.value.message


def gradient(state: ServerState, worker_id: str, request_id: str) -> None:
    payload = encoded(np.ones(P, np.float32))
    state.core.commit_record(
        Commit(worker_id, state.core.version, PayloadKind.GRADIENT, payload, request_id=request_id)
    )


def test_a_registration_past_the_memory_budget_is_refused_and_leaves_nothing() -> None:
    state, journal = new_state(MemoryBudget(2))  # two workers' GEM state
    first = state.register("a", SPEC, encoded(THETA)).worker
    second = state.register("b", SPEC, None).worker
    gradient(state, first.worker_id, "1")
    theta = state.core.theta_copy()
    message = refused(state, Reason.MEMORY_BUDGET)
    assert "--memory-budget-mb" in message and "2 MiB (--memory-budget-mb)" in message
    assert len(state.registry) == 2 and state.rule_state_bytes == 2 * MIB
    assert [entry.worker_id for entry in journal.entries if isinstance(entry, Joined)] == [
        first.worker_id,
        second.worker_id,
    ]
    assert np.array_equal(state.core.theta_copy(), theta) and state.core.version == 1
    gradient(state, second.worker_id, "2")  # the earlier workers are untouched
    state.leave(first.worker_id)
    assert state.register("c", SPEC, None).worker.slot == first.slot  # room again


def test_a_backup_replaying_the_journal_holds_exactly_the_admitted_workers() -> None:
    primary, journal = new_state(MemoryBudget(2))
    primary.register("a", SPEC, encoded(THETA))
    primary.register("b", SPEC, None)
    refused(primary, Reason.MEMORY_BUDGET)
    backup, _ = new_state(MemoryBudget(probe=lambda: None))  # replays what the primary decided
    for entry in journal.entries:
        backup.replay(entry)
    assert backup.registry.export() == primary.registry.export()
    assert backup.rule_state_bytes == primary.rule_state_bytes == 2 * MIB


def test_a_first_worker_the_budget_cannot_hold_leaves_theta_uninitialised() -> None:
    # No room at all, as the probe finds it when θ is initialised.
    state, journal = new_state(MemoryBudget(probe=lambda: Headroom(0, "a test's probe")))
    message = refused(state, Reason.MEMORY_BUDGET)
    assert "a test's probe" in message
    assert not state.core.initialized and state.core.num_parameters == 0 and not state.spec
    assert len(state.registry) == 0 and journal.entries == []


def test_a_full_budget_gives_the_idlest_workers_place_to_a_newcomer() -> None:
    clock = Clock()
    state, _ = new_state(MemoryBudget(2), clock=clock)
    idle = state.register("idle", SPEC, encoded(THETA)).worker
    busy = state.register("busy", SPEC, None).worker
    clock.now = 11.0  # past the lease since either committed
    gradient(state, busy.worker_id, "1")
    outcome = state.register("new", SPEC, None)
    assert outcome.displaced is not None and outcome.displaced.worker_id == idle.worker_id
    assert {w.name for w in state.registry.listing()} == {"busy", "new"}


def test_a_client_registering_again_on_a_full_budget_replaces_its_registration() -> None:
    state, _ = new_state(MemoryBudget(2))
    state.register("a", SPEC, encoded(THETA), client_id="a")
    again = state.register("b", SPEC, None, client_id="b")
    assert state.register("b", SPEC, None, client_id="b").worker.worker_id != again.worker.worker_id
    assert len(state.registry) == 2
    refused(state, Reason.MEMORY_BUDGET, client_id="c")


def test_the_budget_is_what_the_process_may_use_less_a_reserve_for_theta() -> None:
    budget = MemoryBudget(probe=lambda: Headroom(1024 * MIB, "a test's probe"))
    assert budget.bytes is None  # nothing known before θ is
    budget.settle(theta_bytes=64 * MIB, per_worker=128 * MIB, max_workers=256)
    assert budget.bytes == 1024 * MIB - 4 * 64 * MIB - 256 * MIB
    assert budget.workers(128 * MIB) == 4
    assert "a test's probe" in budget.describe()


# Registers GEM workers of 8M parameters (64 MiB of rule state each) under an address-space limit
# 600 MiB above what the process holds, until one is refused; what the state holds then.
UNDER_A_LIMIT = textwrap.dedent(
    """
    import json, resource
    import numpy as np
    from gemps_proto.schema import ParameterSpec
    from gemps_server.domain.errors import ResourceExhausted
    from gemps_server.domain.state import ServerState
    from gemps_server.domain.workers import WorkerRegistry
    from gemps_server.memory_budget import MemoryBudget, _status_kib
    from tests.helpers import encoded, training

    P = 8 << 20
    spec = (ParameterSpec("w", (P,)),)
    initial = encoded(np.ones(P, np.float32))
    state = ServerState(training("gem"), WorkerRegistry(64, 60.0), memory=MemoryBudget({budget}))
    limit = _status_kib("VmSize") * 1024 + 600 * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    refusal, admitted = None, 0
    try:
        for index in range(64):
            state.register(f"w{{index}}", spec, initial if index == 0 else None)
            admitted += 1
    except ResourceExhausted as error:
        refusal = str(error.reason)
    except MemoryError:
        refusal = "MemoryError"
    print(json.dumps({{"refusal": refusal, "admitted": admitted, "registered": len(state.registry),
                      "rule_workers": len(state.core.rule._workers), "theta": float(state.core.theta[0])}}))
    """
)


@pytest.mark.parametrize(("budget_mb", "reason"), [(0, Reason.MEMORY_BUDGET), (1 << 20, Reason.OUT_OF_MEMORY)])
def test_under_a_real_address_space_limit_a_refused_registration_leaves_no_worker(
    budget_mb: int, reason: Reason
) -> None:
    """The budget settled from RLIMIT_AS refuses before the allocation fails; with a budget larger
    than the memory (1 TiB) the allocation's real MemoryError is refused out_of_memory. Before the
    fix the MemoryError escaped and the registry kept the worker whose state was never allocated."""
    ran = subprocess.run(
        [sys.executable, "-c", UNDER_A_LIMIT.format(budget=budget_mb)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    held = json.loads(ran.stdout)
    assert held["refusal"] == reason.value, held
    assert held["registered"] == held["rule_workers"] == held["admitted"] >= 1, held
    assert held["theta"] == 1.0


def test_headroom_names_the_address_space_limit_it_runs_under() -> None:
    probe = "from gemps_server.memory_budget import headroom; h = headroom(); print(h.bytes, h.source)"
    limit = 8 << 30
    ran = subprocess.run(
        ["prlimit", f"--as={limit}", sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    free, source = ran.stdout.split(" ", 1)
    assert "RLIMIT_AS 8192 MiB" in source and 0 < int(free) < limit
    assert headroom() is not None  # unlimited here: the host's available memory at least


@pytest.mark.parametrize("version", [1, 2])
def test_the_cgroup_limit_is_read_where_the_process_belongs(version: int, tmp_path: Path) -> None:
    membership = tmp_path / "cgroup"
    if version == 2:
        membership.write_text("0::/kubepods/pod1\n")
        folder, names = tmp_path / "kubepods" / "pod1", ("memory.max", "memory.current")
    else:
        membership.write_text("5:cpu,cpuacct:/job\n4:memory:/job\n")
        folder, names = tmp_path / "memory" / "job", ("memory.limit_in_bytes", "memory.usage_in_bytes")
    folder.mkdir(parents=True)
    (folder / names[0]).write_text(f"{4096 * MIB}\n")
    (folder / names[1]).write_text(f"{1024 * MIB}\n")
    found = cgroup(tmp_path, membership)
    assert found == Headroom(3072 * MIB, "its cgroup's memory limit (4096 MiB)")
    (folder / names[0]).write_text("max\n" if version == 2 else f"{(1 << 63) - 4096}\n")  # no limit
    assert cgroup(tmp_path, membership) is None


def test_servers_sharing_a_host_each_admit_their_share_of_it() -> None:
    """Issue 61 item 9: three partitions on one machine each admitted what the whole host could
    hold (together 4.1x the host with a second job), their rule state being allocated lazily. The
    processes one `gemps server` starts each take 1/(partitions x replicas) of it."""
    host = Headroom(12 * GIB, "the host's available memory")
    alone, shared = MemoryBudget(probe=lambda: host), MemoryBudget(probe=lambda: host, share=3)
    for budget in (alone, shared):
        budget.settle(theta_bytes=4 * MIB, per_worker=8 * MIB, max_workers=4096)
    assert alone.bytes is not None and shared.bytes is not None
    reserve = 12 * GIB - alone.bytes  # θ's copies, kept out of the budget alike
    assert shared.bytes == 12 * GIB // 3 - reserve
    assert "a 1/3 share of the host's available memory" in shared.describe()
    supervised = server_config(partitions=3, replicas=2, replication_secret_file=replication_secret_file())
    etcd = "http://etcd:2379"
    children = [child_config(supervised, i, ",:1,:2", replica, etcd) for i in range(3) for replica in range(2)]
    assert {child.memory_share for child in children} == {6}
