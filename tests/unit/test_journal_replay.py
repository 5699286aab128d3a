"""The journal and its replay (DESIGN §3d): a backup that applies a primary's entries, sent through
the replication stream's encoding, holds the primary's θ, workers and ledger bit for bit, with
the primary's decisions (worker ids, displacements, evictions) taken from the entries."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from gemps_proto.gradient_sums import GradientSums
from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import BFLOAT16, INT64, EncodedBuffers, EncodedTensor, encode
from gemps_server.domain import images
from gemps_server.domain.errors import InvalidArgument
from gemps_server.domain.journal import Committed, Departed, Entry, Joined
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.native import native_commit
from gemps_server.replication import entries, frames, image_codec
from tests.helpers import encoded, training

P = 64
SPEC = (ParameterSpec("w", (P,)),)
BUFFER_SPEC = (ParameterSpec("steps", (1,), INT64),)
native_built = native_commit is not None  # the compiled core (and GEM's compiled kernel) were built here


class ListJournal:
    """A journal that keeps its entries, encoded as the replication stream sends them."""

    def __init__(self) -> None:
        self.frames: list[frames.Frame] = []

    def append(self, entry: Entry) -> int:
        self.frames.append(entries.encode(entry, len(self.frames) + 1, epoch=self.epoch))
        return len(self.frames)

    @property
    def last(self) -> int:
        return len(self.frames)

    @property
    def epoch(self) -> int:
        return 7


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def new_state(rule: str, clock: Clock, max_workers: int = 3) -> ServerState:
    return ServerState(training(rule, learning_rate=0.1), WorkerRegistry(max_workers, lease_ttl=10.0, clock=clock))


def through_a_socket(frame: frames.Frame) -> frames.Frame:
    """The frame as the other end of a socket receives it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        frames.send(ours, frame)
        return frames.receive(theirs)


def replay_all(
    primary: ServerState, backup: ServerState, journal: ListJournal, start: int = 0, stop: int | None = None
) -> None:
    for frame in journal.frames[start:stop]:
        entry, _position, epoch = entries.decode(through_a_socket(frame))
        assert epoch == 7
        backup.replay(entry)


def steps(value: int) -> EncodedBuffers:
    return EncodedBuffers(None, EncodedTensor(INT64, (1,), np.array([value], np.int64).tobytes()))


@pytest.mark.parametrize("rule", ["gem", "momentum", "downpour", "adamw"])  # adamw: its compiled passes in place
def test_a_replayed_journal_gives_the_same_state_bit_for_bit(rule: str) -> None:
    clock = Clock()
    primary, backup = new_state(rule, clock), new_state(rule, Clock())
    journal = ListJournal()
    primary.core.journal = journal
    rng = np.random.default_rng(1)
    initial = rng.standard_normal(P).astype(np.float32)
    first = primary.register(
        "a", SPEC, encoded(initial), buffer_spec=BUFFER_SPEC, initial_buffers=steps(0), client_id="ca"
    )
    second = primary.register("b", SPEC, None, buffer_spec=BUFFER_SPEC, client_id="cb")
    workers = [first.worker.worker_id, second.worker.worker_id]
    for index in range(30):
        payload = rng.standard_normal(P).astype(np.float32)
        data = encode(payload, BFLOAT16) if index % 3 == 0 else payload.tobytes()
        dtype = BFLOAT16 if index % 3 == 0 else 1
        commit = Commit(
            worker_id=workers[index % 2],
            base_version=max(0, primary.core.version - index % 4),
            kind=PayloadKind.GRADIENT,
            payload=EncodedTensor(dtype, (P,), data),
            request_id=f"r{index}",
            sequence=index // 2 + 1,
            num_samples=32,
            buffer_delta=steps(1),
        )
        primary.core.commit_record(commit)
    primary.leave(workers[1])
    third = primary.register("c", SPEC, None, buffer_spec=BUFFER_SPEC, client_id="cc")
    clock.now = 100.0  # every lease ran out
    assert len(primary.evict_expired()) == 2
    replay_all(primary, backup, journal)
    assert backup.core.version == primary.core.version == 30
    assert backup.core.theta_copy().tobytes() == primary.core.theta_copy().tobytes()
    assert backup.core.ledger.entries() == primary.core.ledger.entries()
    assert len(backup.registry) == len(primary.registry) == 0
    assert third.worker.worker_id not in backup.registry
    assert backup.core.buffers.integers.tolist() == primary.core.buffers.integers.tolist() == [30]


