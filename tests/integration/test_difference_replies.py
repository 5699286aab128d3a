"""Commit replies that send only what changed (`Client(reply_compression=)`, issue 47, item 3),
against real servers: on every route, after a retried commit, registering again, with two
partitions and after a failover, the worker's copy is the server's record and tracks θ."""

from __future__ import annotations

import contextlib
import re

import numpy as np
import pytest

import gemps
from gemps_proto import block_quantisation
from gemps_proto.reply_differences import copy_values, whole
from gemps_proto.tensor_codec import INT4_BLOCK, INT8_BLOCK, expected_payload_nbytes
from gemps_server.replication.local_etcd import LocalEtcd
from gemps_worker.cluster import ServerProcess
from tests.helpers import InProcessServer, scrape_series, start_partitions
from tests.integration.conftest import StartServer
from tests.integration.test_compressed_commits import commit_across_a_pause
from tests.integration.test_replicas import replica_options, wait_replicated

P = 3 * block_quantisation.BLOCK + 5  # several blocks, the last one short, an odd count (int4's padding)
CODES = {"int8": INT8_BLOCK, "int4": INT4_BLOCK}
MIB = 1 << 20


def updates(count: int, size: int = P, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(size) * rng.choice([1e-3, 1.0], size)).astype(np.float32) for _ in range(count)]


def sent_bytes(server: InProcessServer) -> dict[str, float]:
    """What the server's replies carried of θ, by encoding (gemps_wire_bytes_total)."""
    series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
    sent = (re.search(r'encoding="([a-z0-9]+)"', name) for name in series if _SENT.match(name))
    return {found.group(1): series[found.string] for found in sent if found is not None}


_SENT = re.compile(r'gemps_wire_bytes_total\{direction="sent",')


def close_to(copy: np.ndarray, theta: np.ndarray, levels: int) -> bool:
    """A copy within half a code's step of a block's largest change plus bfloat16's rounding:
    loosely, within 1/levels of θ's largest value in its block and 2^-8 of each value."""
    peaks = np.repeat(np.maximum.reduceat(np.abs(theta), np.arange(0, theta.size, 256)), 256)[: theta.size]
    return bool((np.abs(copy - theta) <= peaks / levels + np.abs(theta) * 2.0**-8).all())


@pytest.mark.usefixtures("plane")
@pytest.mark.parametrize("code", ["int8", "int4"])
def test_replies_carry_the_difference_and_the_copy_tracks_theta(start_server: StartServer, code: str) -> None:
    """The first reply is θ whole in bfloat16, the others the difference in `code`'s bytes; what
    each commit returns stays close to the server's θ, and is bfloat16 θ exactly when whole."""
    server = start_server(rule="downpour")
    levels = block_quantisation.INT8_LEVELS if code == "int8" else block_quantisation.INT4_LEVELS
    with gemps.Client(server.target, reply_compression=code) as client, gemps.Client(server.target) as reader:
        client.register({"w": np.zeros(P, np.float32)})
        for index, update in enumerate(updates(8)):
            copy = client.commit(update, kind="update").parameters.flat
            theta = reader.pull().flat
            if index == 0:
                np.testing.assert_array_equal(copy, copy_values(whole(theta)))
            assert close_to(copy, theta, levels), index
    sent = sent_bytes(server)
    assert sent["bfloat16"] == 2 * P  # the first reply
    assert sent[code] == 7 * expected_payload_nbytes(CODES[code], [P])  # the other seven


def test_commit_stream_replies_with_the_difference_in_pieces(start_server: StartServer) -> None:
    """CommitStream (gRPC, payload and reply in 100-byte pieces): the same copies and bytes."""
    server = start_server(rule="downpour")
    options = {"plane": "grpc", "streaming": "always", "chunk_bytes": 100, "reply_compression": "int8"}
    with gemps.Client(server.target, **options) as client, gemps.Client(server.target) as reader:  # type: ignore[arg-type]
        client.register({"w": np.zeros(P, np.float32)})
        for update in updates(4):
            copy = client.commit(update, kind="update").parameters.flat
        assert close_to(copy, reader.pull().flat, block_quantisation.INT8_LEVELS)
        number, bits = server.server.state.core.copies.held(client._router.sessions[0].worker_id)  # type: ignore[misc]
        assert number == client._router.sessions[0].copy.number
        np.testing.assert_array_equal(whole(copy), bits)
    sent = sent_bytes(server)
    assert sent["bfloat16"] == 2 * P and sent["int8"] == 3 * expected_payload_nbytes(INT8_BLOCK, [P])


def test_a_retried_commit_is_answered_whole_and_the_copies_agree_again() -> None:
    """The server is paused (SIGSTOP) while a commit goes out: its first attempt is applied and
    its reply, a difference, lost; the retry names the copy held before, so its reply is θ whole
    and both ends hold that from then on: the following replies are differences again."""
    with ServerProcess(rule="downpour", log_level="warning") as server:
        client = gemps.Client(server.target, reply_compression="int8", plane="grpc", attempt_timeout=0.5, timeout=60)
        reader = gemps.Client(server.target, plane="grpc")
        client.register({"w": np.zeros(P, np.float32)})
        first, second, third = updates(3)
        client.commit(first, kind="update")
        held = client._router.sessions[0].copy.number
        result = commit_across_a_pause(server, client, second)
        assert result.version == 2  # applied once
        theta = reader.pull().flat
        after_retry = client._router.sessions[0].copy.number
        if after_retry != held + 1:  # the first attempt's reply (a difference from `held`) was lost
            assert after_retry not in (0, held)  # the duplicate's reply: θ whole, a new copy
            np.testing.assert_array_equal(result.parameters.flat, copy_values(whole(theta)))
        assert close_to(result.parameters.flat, theta, block_quantisation.INT8_LEVELS)
        result = client.commit(third, kind="update")
        assert client._router.sessions[0].copy.number == after_retry + 1  # a difference from it
        assert close_to(result.parameters.flat, reader.pull().flat, block_quantisation.INT8_LEVELS)
        client.close()
        reader.close()


