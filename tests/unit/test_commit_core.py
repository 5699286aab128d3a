"""The commit core (domain/core.py): one commit through the primitive-typed entry, and a payload
in memory its client can still write (its shared memory), which the core reads where it lies only
when the rule holds what it reads to the checked peak and no journal must replay its bytes."""

from __future__ import annotations

import numpy as np

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import FLOAT32, EncodedTensor
from gemps_server.domain.journal import Committed, Entry
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, training

P = 4_000
THETA = np.linspace(-1.0, 1.0, P, dtype=np.float32)


class Entries:
    """A journal that keeps its entries (a replicated primary's stands in)."""

    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def append(self, entry: Entry) -> int:
        self.entries.append(entry)
        return len(self.entries)

    @property
    def last(self) -> int:
        return len(self.entries)

    @property
    def epoch(self) -> int:
        return 1


def registered(rule: str = "gem") -> tuple[ServerState, str]:
    state = ServerState(training(rule), WorkerRegistry(8, lease_ttl=60.0), RuleRuntime(gem_kernel="auto"))
    worker = state.register("w", (ParameterSpec("w", (P,)),), encoded(THETA), client_id="c").worker
    return state, worker.worker_id


def shared_payload(values: np.ndarray) -> tuple[np.ndarray, EncodedTensor]:
    """A writable float32 buffer (the client's memory) and the payload that views it."""
    memory = values.astype(np.float32).copy()
    return memory, EncodedTensor(FLOAT32, (P,), memory.data.cast("B"))


def commit_volatile(state: ServerState, worker_id: str, payload: EncodedTensor, request_id: str) -> None:
    slot, kind = state.registry.slot_of(worker_id), PayloadKind.GRADIENT.value
    state.core.commit(slot, worker_id, request_id, 0, state.version, kind, payload, FLOAT32, payload_volatile=True)


def test_a_shared_payload_gives_theta_the_bits_a_copied_one_gives() -> None:
    """Read where it lies (GEM's compiled pass holds it) or copied first: the same θ, bit for bit."""
    gradient = np.random.default_rng(0).standard_normal(P).astype(np.float32)
    results = []
    for volatile in (False, True):
        state, worker_id = registered()
        _, payload = shared_payload(gradient)
        slot = state.registry.slot_of(worker_id)
        kind = PayloadKind.GRADIENT.value
        state.core.commit(slot, worker_id, "r1", 1, 0, kind, payload, FLOAT32, payload_volatile=volatile)
        results.append(state.theta_copy())
    np.testing.assert_array_equal(results[0], results[1])


def test_a_shared_payload_is_copied_before_a_journal_records_it() -> None:
    """A replicated primary journals the bytes it applied: the client writing its memory after the
    commit changes nothing a backup will replay."""
    state, worker_id = registered()
    journal = Entries()
    state.journal = journal
    memory, payload = shared_payload(np.full(P, 0.5))
    commit_volatile(state, worker_id, payload, "r1")
    memory[:] = np.nan  # the client scribbles once the reply is out
    entry = journal.entries[-1]
    assert isinstance(entry, Committed)
    assert np.frombuffer(entry.commit.payload.data, np.float32).tolist() == [0.5] * P


def test_a_rule_that_cannot_hold_a_shared_payload_reads_a_copy() -> None:
    """downpour reads the payload with numpy (more than once): the core copies it first, so the
    checks and the step see the same values."""
    state, worker_id = registered("downpour")
    _, payload = shared_payload(np.full(P, 2.0))
    assert not state.rule.holds_payload  # type: ignore[union-attr]
    before = state.theta_copy()
    commit_volatile(state, worker_id, payload, "r1")
    assert state.core._landing[:P].tolist() == [2.0] * P  # what the step read: the core's own copy
    np.testing.assert_allclose(state.theta_copy(), before - 0.05 * 2.0, rtol=1e-6)
