"""Memory a client can make the server hold (issue 15, items 1, 2 and 8): a server process on
loopback, attacked over raw HTTP/2 (h2) or with large requests, its resident memory read from /proc.

- Item 1: a client without the token declares a large message and sends it; the server must
  refuse it without reading it.
- Item 2: a client opens many Pulls on a connection whose receive window is zero and never
  reads; what the server holds for it is bounded by --max-reply-mb, and the connection (and
  with it every reply it held) is gone after --max-connection-age plus its grace.
- Item 8 and the bounds behind it: a request past --max-message-mb is refused unread; one within
  it that is refused is freed when its call ends; past --max-concurrent-rpcs calls are refused
  before their requests are read.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.allocator import TRIM_INTERVAL_SECONDS
from tests.integration.conftest import StartServerProcess, open_stub
from tests.raw_http2 import RawConnection, grpc_frame

pytestmark = pytest.mark.timeout(90)

MIB = 1024 * 1024
PARAMETERS = 1_000_000  # θ of 4 MB: a Pull's reply
SPEC = [pb.ParameterSpec(name="w", shape=[PARAMETERS], dtype=pb.DTYPE_FLOAT32)]
REGISTER = "/gemps.v1.ParameterServer/Register"
PULL = "/gemps.v1.ParameterServer/Pull"


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def test_a_client_without_the_token_cannot_make_the_server_hold_its_message(
    start_server_process: StartServerProcess,
) -> None:
    """Item 1: 4 calls declaring 64 MiB each, sent but for the last byte, without a token."""
    server = start_server_process(auth_token="sekrit", max_message_mb=512)
    before = rss_mib(server.pid)
    attacker = RawConnection(server.port)
    try:
        streams = [attacker.open(REGISTER) for _ in range(4)]
        attacker.send_all_but_the_last_byte(streams, 64 * MIB, seconds=30)
        for _ in range(20):  # the refusals, if they have not arrived yet
            if len(attacker.statuses) == len(streams):
                break
            attacker.pump(0.1)
        held = rss_mib(server.pid) - before
        # Each call refused UNAUTHENTICATED (16) before its message was read; before the fix the
        # server opened each stream's window to 64 MiB and buffered all of it (+256 MiB).
        assert held < 16, f"the server holds {held:.0f} MiB more for 4 refused calls"
        assert attacker.statuses == dict.fromkeys(streams, str(grpc.StatusCode.UNAUTHENTICATED.value[0]))
    finally:
        attacker.close()


def test_replies_a_client_never_reads_are_bounded_and_freed_with_its_connection(
    start_server_process: StartServerProcess,
) -> None:
    """Item 2: 60 Pulls of a 4 MB θ on a connection with a zero receive window, never read."""
    server = start_server_process(max_reply_mb=16, max_connection_age=3.0, connection_age_grace=2.0)
    stub = open_stub(server.target)
    stub.Register(
        pb.RegisterRequest(
            spec=SPEC,
            initial_parameters=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[PARAMETERS], data=bytes(4 * PARAMETERS)),
            omit_parameters=True,
        )
    )
    stub.Pull(pb.PullRequest(known_version=-1))  # warm: one reply built and sent
    before = rss_mib(server.pid)
    reader = RawConnection(server.port, receive_window=0)
    try:
        started = time.monotonic()
        for _ in range(60):
            reader.open(PULL, grpc_frame(pb.PullRequest(known_version=-1).SerializeToString()))
        reader.pump(1.5)
        held = rss_mib(server.pid) - before
        # At most 16 MiB of replies (4 of θ), each held about twice (the message and gRPC's copy);
        # before the fix every call held its reply: +460 MiB.
        assert held < 2 * 16 + 16, f"the server holds {held:.0f} MiB more for 60 unread Pulls"

        # An honest reader is served meanwhile (its calls wait their turn, or reconnect on GOAWAY).
        honest = open_stub(server.target)
        for _attempt in range(10):
            try:
                reply = honest.Pull(pb.PullRequest(known_version=-1), timeout=20)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        else:
            pytest.fail("an honest Pull was never served")
        assert len(reply.parameters.data) == 4 * PARAMETERS

        # The server closes the connection after its age and grace (3 + 2 s), and with it frees
        # what the reader never read; before the fix it stayed open as long as the client liked.
        reader.pump(20 - (time.monotonic() - started))
        assert reader.closed_by_server, "the server kept the unread connection open"
        # Freed as the server closes it, and back to the OS at its next trim at the latest (a 0.5 s
        # sleep here assumed the server had let go by then).
        deadline = time.monotonic() + 3 * TRIM_INTERVAL_SECONDS
        while (after := rss_mib(server.pid) - before) >= 16 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert after < 16, f"{after:.0f} MiB still held after the server closed the connection"
    finally:
        reader.close()


def _register_with_name(stub: Any, name_bytes: int) -> grpc.StatusCode:
    try:
        stub.Register(pb.RegisterRequest(spec=SPEC, worker_name="x" * name_bytes), timeout=60)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_requests_past_the_message_limit_are_refused_unread(start_server_process: StartServerProcess) -> None:
    """Item 8 at the defaults: 8 Registers carrying 50 MiB worker names, against the default
    --max-message-mb (4): gRPC refuses each from the length it declares. Before, the limit was
    512 MiB and the server received and parsed them all (+886 MiB resident afterwards)."""
    server = start_server_process()
    before = rss_mib(server.pid)
    stub = open_stub(server.target, max_message_mb=64)
    with ThreadPoolExecutor(8) as pool:
        codes = set(pool.map(_register_with_name, [stub] * 8, [50 * MIB] * 8))
    assert codes == {grpc.StatusCode.RESOURCE_EXHAUSTED}
    held = rss_mib(server.pid) - before
    assert held < 16, f"the server holds {held:.0f} MiB more after 8 refused 50 MiB requests"


def test_a_refused_request_is_freed_when_its_call_ends(start_server_process: StartServerProcess) -> None:
    """Item 8's retention: 2 rounds of 8 Registers with 40 MiB names, within a raised
    --max-message-mb, each refused `too_long`. Before the fix the refusal (context.abort) tied the
    request into reference cycles through the exceptions' tracebacks, which only the cyclic
    garbage collector frees, much later: +886 MiB stayed resident after 8 names of 50 MiB, and
    the free pages they left in the heap stayed too (glibc returns only the heap's top)."""
    server = start_server_process(max_message_mb=64)
    stub = open_stub(server.target)
    stub.Register(  # θ initialised, as in the attack on a live server
        pb.RegisterRequest(
            spec=SPEC,
            initial_parameters=pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[PARAMETERS], data=bytes(4 * PARAMETERS)),
            omit_parameters=True,
        )
    )
    before = rss_mib(server.pid)
    for _round in range(2):
        with grpc.insecure_channel(server.target, options=[("grpc.max_send_message_length", 64 * MIB)]) as channel:
            attacker = pb_grpc.ParameterServerStub(channel)
            with ThreadPoolExecutor(8) as pool:
                codes = set(pool.map(_register_with_name, [attacker] * 8, [40 * MIB] * 8))
        assert codes == {grpc.StatusCode.INVALID_ARGUMENT}
    # 8 x 40 MiB were received at once, each as gRPC's pieces, protobuf's string and Python's;
    # what they leave free in the heap goes back to the OS at the server's next trim (5 s). With
    # glibc's per-thread arenas 38-82 MiB stayed (a CI run failed a bound of 80 so); the server
    # now allocates from one arena (allocator.one_arena) and -3 to 8 MiB stays. The bound is one
    # request's worth, against 672 MiB before the fix.
    deadline = time.monotonic() + 3 * TRIM_INTERVAL_SECONDS
    while (held := rss_mib(server.pid) - before) >= 40 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert held < 40, f"{held:.0f} MiB still held after 16 refused requests of 40 MiB"


