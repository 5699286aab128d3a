"""adamw's rounds after a restore from a checkpoint (rules/adamw.py, KEPT_SIZE): the checkpoint
keeps the open round's K, which holds until as many workers registered again (or one left); the
workers registered again count as committing until their first commit, though the checkpoint kept
their clients' last receipts from versions long past (CommitCore.live_workers); a backup seeded
while K is kept holds it as its primary does."""

from __future__ import annotations

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.status import Rounds
from gemps_server import snapshot_codec
from gemps_server.domain import images
from gemps_server.domain.records import Commit
from gemps_server.domain.rules import create_rule
from gemps_server.domain.rules.adamw import KEPT_SIZE
from gemps_server.domain.rules.base import StepContext
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from gemps_server.replication import image_codec
from tests.helpers import encoded, training
from tests.unit.test_journal_replay import SPEC

P = SPEC[0].size


def server_state(rule: str = "adamw", **options: float) -> ServerState:
    return ServerState(training(rule, learning_rate=3e-3, **options), WorkerRegistry(8, lease_ttl=3600))


def join(state: ServerState, name: str) -> str:
    theta = encoded(np.zeros(P, np.float32)) if state.core.rule is None else None
    return state.register(name, SPEC, theta, client_id=name * 8).worker.worker_id


def commit(state: ServerState, worker: str) -> int:
    """`worker`'s gradient on θ as it is now: the commits its round still needs."""
    core = state.core
    gradient = encoded(np.random.default_rng(core.version).normal(size=P).astype(np.float32))
    request = f"{worker}-{core.version}"  # a receipt per commit, as the SDK's request ids leave
    return core.commit_record(Commit(worker, core.version, PayloadKind.GRADIENT, gradient, request)).stats.pending


def restarted(names: str = "abc", drop_kept: bool = False, rule: str = "adamw", **options: float) -> ServerState:
    """A server of `names` that took a round of commits each, then checkpointed; a new one restored
    from it (`drop_kept`: from a checkpoint written before the kept K)."""
    state = server_state(rule, **options)
    workers = [join(state, name) for name in names]
    for worker in workers:
        commit(state, worker)
    tensors, metadata = snapshot_codec.state_parts(images.checkpoint(state))
    if drop_kept:
        tensors = {key: value for key, value in tensors.items() if KEPT_SIZE not in key}
    restored = server_state(rule, **options)
    assert images.restore(restored, snapshot_codec.take_state(metadata, dict(tensors))) == []
    return restored


def rounds(state: ServerState) -> Rounds:
    found = state.rounds()
    assert found is not None
    return found


def size(state: ServerState) -> int:
    return rounds(state).size


def test_the_first_worker_back_owes_the_round_the_jobs_k_until_as_many_registered_again() -> None:
    state = restarted("abc")
    a = join(state, "a")
    assert size(state) == 3
    assert [commit(state, a) for _ in range(3)] == [2, 1, 0]  # three gradients, one step
    assert rounds(state).closed == 2
    join(state, "b")
    assert size(state) == 3
    join(state, "c")  # as many as the job had: K follows the workers from here on
    join(state, "d")
    assert size(state) == 4


def test_a_departure_while_the_job_returns_has_k_follow_the_workers() -> None:
    state = restarted("abc")
    join(state, "a")
    state.leave(join(state, "b"))  # the job shrank: no longer waiting for its size
    assert size(state) == 1


def test_the_kept_k_is_the_rounds_less_the_backups_and_a_fixed_round_size_keeps_its_own() -> None:
    state = restarted("abcd", backup_workers=1)
    for name in "abc":
        join(state, name)
        assert size(state) == 3
    join(state, "d")  # 4 less the backup: the job's K from its workers
    join(state, "e")
    assert size(state) == 4
    fixed = restarted("ab", round_size=5)
    join(fixed, "a")
    assert size(fixed) == 5


