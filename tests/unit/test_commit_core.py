"""The commit core (domain/core.py): one commit through the primitive-typed entry, and a payload
in memory its client can still write (its shared memory), which the core reads where it lies only
when the rule holds what it reads to the checked peak and no journal must replay its bytes."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import FLOAT32, EncodedBuffers, EncodedTensor
from gemps_server import native
from gemps_server.commit_frame import frame_of
from gemps_server.domain.journal import Committed, Entry
from gemps_server.domain.records import Commit, CommitOutcome
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import KeptJournal as Entries
from tests.helpers import encoded, training

P = 4_000
THETA = np.linspace(-1.0, 1.0, P, dtype=np.float32)


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
    state.core.commit(slot, worker_id, request_id, 0, state.core.version, kind, payload, FLOAT32, payload_volatile=True)


@pytest.mark.parametrize("rule", ["gem", "adamw"])
def test_a_shared_payload_gives_theta_the_bits_a_copied_one_gives(rule: str) -> None:
    """Read where it lies (GEM's compiled pass holds it, as adamw's passes do) or copied first: the
    same θ, bit for bit, and nothing copied into the core's landing when the rule holds it."""
    gradient = np.random.default_rng(0).standard_normal(P).astype(np.float32)
    results = []
    for volatile in (False, True):
        state, worker_id = registered(rule)
        assert state.core.rule is not None and state.core.rule.holds_payload == (native.compiled is not None)
        _, payload = shared_payload(gradient)
        slot = state.registry.slot_of(worker_id)
        kind = PayloadKind.GRADIENT.value
        state.core.commit(slot, worker_id, "r1", 1, 0, kind, payload, FLOAT32, payload_volatile=volatile)
        assert (state.core._landing.size == 0) == state.core.rule.holds_payload  # read where it lies: never landed
        results.append(state.core.theta_copy())
    np.testing.assert_array_equal(results[0], results[1])


def test_a_shared_payload_is_copied_before_a_journal_records_it() -> None:
    """A replicated primary journals the bytes it applied: the client writing its memory after the
    commit changes nothing a backup will replay."""
    state, worker_id = registered()
    journal = Entries()
    state.core.journal = journal
    memory, payload = shared_payload(np.full(P, 0.5))
    commit_volatile(state, worker_id, payload, "r1")
    memory[:] = np.nan  # the client scribbles once the reply is out
    entry = journal.entries[-1]
    assert isinstance(entry, Committed)
    assert np.frombuffer(entry.commit.payload.data, np.float32).tolist() == [0.5] * P


@pytest.mark.parametrize("compiled", [True, False])
def test_a_journalled_shared_payload_is_copied_once_into_a_buffer_its_entry_keeps(compiled: bool) -> None:
    """A replicated primary copies a payload out of its client's memory once (issue 80: it was
    copied into the core's reused landing, then again into the journal's frame): each commit's
    entry holds its own copy, which the frame sends as it is, and which the next commit's landing
    leaves alone; the frame's bytes are those of a copied payload's."""
    state, worker_id = registered()
    state.core.compiled = state.core.compiled if compiled else None
    journal = Entries()
    state.core.journal = journal
    memory, payload = shared_payload(np.full(P, 0.5))
    first = Commit(worker_id, 0, PayloadKind.GRADIENT.value, payload, "r1", 1, payload_volatile=True)
    state.core.commit_and_reply(first, lambda outcome, data: None)
    memory[:] = 0.25  # the client's next gradient, in the same memory
    second = dataclasses.replace(first, base_version=1, request_id="r2", sequence=2)
    state.core.commit_and_reply(second, lambda outcome, data: None)
    landed = [entry.commit for entry in journal.entries if isinstance(entry, Committed)]
    assert [np.frombuffer(commit.payload.data, np.float32)[0] for commit in landed] == [0.5, 0.25]
    for commit in landed:
        assert commit.payload_owned and not commit.payload_volatile
        start, framed = frame_of(commit)
        held = np.frombuffer(commit.payload.data, np.float32)
        assert np.shares_memory(np.frombuffer(framed, np.float32), held)  # no second copy
        assert not np.shares_memory(held, memory)
        assert (start, bytes(framed)) == frame_of(dataclasses.replace(commit, payload_owned=False))


