"""The bound on shared memory the local data-plane connections attach together (--max-shared-memory,
server/gemps_server/wire/shared_memory.py): its auto value, its refusal, its bytes given back."""

from __future__ import annotations

import pytest

from gemps_proto.reasons import Reason
from gemps_server.domain.errors import ResourceExhausted
from gemps_server.memory_budget import GIB, MIB, Headroom
from gemps_server.metrics import ServerMetrics
from gemps_server.wire.shared_memory_budget import PER_WORKER, SharedMemoryBudget

THETA = 4 * MIB  # P = 1M
MAX_WORKERS = 256


METRICS = ServerMetrics()


def budget(configured: int = 0, memory_budget: int = 0, room: int | None = None) -> SharedMemoryBudget:
    probe = (lambda: None) if room is None else (lambda: Headroom(room, "the host's available memory"))
    return SharedMemoryBudget(configured, METRICS, MAX_WORKERS, memory_budget, probe)


def gauge(name: str) -> float:
    value = METRICS.registry.get_sample_value(name)
    assert value is not None
    return value


@pytest.mark.parametrize(
    ("configured", "memory_budget", "room", "bound"),
    [
        (64 * MIB, 0, 1 * MIB, 64 * MIB),  # set: as set, whatever the room
        (0, 0, None, MAX_WORKERS * THETA),  # auto, no limit readable: a θ for each of --max-workers
        (0, 0, 16 * GIB, MAX_WORKERS * THETA),  # auto, room to spare: the same
        (0, 0, 100 * MIB, 50 * MIB),  # auto, little room: half of it
        (0, 40 * MIB, 16 * GIB, 20 * MIB),  # auto, --memory-budget-mb set: half of that
    ],
)
def test_the_bound_is_as_set_or_a_theta_per_worker_at_most_half_the_room(
    configured: int, memory_budget: int, room: int | None, bound: int
) -> None:
    shared = budget(configured, memory_budget, room)
    assert shared.settle(THETA) == bound
    assert gauge("gemps_data_plane_shared_memory_limit_bytes") == bound


def test_past_the_bound_an_attach_is_refused_naming_the_option_and_bytes_come_back_once() -> None:
    shared = budget(configured=3 * THETA)
    releases = [shared.reserve(THETA, THETA, owner) for owner in "abc"]
    assert gauge("gemps_data_plane_shared_memory_bytes") == 3 * THETA
    with pytest.raises(ResourceExhausted) as refused:
        shared.reserve(THETA, THETA, "d")
    assert refused.value.reason is Reason.SHARED_MEMORY_LIMIT
    assert "3 local connections have 12 MiB attached" in refused.value.message
    assert "--max-shared-memory" in refused.value.message
    releases[0]()
    releases[0]()  # given back once, however often it is called
    assert shared.attached == 2 * THETA and shared.regions == 2
    shared.reserve(THETA, THETA, "d")
    assert gauge("gemps_data_plane_shared_memory_bytes") == 3 * THETA


def test_a_worker_has_at_most_two_regions_attached_at_once() -> None:
    shared = budget(configured=10 * THETA)
    first = [shared.reserve(THETA, THETA, "w") for _ in range(PER_WORKER)]
    with pytest.raises(ResourceExhausted) as refused:
        shared.reserve(THETA, THETA, "w")
    assert refused.value.reason is Reason.SHARED_MEMORY_LIMIT and "at most 2 a worker" in refused.value.message
    shared.reserve(THETA, THETA, "another")  # within the bound: another worker's is taken
    first[0]()
    shared.reserve(THETA, THETA, "w")  # one given back: room for this worker's again