def test_replay_takes_the_primarys_worker_ids_and_displacements() -> None:
    clock = Clock()
    primary, backup = new_state("downpour", clock, max_workers=2), new_state("downpour", Clock(), max_workers=2)
    journal = ListJournal()
    primary.core.journal = journal
    a = primary.register("a", SPEC, encoded(np.zeros(P, np.float32))).worker.worker_id
    clock.now = 5.0
    b = primary.register("b", SPEC, None).worker.worker_id
    clock.now = 20.0  # both idle past the lease: a newcomer displaces the idlest (a)
    joined = primary.register("c", SPEC, None)
    assert joined.displaced is not None and joined.displaced.worker_id == a
    replay_all(primary, backup, journal)
    assert sorted(
        w.worker_id for w in [backup.registry.get(b), backup.registry.get(joined.worker.worker_id)]
    ) == sorted([b, joined.worker.worker_id])
    assert a not in backup.registry
    assert [w.slot for w in sorted(backup.registry._workers.values(), key=lambda w: w.worker_id)] == [
        w.slot for w in sorted(primary.registry._workers.values(), key=lambda w: w.worker_id)
    ]


def test_refusals_and_duplicates_are_not_journalled() -> None:
    primary = new_state("downpour", Clock())
    journal = ListJournal()
    primary.core.journal = journal
    worker = primary.register("a", SPEC, encoded(np.zeros(P, np.float32))).worker.worker_id
    commit = Commit(worker, 0, PayloadKind.UPDATE, encoded(np.ones(P, np.float32)), request_id="r1", sequence=1)
    applied = primary.core.commit_record(commit)
    assert applied.position == 2 and journal.last == 2 and applied.epoch == 7  # replies carry the epoch
    retried = primary.core.commit_record(commit)
    assert retried.duplicate and retried.position == 2  # waits for what is journalled, adds nothing
    with pytest.raises(InvalidArgument):
        primary.core.commit_record(
            Commit(worker, 0, PayloadKind.UPDATE, encoded(np.full(P, np.nan, np.float32)), request_id="r2")
        )
    assert journal.last == 2
    assert [type(entries.decode(frame)[0]) for frame in journal.frames] == [Joined, Committed]


def test_a_malformed_entry_is_refused_with_a_clear_error() -> None:
    frame = entries.encode(Departed(("w1",)), 1, 1)
    broken = frames.Frame(frame.kind, {"position": 1, "epoch": 1, "commit": {"worker_id": "w"}}, [])
    with pytest.raises(entries.BadEntry, match="malformed journal entry"):
        entries.decode(broken)
    ours, theirs = socket.socketpair()
    with ours, theirs:
        ours.sendall(b"\xff\xff\xff\xff" + b"\0" * 8)
        with pytest.raises(frames.StreamClosed, match="not from a gemps replica"):
            frames.receive(theirs)


@pytest.mark.parametrize("rule", ["gem", "downpour"])  # gem: a commit with sums is not the compiled core's
def test_a_backup_folds_an_update_commits_gradient_sums_in_as_its_primary_did(rule: str) -> None:
    config, runtime = training(rule, learning_rate=0.1), RuleRuntime(gem_kernel="auto")
    primary, backup = (ServerState(config, WorkerRegistry(3, lease_ttl=10.0), runtime) for _ in range(2))
    journal = ListJournal()
    primary.core.journal = journal
    worker = primary.register("a", SPEC, encoded(np.zeros(P, np.float32))).worker.worker_id
    assert primary.core.rule is not None and primary.core.rule.native_step == (rule == "gem" and native_built)
    rng = np.random.default_rng(3)
    for index in range(12):
        sums = GradientSums(float(rng.uniform(10.0, 20.0)), float(rng.uniform(0.0, 30.0)), 4, 4, 4 * 32)
        payload = encoded(rng.standard_normal(P).astype(np.float32))
        commit = Commit(worker, primary.core.version, PayloadKind.UPDATE, payload, f"r{index}", gradient_sums=sums)
        primary.core.commit_record(commit)
    replay_all(primary, backup, journal)
    assert primary.core.noise.estimate.windows == 12  # every commit's sums, the compiled core's kind too
    assert backup.core.noise.estimate == primary.core.noise.estimate
    assert backup.core.theta_copy().tobytes() == primary.core.theta_copy().tobytes()