def test_a_rule_that_cannot_hold_a_shared_payload_reads_a_copy() -> None:
    """downpour reads the payload with numpy (more than once): the core copies it first, so the
    checks and the step see the same values."""
    state, worker_id = registered("downpour")
    _, payload = shared_payload(np.full(P, 2.0))
    assert not state.core.rule.holds_payload  # type: ignore[union-attr]
    before = state.core.theta_copy()
    commit_volatile(state, worker_id, payload, "r1")
    assert state.core._landing[:P].tolist() == [2.0] * P  # what the step read: the core's own copy
    np.testing.assert_allclose(state.core.theta_copy(), before - 0.05 * 2.0, rtol=1e-6)


# -- the compiled core (csrc/core.c) against this module, bit for bit ---------------------------------

WORKERS = 3


def twin_states(
    rule: str = "gem", journalled: bool = False, **options: Any
) -> tuple[tuple[ServerState, ServerState], list[list[str]]]:
    """Two states alike in everything but the commit core: (compiled, Python), and each one's
    worker ids (registered in the same order: the same slots); `journalled`: each a replicated
    primary's, a journal recording every change from the first registration on."""
    pair, ids = [], []
    for compiled in (True, False):
        clock = CLOCKS[compiled]
        clock.now = 100.0
        runtime = RuleRuntime(gem_kernel="auto")
        state = ServerState(training(rule, **options), WorkerRegistry(8, lease_ttl=60.0, clock=clock), runtime)
        state.core.compiled = state.core.compiled if compiled else None
        if journalled:
            state.core.journal = Forwarded()
        spec = (ParameterSpec("w", (P,)),)
        registered = [
            state.register(f"w{i}", spec, encoded(THETA) if i == 0 else None, client_id=f"c{i}").worker.worker_id
            for i in range(WORKERS)
        ]
        ids.append(registered)
        pair.append(state)
    assert pair[0].core.compiled is not None, "the compiled core was not built"
    return (pair[0], pair[1]), ids


class Forwarded(Entries):
    """A journal that copies each commit's payload as it is appended, as a replicated primary's
    forwarder does (commit_frame.frame_of: the wire reuses the payload's buffer)."""

    def append(self, entry: Entry) -> int:
        if isinstance(entry, Committed):
            payload = entry.commit.payload
            copied = EncodedTensor(payload.dtype, payload.shape, bytes(payload.data))
            entry = Committed(dataclasses.replace(entry.commit, payload=copied))
        return super().append(entry)


