"""Options that would start a server that cannot serve, or crash it at start (issue 28, item 5).

Every option is checked at start against the range the types its value meets can hold (declared
once, with the option: gemps_proto.schema for the training config, gemps_server.config for the
rest), and a value outside is refused with one line naming it, exit 2. The issue's values, against
real `gemps server` processes; every ranged option just outside each end of its range (and NaN
and infinities for the real-valued ones), on the command line and in the environment; and a
server configured at the far ends of every range, which must start and answer every call.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from gemps_cli import server as server_command

from gemps.options import env_var, flag
from gemps_proto.ranges import Range, range_of
from gemps_proto.schema import TrainingConfig
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.config import ServerConfig
from tests.helpers import InProcessServer, server_outcome
from tests.integration.conftest import NUM_PARAMETERS, SPEC, open_stub

pytestmark = pytest.mark.timeout(300)

RANGED = [f for cls in (TrainingConfig, ServerConfig) for f in dataclasses.fields(cls) if range_of(f) is not None]

# Found by the issue against a running server: each started one that failed every call, or
# crashed at start with a traceback, or was accepted silently.
ISSUE_VALUES = [
    ("--lr-warmup-commits", str(2**64)),
    ("--lr-total-commits", str(2**64)),
    ("--lr-step-size", str(2**70)),
    ("--batch-size", str(2**32)),
    ("--num-shards", str(2**32)),
    ("--learning-rate", "inf"),
    ("--max-connection-age", "inf"),
    ("--max-connection-age", "3e6"),
    ("--handshake-timeout", "1e7"),
    ("--max-streams-per-connection", str(2**40)),
    ("--lease-ttl", "nan"),
    ("--shutdown-grace", "nan"),
    ("--checkpoint-interval", "nan"),
]


@pytest.mark.parametrize(("option", "value"), ISSUE_VALUES)
def test_the_issues_values_stop_the_server_at_start_in_one_line(option: str, value: str, tmp_path: Path) -> None:
    code, output = server_outcome(tmp_path, "--port", "0", "--data-port", "0", "--metrics-port", "-1", option, value)
    assert code is not None, f"{option} {value}: the server started\n" + "\n".join(output)
    assert code == 2, output
    assert len(output) == 1, output
    assert option.removeprefix("--").replace("-", "_") in output[0], output
    assert "is outside" in output[0], output


def outside(bounds: Range, kind: type) -> list[Any]:
    """Values just past each end of `bounds` (the end itself where it is open), and for real
    values NaN and both infinities."""
    if kind is int:
        return [int(bounds.low) - 1 + int(bounds.low_open), int(bounds.high) + 1 - int(bounds.high_open)]
    below = float(bounds.low) if bounds.low_open else math.nextafter(bounds.low, -math.inf)
    above = float(bounds.high) if bounds.high_open else math.nextafter(bounds.high, math.inf)
    return [below, above, math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("field", RANGED, ids=[f.name for f in RANGED])
def test_every_value_outside_an_options_range_is_refused_in_one_line(field: dataclasses.Field[Any]) -> None:
    bounds = range_of(field)
    assert bounds is not None
    # An int's subclass (the ports that follow --port: a marker default) is an int option.
    for value in outside(bounds, int if isinstance(field.default, int) else type(field.default)):
        for argv, environ in (([f"{flag(field.name)}={value!r}"], {}), ([], {env_var(field.name): repr(value)})):
            with pytest.raises(ValueError) as refused:
                server_command.parse_config(argv, environ=environ)
            message = str(refused.value)
            assert "\n" not in message
            assert f"{field.name} {value!r} is outside {bounds}" in message, (value, message)


def far_ends(high: bool) -> dict[str, Any]:
    """Every ranged option at one end of its range (inside it), but those that would name a fixed
    port, start 65,535 partitions (or 9 replicas) or stop the server at once, and durations at their low ends (a
    millisecond to finish a handshake or a call is no time to serve one: valid, and the
    operator's choice); the few related options made to agree with each other."""
    # Replicas are skipped as partitions are: each would be a process of its own, told its role by
    # etcd (tests/integration/test_replicas.py starts them).
    replicated = {"replicas", "replica_index", "replication_port"}
    skip = {"port", "data_port", "metrics_port", "partitions", "partition_index", "supervisor_pid", *replicated}
    values: dict[str, Any] = {}
    for field in RANGED:
        bounds = range_of(field)
        assert bounds is not None
        if field.name in skip or (not high and bounds.unit == "seconds"):
            continue
        end, is_open = (bounds.high, bounds.high_open) if high else (bounds.low, bounds.low_open)
        if type(field.default) is int:
            values[field.name] = int(end) + (-1 if high else 1) * int(is_open)
        elif is_open:  # the nearest value inside an open end
            values[field.name] = math.nextafter(end, -math.inf if high else math.inf)
        else:
            values[field.name] = float(end)
    if high:
        values["max_watches"] = values["max_unauthenticated_rpcs"] - 1
    else:
        values["max_unauthenticated_rpcs"] = values["max_watches"] + 1
        values["lr_min"] = 0.0
        values["max_parameters"] = NUM_PARAMETERS  # the model this test registers
    values["max_watches_per_connection"] = values["max_watches"]
    return values


@pytest.mark.parametrize("high", [False, True], ids=["low ends", "high ends"])
def test_a_server_at_the_ends_of_every_range_starts_and_answers_every_call(high: bool, tmp_path: Path) -> None:
    """What the checks let through, the server can hold: started at the ends of every range,
    Register, Status, Pull and Commit are answered (a commit that would make θ infinite, say
    with the largest learning rate, is refused INVALID_ARGUMENT as any such commit is), never
    UNKNOWN ("Value out of range") or a crash."""
    options = far_ends(high)
    server = InProcessServer(**options, checkpoint_dir=tmp_path).start()
    try:
        stub = open_stub(server.target)
        initial = tensor_to_proto(np.linspace(-1, 1, NUM_PARAMETERS, dtype=np.float32))
        registered = stub.Register(pb.RegisterRequest(spec=SPEC, initial_parameters=initial), timeout=30)
        stub.Status(pb.StatusRequest(), timeout=30)
        stub.Pull(pb.PullRequest(worker_id=registered.worker_id, known_version=-1), timeout=30)
        payload = tensor_to_proto(np.ones(NUM_PARAMETERS, np.float32))
        try:
            commit = pb.CommitRequest(
                worker_id=registered.worker_id, base_version=0, kind=pb.PAYLOAD_KIND_GRADIENT, payload=payload
            )
            stub.Commit(commit, timeout=30)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
            assert isinstance(error, grpc.Call)
            reason = next((value for key, value in error.trailing_metadata() or () if key == "gemps-reason"), None)
            assert reason == "non_finite", error
        stub.Status(pb.StatusRequest(), timeout=30)
    finally:
        server.stop()