def test_a_checkpoint_from_before_the_kept_k_restores_with_k_following_the_workers() -> None:
    state = restarted("abc", drop_kept=True)
    join(state, "a")
    assert size(state) == 1


def test_workers_registered_again_count_as_committing_though_their_receipts_are_old() -> None:
    """After the restore `a` alone commits two rounds of three (6 versions, 2N = 6 with three
    registered): the receipts the checkpoint kept of b and c are that far behind, yet each,
    registered again, is counted until its first commit here: K 3, not the one worker that
    committed."""
    state = restarted("abc")
    a = join(state, "a")
    for _ in range(6):
        commit(state, a)
    b, c = join(state, "b"), join(state, "c")
    assert size(state) == 3 and state.core.live_workers("") == 3
    assert [commit(state, worker) for worker in (a, b, c)] == [2, 1, 0]


def test_a_backup_seeded_while_k_is_kept_holds_it_as_its_primary_does() -> None:
    primary = restarted("abc")
    a = join(primary, "a")
    backup = server_state()
    images.adopt(backup, image_codec.decode(image_codec.encode(images.take(primary))))
    assert size(backup) == size(primary) == 3
    commit(primary, a)
    join(primary, "b")
    images.adopt(backup, image_codec.decode(image_codec.encode(images.take(primary))))
    for state in (primary, backup):
        join(state, "c")
        join(state, "d")
    assert size(backup) == size(primary) == 4


@pytest.mark.parametrize("round_size", [5, 6, 7, 8, 9])
def test_a_round_above_the_workers_names_no_more_takers_than_it_still_needs(round_size: int) -> None:
    """Four workers, K above them: each commits once a round unprompted, then again only once the
    core names it (its held pull answered), a named one's gradient arriving after the commits of
    those already computing theirs. When the round closes no named worker may still be computing:
    its gradient would come after the round closed, and be dropped (K 6 had named every worker
    for ⌈6 / 4⌉ = 2 gradients: 8 a round, 2 of them dropped)."""
    state = server_state(round_size=round_size)
    workers = [join(state, name) for name in "abcd"]
    core = state.core
    for _ in range(3):  # rounds
        steps, given, waiting = rounds(state).closed, 0, []
        in_flight = list(workers)  # each computing its first gradient of the round
        while rounds(state).closed == steps:
            assert in_flight, f"the round stalled at {rounds(state).held} of {round_size}"
            worker = in_flight.pop(0)
            commit(state, worker)
            given += 1
            waiting.append(worker)
            told = [name for name in waiting if name in core.round_takers()]
            waiting = [name for name in waiting if name not in told]
            in_flight += told
        assert (given, in_flight) == (round_size, [])


def test_a_partition_names_the_same_takers_whatever_order_the_commits_reached_it() -> None:
    """K 3, two workers, each commits once: one server of all of θ names the earliest of the two
    (the round needs one more), so the order of arrival decides. A worker of a partitioned θ goes
    on only once every partition named it, and commits may reach two partitions in other orders:
    a partition names every worker short of ⌈3 / 2⌉, the same set whatever the order."""
    named: dict[str, list[frozenset[str]]] = {"whole": [], "partition": []}
    for order in ("ab", "ba"):
        for kind, bounds in (("whole", (0, P)), ("partition", (0, P // 2))):
            rule = create_rule(training("adamw", learning_rate=3e-3, round_size=3), bounds[1])
            rule.take_spec([ParameterSpec("w", (P,))], bounds)
            theta = np.zeros(bounds[1], np.float32)
            for worker in "ab":
                rule.add_worker(worker, theta)
            for version, worker in enumerate(order):
                rule.step(
                    theta, np.ones(bounds[1], np.float32), StepContext(worker, staleness=version, version=version)
                )
            named[kind].append(rule.round_takers(2))
    assert named == {"whole": [{"a"}, {"b"}], "partition": [{"a", "b"}, {"a", "b"}]}