class Clock:
    """A registry's clock that moves only when told (the twins' leases and recent windows read
    the same times)."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


CLOCKS = {True: Clock(), False: Clock()}  # the compiled twin's, the Python twin's


def held(state: ServerState) -> dict[str, Any]:
    """Everything a commit may change, as bytes and text (the twins' random worker ids named by
    their slots, which registering in the same order makes the same)."""
    rule = state.core.rule
    assert rule is not None
    registered = state.registry.export().workers
    noise = state.core.noise.export()
    found: dict[str, Any] = {
        "theta": state.core.theta_copy().tobytes(),
        "version": state.core.version,
        "commits": state.core.commits_applied,
        "bound": repr(rule.theta_bound(state.core.theta)),
        "workers": [
            {name: np.asarray(value).tobytes() for name, value in sorted(rule.worker_state(w.worker_id).items())}
            for w in registered
        ],
        "ledger": repr(state.core.ledger.export()),
        "registry": repr(state.registry.export()),
        "paces": [repr(pace(state, w.worker_id)) for w in registered],  # what a restart under its name is timed by
        "listing": repr(state.registry.listing()),
        "recent": repr(state.registry.recent_commits()),
        "noise": (noise.total.tobytes(), repr(dataclasses.replace(noise, total=np.empty(0)))),
    }
    for worker in registered:
        for key in ("ledger", "registry"):
            found[key] = found[key].replace(worker.worker_id, f"slot-{worker.slot}")
    return found


def pace(state: ServerState, worker_id: str) -> tuple[float, float, list[float]]:
    record = state.registry.find(worker_id)
    assert record is not None
    return record.last_seen, record.last_commit, list(record.gaps or ())


def figures(outcome: CommitOutcome) -> str:
    return repr((outcome.snapshot.version, outcome.staleness, outcome.stats, outcome.duplicate, outcome.epoch))


def a_commit(index: int, worker_id: str, base: int, rng: np.random.Generator, memory: np.ndarray) -> Commit:
    """The index-th of a varied run: gradients and updates, stale ones, with and without loss and
    samples, a peak the wire measured or not, some in the client's memory (volatile)."""
    memory[:] = rng.standard_normal(P).astype(np.float32) * np.float32(10.0 ** rng.integers(-4, 1))
    if index % 5 == 3:
        memory[rng.integers(0, P, 40)] = 0.0  # some parameters not moved: pi's sample without them
    if index % 7 == 6:
        memory[:] = 0.0  # nothing moved at all
    kind = PayloadKind.UPDATE if index % 4 == 1 else PayloadKind.GRADIENT
    peak = float(np.abs(memory).max()) if index % 3 == 0 else None
    return Commit(
        worker_id, base, kind.value, EncodedTensor(FLOAT32, (P,), memory.data.cast("B")), f"r{index}", index + 1,
        FLOAT32, loss=0.5 if index % 2 else None, num_samples=32 if index % 3 else None, payload_peak=peak,
        payload_volatile=index % 2 == 0,
    )  # fmt: skip


@pytest.mark.parametrize("noise_window", [0, 1])
def test_the_compiled_core_applies_commits_as_the_python_core_does(noise_window: int) -> None:
    (compiled, python), ids = twin_states()
    for state in (compiled, python):
        state.core.noise.option = noise_window
    rng = [np.random.default_rng(7), np.random.default_rng(7)]
    handled = 0
    for index in range(60):
        base = max(0, compiled.core.version - index % 4)  # stale by 0 to 3
        replies = []
        for side, state in enumerate((compiled, python)):
            memory = np.empty(P, np.float32)
            commit = a_commit(index, ids[side][index % WORKERS], base, rng[side], memory)
            out = memory if commit.payload_volatile else (np.empty(P, np.float32) if index % 3 else None)
            if side == 0:
                done = state.core.compiled(state.core, commit, lambda o, d: bytes(d), out)  # type: ignore[misc]
                handled += done is not None
                if done is None:
                    done = state.core.commit_and_reply(commit, lambda o, d: bytes(d), out)
            else:
                done = state.core.commit_and_reply(commit, lambda o, d: bytes(d), out)
            replies.append((figures(done[0]), done[1]))
        for clock in CLOCKS.values():
            clock.now += 0.25
        assert replies[0] == replies[1], f"commit {index}"
        assert held(compiled) == held(python), f"after commit {index}"
    assert handled >= 50, f"the compiled core applied {handled} of 60"


def test_what_the_compiled_core_leaves_to_the_python_core_it_does_not_touch() -> None:
    """A retry, a late attempt, another reply dtype, a buffer delta, a base version ahead, a payload
    not finite, an unknown worker, one that overflows in place: None, nothing changed (the Python
    core then answers each as it always did)."""
    (compiled, _), ids = twin_states()
    core = compiled.core
    memory = np.full(P, 0.01, np.float32)
    payload = EncodedTensor(FLOAT32, (P,), memory.data.cast("B"))
    first = Commit(ids[0][0], 0, PayloadKind.GRADIENT.value, payload, "first", 5)
    assert core.compiled is not None and core.compiled(core, first, lambda o, d: None, None) is not None
    before = held(compiled)
    nan = np.full(P, np.nan, np.float32)
    huge = np.full(P, 3e38, np.float32)
    cases = {
        "a retry": first,
        "a late attempt": dataclasses.replace(first, request_id="older", sequence=4),
        "bfloat16 replies": dataclasses.replace(first, request_id="a", sequence=6, reply_dtype=2),
        "a buffer delta": dataclasses.replace(first, request_id="b", sequence=6, buffer_delta=EncodedBuffers(None)),
        "ahead": dataclasses.replace(first, request_id="c", sequence=6, base_version=5),
        "not finite": dataclasses.replace(first, request_id="d", sequence=6, payload=encoded(nan)),
        "unknown": dataclasses.replace(first, worker_id="nobody", request_id="e", sequence=6),
        "overflow": dataclasses.replace(first, request_id="f", sequence=6, kind=2, payload=encoded(huge)),
        "long id": dataclasses.replace(first, request_id="x" * 129, sequence=6),
    }
    for what, commit in cases.items():
        assert core.compiled(core, commit, lambda o, d: None, None) is None, what
        assert held(compiled) == before, what


