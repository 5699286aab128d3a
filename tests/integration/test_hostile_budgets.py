"""Clients without the token cannot take what workers need (issue 28, item 2), against a real
server process attacked over raw HTTP/2.

Health checks need no token (probes cannot send one), and a Health.Watch never ends. grpc.aio's
`maximum_concurrent_rpcs` counted them like any call, so 6 connections x 90 Watch streams held
every place of --max-concurrent-rpcs and workers were refused RESOURCE_EXHAUSTED for as long as
the attacker liked. Now calls that need no token have a small budget of their own
(--max-unauthenticated-rpcs), and Watch streams are bounded per connection and in total.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.v1 import parameter_server_pb2_grpc as pb_grpc
from gemps_server.config import ServerConfig
from tests.helpers import scrape_series, wait_for
from tests.integration.conftest import StartServerProcess
from tests.raw_http2 import RawConnection, grpc_frame

pytestmark = pytest.mark.timeout(180)

TOKEN = "sekrit-token"
WATCH = "/grpc.health.v1.Health/Watch"
CHECK = "/grpc.health.v1.Health/Check"
RESOURCE_EXHAUSTED = str(grpc.StatusCode.RESOURCE_EXHAUSTED.value[0])
DEFAULTS = ServerConfig()


def authenticated_statuses(target: str, calls: int) -> list[grpc.StatusCode]:
    """`calls` Status calls at once with the token, no retries: each one's status code."""
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.ParameterServerStub(channel)

        def status(_index: int) -> grpc.StatusCode:
            try:
                stub.Status(pb.StatusRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),), timeout=30)
            except grpc.RpcError as error:
                return error.code()
            return grpc.StatusCode.OK

        with ThreadPoolExecutor(calls) as pool:
            return list(pool.map(status, range(calls)))


def probe(target: str) -> int:
    """What a container's health probe sees: Health.Check without a token."""
    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=30)
    return int(reply.status)


def test_watch_streams_without_the_token_leave_workers_every_place(
    start_server_process: StartServerProcess,
) -> None:
    """The issue's attack: 6 connections x 90 Health.Watch streams, no token, against
    --max-concurrent-rpcs 20. Before, every place was held and 20 of 20 Status calls with the
    token were refused; now the Watch streams are capped (per connection and in total) and
    count in their own budget, and every Status call is served."""
    server = start_server_process(auth_token=TOKEN, max_concurrent_rpcs=20)
    request = grpc_frame(health_pb2.HealthCheckRequest(service="").SerializeToString())
    attackers = [RawConnection(server.port) for _ in range(6)]
    try:
        calls = [(attacker, [attacker.open(WATCH, request) for _ in range(90)]) for attacker in attackers]

        def settled() -> bool:  # every stream answered: SERVING (held open) or refused
            for attacker in attackers:
                attacker.pump(0.05)
            return all(s in a.statuses or a.received[s] > 0 for a, opened in calls for s in opened)

        wait_for(settled, 60, "every Watch stream answered")
        # While the attacker holds what it could, workers get every place and probes still answer.
        assert authenticated_statuses(server.target, 20) == [grpc.StatusCode.OK] * 20
        assert probe(server.target) == health_pb2.HealthCheckResponse.SERVING

        held = [[s for s in opened if s not in a.statuses] for a, opened in calls]
        assert sum(map(len, held)) <= DEFAULTS.max_watches
        assert all(len(h) <= DEFAULTS.max_watches_per_connection for h in held)
        refused = [(a.statuses[s], a.reasons.get(s)) for a, opened in calls for s in opened if s in a.statuses]
        assert len(refused) >= 6 * 90 - DEFAULTS.max_watches
        assert {status for status, _ in refused} == {RESOURCE_EXHAUSTED}
        assert {reason for _, reason in refused} <= {"watch_limit", "unauthenticated_limit"}
        series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert series['gemps_refused_requests_total{reason="watch_limit"}'] > 0
    finally:
        for attacker in attackers:
            attacker.close()


def test_stalled_health_checks_are_capped_by_their_own_budget(start_server_process: StartServerProcess) -> None:
    """Health checks that never send their request hold a place while their request is awaited:
    40 of them, without the token, take at most --max-unauthenticated-rpcs places (the rest are
    refused at once) and none of --max-concurrent-rpcs, which workers still get whole."""
    server = start_server_process(auth_token=TOKEN, max_concurrent_rpcs=20)
    attacker = RawConnection(server.port)
    try:
        stalled = [attacker.open(CHECK) for _ in range(40)]  # headers only: the request never comes
        attacker.until(
            lambda: len(attacker.statuses) >= 40 - DEFAULTS.max_unauthenticated_rpcs,
            60,
            "the checks past the budget refused",
        )
        assert authenticated_statuses(server.target, 20) == [grpc.StatusCode.OK] * 20
        refused = {s: attacker.reasons.get(s) for s in stalled if s in attacker.statuses}
        assert len(refused) == 40 - DEFAULTS.max_unauthenticated_rpcs
        assert set(refused.values()) == {"unauthenticated_limit"}
        series = scrape_series(f"http://127.0.0.1:{server.metrics_port}/metrics")
        assert series['gemps_refused_requests_total{reason="unauthenticated_limit"}'] == len(refused)
    finally:
        attacker.close()