def test_registering_again_starts_a_new_copy_whole(start_server: StartServer) -> None:
    server = start_server(rule="downpour")
    with gemps.Client(server.target, reply_compression="int8") as client, gemps.Client(server.target) as reader:
        client.register({"w": np.zeros(P, np.float32)})
        for update in updates(3):
            client.commit(update, kind="update")
        client.leave()
        client.register({"w": np.zeros(P, np.float32)})
        copy = client.commit(updates(1, seed=1)[0], kind="update").parameters.flat
        np.testing.assert_array_equal(copy, copy_values(whole(reader.pull().flat)))
    assert sent_bytes(server)["bfloat16"] == 2 * 2 * P  # one whole reply per registration


def test_partitions_each_keep_their_copy(start_server: StartServer) -> None:
    servers = start_partitions(start_server, 2, rule="downpour")
    with gemps.Client(servers[0].target, reply_compression="int4") as client, gemps.Client(servers[0].target) as reader:
        client.register({"w": np.zeros(P, np.float32)})
        for update in updates(6):
            copy = client.commit(update, kind="update").parameters.flat
        assert close_to(copy, reader.pull().flat, block_quantisation.INT4_LEVELS)
        numbers = [session.copy.number for session in client._router.sessions]
        for session, server in zip(client._router.sessions, servers, strict=True):  # each slice's copy: its record
            number, bits = server.server.state.core.copies.held(session.worker_id)  # type: ignore[misc]
            assert number == session.copy.number
            np.testing.assert_array_equal(whole(session.flat), bits)
    assert 0 not in numbers and numbers[0] != numbers[1]
    for server in servers:  # each partition: one whole reply of its slice, then int4 differences
        sent = sent_bytes(server)
        size = server.server.state.core.num_parameters
        assert sent["bfloat16"] == 2 * size and sent["int4"] == 5 * expected_payload_nbytes(INT4_BLOCK, [size])


def test_a_new_primary_answers_whole_then_differences(start_server: StartServer, etcd: LocalEtcd) -> None:
    """Copies are not replicated: the promoted backup holds none, so the first reply a worker gets
    from it is θ whole, and differences follow from the copy it started."""
    servers = [start_server(rule="downpour", **replica_options(etcd, index, "copies")) for index in range(2)]
    primary = wait_replicated(servers)
    backup = next(server for server in servers if server is not primary)
    target = "|".join(server.target for server in servers)
    with gemps.Client(target, reply_compression="int8") as client:
        client.register({"w": np.zeros(P, np.float32)})
        for update in updates(3):
            client.commit(update, kind="update")
        assert len(backup.server.state.core.copies) == 0
        primary.stop(grace=1.0)  # resigns: the backup takes over
        for update in updates(3, seed=1):
            copy = client.commit(update, kind="update").parameters.flat
        theta = backup.server.state.core.theta_copy()
        assert close_to(copy, theta, block_quantisation.INT8_LEVELS)
        number, bits = backup.server.state.core.copies.held(client._router.sessions[0].worker_id)  # type: ignore[misc]
        assert number == client._router.sessions[0].copy.number
        np.testing.assert_array_equal(whole(copy), bits)  # the worker's copy is the new primary's record
    sent = sent_bytes(backup)
    assert sent["bfloat16"] == 2 * P and sent["int8"] == 2 * expected_payload_nbytes(INT8_BLOCK, [P])


def held_for_workers(server: InProcessServer) -> int:
    """Bytes of the workers' rule state and of their reply copies (Status, gemps_reply_copy_bytes)."""
    with gemps.Client(server.target) as observer:
        rule_state = observer.status().rule_state_bytes
    return rule_state + int(scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")["gemps_reply_copy_bytes"])


def test_reply_copies_stay_within_the_memory_budget_as_workers_join(start_server: StartServer) -> None:
    """Issue 77, item 7: a copy was kept where the budget had room beside the registered workers'
    rule state, but a worker registering later was admitted by its rule state alone, the copies
    kept: 5 GEM workers joining one by one under a budget of 43 MiB (5 workers' state and 3 MiB)
    held 48 MiB, 1.12x the budget. Now a registration drops the longest unrenewed copies that no
    longer fit (the workers come first): their next replies are θ whole, and differences follow
    where a copy fits again."""
    size = 1 << 20  # θ of 4 MiB: GEM's state 8 MiB a worker, a difference reply's copy 2 MiB
    budget = 43 * MIB
    server = start_server(rule="gem", memory_budget_mb=budget // MIB)
    with contextlib.ExitStack() as stack:
        reader = stack.enter_context(gemps.Client(server.target))
        clients = []
        for _ in range(5):
            clients.append(stack.enter_context(gemps.Client(server.target, reply_compression="int8")))
            clients[-1].register({"w": np.zeros(size, np.float32)})
            for client in clients:
                client.commit(np.full(size, 1e-3, np.float32))
                assert held_for_workers(server) <= budget
        assert server.server.state.core.copies.nbytes == 2 * size  # one copy fits beside 5 workers' state
        for client in clients:  # each worker's θ is the server's, whole or from the copy kept
            copy = client.commit(np.full(size, 1e-3, np.float32)).parameters.flat
            assert close_to(copy, reader.pull().flat, block_quantisation.INT8_LEVELS)
    assert held_for_workers(server) <= budget