def test_other_rules_go_through_the_python_core() -> None:
    (compiled, _), ids = twin_states("downpour")
    payload = encoded(np.full(P, 0.5, np.float32))
    commit = Commit(ids[0][0], 0, PayloadKind.UPDATE.value, payload, "r", 1)
    assert compiled.core.compiled is not None
    assert compiled.core.compiled(compiled.core, commit, lambda o, d: None, None) is None


def journal_of(state: ServerState, ids: list[str]) -> list[Any]:
    """The state's journal entries: a commit as the bytes of the frame a replicated primary
    forwards (commit_frame.frame_of), its worker named by its registration order; others by kind."""
    journal = state.core.journal
    assert isinstance(journal, Entries)
    names = {worker_id: f"worker-{index}" for index, worker_id in enumerate(ids)}
    return [
        frame_of(dataclasses.replace(entry.commit, worker_id=names[entry.commit.worker_id]))
        if isinstance(entry, Committed)
        else type(entry).__name__
        for entry in journal.entries
    ]


def test_a_replicated_primary_and_its_backups_run_the_compiled_core() -> None:
    """A journal recording (a replicated primary) and a backup replaying it run the compiled core,
    which journals the entries and leaves the state the Python core does, bit for bit (issue 80:
    every replicated server ran the Python core); a payload in its client's memory copied first,
    as the Python core copies it, so the journal holds the bytes applied."""
    (compiled, python), ids = twin_states(journalled=True)
    rng = [np.random.default_rng(11), np.random.default_rng(11)]
    handled = 0
    for index in range(40):
        base = max(0, compiled.core.version - index % 3)
        for side, state in enumerate((compiled, python)):
            commit = a_commit(index, ids[side][index % WORKERS], base, rng[side], np.empty(P, np.float32))
            if side == 0:
                assert state.core.compiled is not None
                done = state.core.compiled(state.core, commit, lambda o, d: bytes(d), None)
                handled += done is not None
            if side == 1 or done is None:
                done = state.core.commit_and_reply(commit, lambda o, d: bytes(d), None)
        assert held(compiled) == held(python), f"after commit {index}"
    assert handled >= 35, f"the compiled core applied {handled} of 40"
    assert journal_of(compiled, ids[0]) == journal_of(python, ids[1])
    journal = compiled.core.journal
    assert isinstance(journal, Entries)
    backups = []
    for core_compiled in (True, False):
        clock = Clock()
        backup = ServerState(training(), WorkerRegistry(8, lease_ttl=60.0, clock=clock), RuleRuntime(gem_kernel="auto"))
        native = backup.core.compiled
        assert native is not None
        backup.core.compiled = Counted(native) if core_compiled else None
        for entry in journal.entries:
            backup.replay(entry)
        backups.append(backup)
    replayed, reference = backups
    assert isinstance(replayed.core.compiled, Counted) and replayed.core.compiled.applied >= 35
    assert (
        replayed.core.theta_copy().tobytes()
        == reference.core.theta_copy().tobytes()
        == compiled.core.theta_copy().tobytes()
    )
    assert held(replayed)["workers"] == held(reference)["workers"] == held(compiled)["workers"]


class Counted:
    """A compiled core that counts the commits it applied (those it left return None)."""

    def __init__(self, native: Callable[..., Any]) -> None:
        self.native, self.applied = native, 0

    def __call__(self, *arguments: Any) -> Any:
        done = self.native(*arguments)
        self.applied += done is not None
        return done