def journalled_adamw(names: str) -> tuple[ServerState, ListJournal, list[str]]:
    """An adamw primary of up to 4 workers whose journal keeps its entries, with a worker of each
    name in `names` registered (its client id the name four times): the primary, its journal, their ids."""
    primary, journal = new_state("adamw", Clock(), max_workers=4), ListJournal()
    primary.core.journal = journal
    workers = [
        primary.register(name, SPEC, encoded(np.zeros(P, np.float32)), client_id=name * 4).worker.worker_id
        for name in names
    ]
    return primary, journal, workers


def test_a_backup_sizes_adamws_rounds_by_the_live_workers_as_its_primary_did() -> None:
    """The round's size follows the workers still committing (a silent one drops out after 2N
    commits): a backup replaying the journal, and one seeded from an image while the silent
    worker still counted, close every round at the commit the primary closed it at."""
    primary, journal, (a, b, ghost) = journalled_adamw("abc")
    replayed, seeded = (new_state("adamw", Clock(), max_workers=4) for _ in range(2))
    rng = np.random.default_rng(4)
    core, pending, sent = primary.core, [], 0

    def commit(worker: str) -> None:
        nonlocal sent
        sent += 1
        payload = encoded(rng.standard_normal(P).astype(np.float32))
        pending.append(
            core.commit_record(Commit(worker, core.version, PayloadKind.GRADIENT, payload, f"r{sent}")).stats.pending
        )

    for worker in (a, b, ghost):
        commit(worker)
    restarted = primary.register("d", SPEC, None, client_id="dddd").worker.worker_id
    image, taken_at = None, 0
    for round_index in range(5):
        if round_index == 1:  # the ghost still counts: its last commit is within the last 2N versions
            image, taken_at = image_codec.decode(image_codec.encode(images.take(primary))), journal.last
        for worker in (a, b, restarted):
            commit(worker)
        while pending[-1]:
            commit(a)
    assert pending[-4:] == [0, 2, 1, 0]  # a round of the three live workers by then
    replay_all(primary, replayed, journal)
    assert image is not None
    images.adopt(seeded, image)
    replay_all(primary, seeded, journal, start=taken_at)
    for backup in (replayed, seeded):
        assert backup.core.version == core.version
        assert backup.core.theta_copy().tobytes() == core.theta_copy().tobytes()
        assert backup.core.rule is not None and core.rule is not None
        assert backup.core.rule.global_state().keys() == core.rule.global_state().keys()
        for key, value in core.rule.global_state().items():
            assert backup.core.rule.global_state()[key].tobytes() == value.tobytes(), key


def test_a_backup_names_the_rounds_takers_as_its_primary_did_after_joins_and_departures() -> None:
    """A departure after the others committed leaves adamw's round holding every commit it waits
    for: the primary names the waiting workers (their next commit closes it), and a join takes that
    back. A backup replaying the journal names the same workers after each entry, so once promoted
    it tells their pulls to go on (not the SDK's wait limit)."""
    primary, journal, (a, b, c) = journalled_adamw("abc")
    backup = new_state("adamw", Clock(), max_workers=4)
    rng = np.random.default_rng(5)
    for index, worker in enumerate((a, b)):
        payload = encoded(rng.standard_normal(P).astype(np.float32))
        primary.core.commit_record(Commit(worker, primary.core.version, PayloadKind.GRADIENT, payload, f"r{index}"))
    named = [(journal.last, primary.core.round_takers())]  # the round waits for c
    primary.leave(c)
    named.append((journal.last, primary.core.round_takers()))
    late = primary.register("d", SPEC, None, client_id="dddd").worker.worker_id
    named.append((journal.last, primary.core.round_takers()))  # the round waits for d
    primary.leave(late)
    named.append((journal.last, primary.core.round_takers()))
    assert [takers for _, takers in named] == [frozenset(), {a, b}, frozenset(), {a, b}]
    replayed = 0
    for position, takers in named:
        replay_all(primary, backup, journal, start=replayed, stop=position)
        replayed = position
        assert backup.core.round_takers() == takers, position
