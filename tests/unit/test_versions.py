"""The version rule (gemps_proto.versions): when two ends share a protocol, what a peer that
sends no versions is taken to be, how a refusal names both ends; and where the server shows its
own (the build info metric)."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

import gemps
from gemps import errors
from gemps_proto import schema_proto as shared
from gemps_proto import versions
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_proto.versions import Versions
from gemps_server.metrics import ServerMetrics


@pytest.mark.parametrize(
    "one,other,expected",
    [
        (Versions("a", 1, 1), Versions("b", 1, 1), True),
        (Versions("a", 3, 2), Versions("b", 2, 1), True),  # a newer end that still speaks 2
        (Versions("a", 3, 3), Versions("b", 2, 1), False),  # it no longer does
        (Versions("a", 7, 5), versions.LEGACY, False),
        (Versions("a", 2, 1), versions.LEGACY, True),
    ],
)
def test_two_ends_are_compatible_when_their_protocol_ranges_overlap(
    one: Versions, other: Versions, expected: bool
) -> None:
    assert versions.compatible(one, other) is expected
    assert versions.compatible(other, one) is expected  # both ends judge alike


def test_a_peer_that_sends_no_versions_speaks_the_legacy_protocol() -> None:
    assert versions.received("", 0, 0) == versions.LEGACY == Versions("", 1, 1)
    assert versions.received("2.0", 3, 0) == Versions("2.0", 3, 3)  # no oldest said: only its own
    assert shared.versions_from_proto(pb.StatusResponse()) is None
    assert versions.compatible(versions.THIS, versions.LEGACY)  # this build still serves them


def test_a_refusal_names_both_ends() -> None:
    server, client = Versions("9.0.0", 7, 5), Versions("0.4.0", 1, 1)
    message = versions.incompatibility(server, client)
    assert message is not None
    assert "server gemps 9.0.0 (protocols 5-7), client gemps 0.4.0 (protocol 1)" in message
    assert "upgrade the client" in message
    assert "upgrade the server" in (versions.incompatibility(client, server) or "")
    assert versions.incompatibility(versions.THIS, versions.THIS) is None
    refused = errors.incompatible_server("host:1", server)
    assert isinstance(refused, gemps.IncompatibleVersionError) and isinstance(refused, gemps.FailedPreconditionError)
    assert errors.incompatible_server("host:1", None) is None  # a server from before versions


def test_the_build_info_metric_names_the_version() -> None:
    page = generate_latest(ServerMetrics().registry).decode()
    expected = (
        f'gemps_build_info{{oldest_protocol="{versions.OLDEST_PROTOCOL_VERSION}",'
        f'protocol="{versions.PROTOCOL_VERSION}",version="{gemps.__version__}"}} 1.0'
    )
    assert expected in page
