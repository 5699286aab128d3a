"""A commit's outcome says `unchanged`, and the core writes no θ for its reply, exactly when its
client holds the θ after it (Commit.base_held, and θ still that of its base version): under adamw
every commit that joins an open round, never the round's closing one, a dropped gradient or a
commit that did not say it holds θ. And the SDK takes an unchanged reply only to a commit that
named the server's history."""

from __future__ import annotations

import numpy as np
import pytest

import gemps
from gemps import errors
from gemps.channel_security import ChannelSecurity
from gemps.grpc_transport import GrpcTransport
from gemps.retry import Retrier
from gemps.server_session import ServerSession
from gemps.transport import CommitCall, Committed
from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_proto.tensor_codec import FLOAT32, INT8_BLOCK
from gemps_server.domain.records import Commit, CommitOutcome
from gemps_server.domain.rules import RuleRuntime
from gemps_server.domain.state import ServerState
from gemps_server.domain.workers import WorkerRegistry
from tests.helpers import encoded, training

P = 1_000
SENTINEL = np.float32(7.5)  # what the client's memory held before the reply


def adamw_state(workers: int) -> tuple[ServerState, list[str]]:
    state = ServerState(training("adamw"), WorkerRegistry(8, lease_ttl=60.0), RuleRuntime())
    spec = (ParameterSpec("w", (P,)),)
    ids = [state.register("w0", spec, encoded(np.zeros(P, np.float32)), client_id="c0").worker.worker_id]
    ids += [state.register(f"w{i}", spec, None, client_id=f"c{i}").worker.worker_id for i in range(1, workers)]
    return state, ids


def committed(state: ServerState, worker_id: str, base: int, held: bool) -> tuple[CommitOutcome, np.ndarray, bytes]:
    """A gradient of ones from `worker_id` on θ of `base`; the client's memory (`out`) after it and the reply's θ."""
    memory = np.full(P, SENTINEL, np.float32)
    payload = encoded(np.ones(P, np.float32))
    commit = Commit(worker_id, base, PayloadKind.GRADIENT.value, payload, base_held=held)
    outcome, theta = state.core.commit_and_reply(commit, lambda _outcome, data: bytes(data), out=memory)
    return outcome, memory, theta


def test_a_commit_that_joins_the_round_and_holds_its_theta_is_answered_unchanged() -> None:
    state, (first, second, third) = adamw_state(3)  # a round of three
    outcome, memory, theta = committed(state, first, 0, held=True)
    assert outcome.unchanged and outcome.stats.pending == 2 and theta == b""
    assert (memory == SENTINEL).all()  # the client's memory left as it was: no θ written there
    outcome, memory, theta = committed(state, second, 0, held=False)  # did not say it holds θ
    assert not outcome.unchanged and theta == memory.tobytes() and not (memory == SENTINEL).any()
    outcome, memory, theta = committed(state, third, 0, held=True)  # closes the round: θ moved
    assert not outcome.unchanged and outcome.stats.pending == 0
    np.testing.assert_array_equal(memory, state.core.theta_copy())
    assert theta == memory.tobytes() and not np.array_equal(memory, np.zeros(P, np.float32))


def test_a_dropped_gradient_gets_the_rounds_theta_though_it_says_it_holds_its_own() -> None:
    state, (first, second) = adamw_state(2)
    committed(state, first, 0, held=True)
    committed(state, second, 0, held=True)  # θ moved at version 2
    outcome, memory, _ = committed(state, first, 0, held=True)  # taken on θ of version 0: dropped
    assert outcome.stats.pending == 0 and outcome.stats.kept_theta and not outcome.unchanged
    np.testing.assert_array_equal(memory, state.core.theta_copy())
    outcome, _, _ = committed(state, first, 2, held=True)  # on θ of the round: joins it
    assert outcome.unchanged and outcome.snapshot.version == 4


def test_a_commit_from_a_later_version_of_the_same_theta_is_unchanged_too() -> None:
    """Every version since θ last moved holds one θ (CommitCore.same_theta): a base among them is held."""
    state, ids = adamw_state(4)
    committed(state, ids[0], 0, held=True)
    outcome, _, theta = committed(state, ids[1], 1, held=True)
    assert outcome.unchanged and theta == b""


def a_session() -> ServerSession:
    """A session to a server nobody calls (its channel connects lazily), holding θ of version 3."""
    transport = GrpcTransport(
        "localhost:1",
        ChannelSecurity(),
        max_message_bytes=1 << 20,
        timeout=1.0,
        wire_dtype=FLOAT32,
        chunk_bytes=1 << 16,
    )
    session = ServerSession(transport, Retrier("localhost:1", gemps.RetryPolicy(max_attempts=1)))
    session.stop = 4
    session.received(3, np.arange(4, dtype=np.float32), history="h")
    return session


def a_call(known_history: str) -> CommitCall:
    payload = np.zeros(4, np.float32)
    return CommitCall("w", 3, PayloadKind.GRADIENT, payload, None, None, "r1", known_history=known_history)


def unchanged_reply(version: int) -> Committed:
    return Committed(version, 0, 1.0, 1.0, 0.0, 0.0, None, None, round_pending=1)


def test_the_sdk_keeps_its_theta_numbered_on_for_an_unchanged_reply() -> None:
    session = a_session()
    held = session.flat
    session.took(unchanged_reply(4), a_call(session.known_history(3)))
    assert session.version == 4 and session.flat is held


def test_the_sdk_refuses_an_unchanged_reply_to_a_commit_that_did_not_say_it_holds_theta() -> None:
    session = a_session()
    call = a_call(session.known_history(2))  # base 2: not the θ it holds (version 3), so no history named
    assert call.known_history == ""
    with pytest.raises(errors.GempsError, match="did not say it holds"):
        session.took(unchanged_reply(4), call)
    assert session.version == 3


def test_difference_replies_never_name_a_history() -> None:
    session = a_session()
    assert session.known_history(3) == "h" and session.known_history(3, reply_code=INT8_BLOCK) == ""