def test_calls_past_the_concurrency_limit_are_refused_before_their_request_is_read(
    start_server_process: StartServerProcess,
) -> None:
    """The total bound: 12 calls declaring 16 MiB each, sent but for their last byte, against
    --max-concurrent-rpcs 4: 4 are received (and held while the client stalls), 8 are refused
    RESOURCE_EXHAUSTED unread. An honest SDK client meanwhile is told the server is busy, retries,
    and registers once the stalled calls end."""
    server = start_server_process(max_message_mb=64, max_concurrent_rpcs=4)
    before = rss_mib(server.pid)
    attacker = RawConnection(server.port)
    registered: list[gemps.Registration] = []
    try:
        streams = [attacker.open(REGISTER) for _ in range(12)]
        attacker.send_all_but_the_last_byte(streams, 16 * MIB, seconds=20)
        held = rss_mib(server.pid) - before
        assert held < 4 * 16 + 16, f"the server holds {held:.0f} MiB more for 12 stalled calls"
        refused = [stream for stream, status in attacker.statuses.items() if status == "8"]  # RESOURCE_EXHAUSTED
        assert len(refused) == 8, attacker.statuses

        client = gemps.Client(server.target, retry=gemps.RetryPolicy(max_attempts=100, max_backoff=0.2))
        honest = threading.Thread(target=lambda: registered.append(client.register({"w": np.zeros(4, np.float32)})))
        honest.start()
        time.sleep(1.0)
        assert not registered, "registered while every slot was held"
        attacker.close()  # the stalled calls end with their connection
        honest.join(timeout=30)
        assert registered and registered[0].initialized_central
        assert client.retries >= 1
        client.close()
    finally:
        attacker.close()
