"""The model's buffers (batch-norm running statistics and the like) on a real server: registered
with the parameters, changed by each commit's buffer_delta, returned in every reply, refused
when malformed without touching anything, kept in checkpoints across a restart, exported by
name; a model without buffers sees no new field on the wire."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import safetensors.numpy

import gemps
from gemps_proto.schema import ParameterSpec
from gemps_proto.schema_proto import tensor_to_proto
from gemps_proto.tensor_codec import INT64
from gemps_proto.v1 import parameter_server_pb2 as pb
from gemps_server.checkpoint_files import list_checkpoints, load
from tests.helpers import InProcessServer, gemps_export
from tests.integration.conftest import StartServerProcess, open_stub, register

PARAMS = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(2, np.float32)}
BUFFERS = {"bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)}
DELTA = np.array([0.5, -0.25, 1.0, 0.0, 2.0, -0.5], np.float32)
GRADIENT = np.ones(8, np.float32)


def test_buffers_change_by_each_commits_delta_and_travel_in_every_reply(server: InProcessServer) -> None:
    with gemps.Client(server.target) as first, gemps.Client(server.target) as second:
        first.register(PARAMS, BUFFERS)
        assert first.central is not None
        np.testing.assert_array_equal(first.central.buffers, [0, 0, 0, 1, 1, 1])
        result = first.commit(GRADIENT, buffer_delta=DELTA)
        expected = np.array([0.5, -0.25, 1.0, 1.0, 3.0, 0.5], np.float32)
        np.testing.assert_array_equal(result.parameters.buffers, expected)
        np.testing.assert_array_equal(result.parameters.named_buffers()["bn.running_var"], expected[3:])
        # By name too, and a commit without a delta leaves them as they are.
        result = first.commit(GRADIENT, buffer_delta={"bn.running_mean": DELTA[:3], "bn.running_var": DELTA[3:]})
        expected = expected + DELTA
        np.testing.assert_array_equal(result.parameters.buffers, expected)
        np.testing.assert_array_equal(first.commit(GRADIENT).parameters.buffers, expected)
        # A later worker's own buffers do not count: it receives the central ones, as with θ.
        second.register(PARAMS, {name: value + 7 for name, value in BUFFERS.items()})
        assert second.central is not None
        np.testing.assert_array_equal(second.central.buffers, expected)
        np.testing.assert_array_equal(second.pull().buffers, expected)
        state = second.central.state_dict()
        assert list(state) == ["w", "b", "bn.running_mean", "bn.running_var"]
        status = second.status()
        assert status.buffer_spec == (ParameterSpec("bn.running_mean", (3,)), ParameterSpec("bn.running_var", (3,)))


def test_bad_buffers_are_refused_and_touch_nothing(server: InProcessServer) -> None:
    with gemps.Client(server.target) as client:
        client.register(PARAMS, BUFFERS)
        before = client.commit(GRADIENT, buffer_delta=np.full(6, 3e38, np.float32)).parameters  # finite, near the top
        for delta, text in (
            (np.ones(5, np.float32), "buffer_delta shape [5]"),
            (np.ones(7, np.float32), "buffer_delta shape [7]"),  # too long: not cut to fit
            ({**BUFFERS, "bn.extra": np.ones(1, np.float32)}, "no buffer named bn.extra"),
            ({"bn.running_mean": np.ones(4, np.float32), "bn.running_var": np.ones(2, np.float32)}, "has 4 values"),
            (np.full(6, np.nan, np.float32), "NaN or Inf"),
            (np.full(6, 3e38, np.float32), "overflow"),  # finite, but the sum is not
        ):
            with pytest.raises(gemps.GempsError) as refused:
                client.commit(GRADIENT, buffer_delta=delta)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and text in refused.value.message
        after = client.pull()
        assert after.version == before.version  # nothing applied: not θ, not the buffers
        np.testing.assert_array_equal(after.flat, before.flat)
        np.testing.assert_array_equal(after.buffers, before.buffers)
        with gemps.Client(server.target) as other:
            with pytest.raises(gemps.GempsError) as mismatch:
                other.register(PARAMS, {"bn.running_mean": np.zeros(4, np.float32)})
            assert mismatch.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "buffer 0: server has 'bn.running_mean' [3], worker sent 'bn.running_mean' [4]" in (
                mismatch.value.message
            )


def test_first_registration_with_a_buffer_spec_needs_the_values(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    request = pb.RegisterRequest(
        spec=[pb.ParameterSpec(name="w", shape=[2], dtype=pb.DTYPE_FLOAT32)],
        initial_parameters=tensor_to_proto(np.zeros(2, np.float32)),
        buffer_spec=[pb.ParameterSpec(name="w", shape=[1], dtype=pb.DTYPE_FLOAT32)],
        initial_buffers=tensor_to_proto(np.zeros(1, np.float32)),
    )
    with pytest.raises(grpc.RpcError) as same_name:
        stub.Register(request)
    assert same_name.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "buffer name 'w' appears twice" in str(same_name.value.details())
    request.buffer_spec[0].name = "n"
    request.ClearField("initial_buffers")
    with pytest.raises(grpc.RpcError) as missing:
        stub.Register(request)
    assert "initial_buffers is missing" in str(missing.value.details())
    assert not stub.Status(pb.StatusRequest()).initialized


def test_a_model_without_buffers_gets_no_buffer_fields(server: InProcessServer) -> None:
    stub = open_stub(server.target)
    registered = register(stub)
    assert not registered.HasField("buffers")
    reply = stub.Commit(
        pb.CommitRequest(
            worker_id=registered.worker_id,
            kind=pb.PAYLOAD_KIND_GRADIENT,
            payload=tensor_to_proto(np.ones(16, np.float32)),
        )
    )
    assert not reply.HasField("buffers")
    assert not stub.Pull(pb.PullRequest(worker_id=registered.worker_id, known_version=-1)).HasField("buffers")


def export(directory: Path, out: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, np.ndarray]]:
    """`gemps export DIRECTORY --out OUT`, which must succeed, and the tensors it wrote."""
    result = gemps_export(str(directory), out=out)
    assert result.returncode == 0, result.stderr
    return result, safetensors.numpy.load_file(str(out))


def test_buffers_survive_a_restart_and_are_exported_by_name(
    tmp_path: Path, start_server_process: StartServerProcess
) -> None:
    directory = tmp_path / "ckpt"
    options = {"checkpoint_dir": directory, "checkpoint_every": 1, "checkpoint_interval": 0}
    server = start_server_process(**options)
    with gemps.Client(server.target) as client:
        client.register(PARAMS, BUFFERS)
        trained = client.commit(GRADIENT, buffer_delta=DELTA).parameters
    assert server.stop() == 0
    saved = load(list_checkpoints(directory)[-1][1])
    np.testing.assert_array_equal(saved.image.buffers.floats, trained.buffers)
    restarted = start_server_process(port=server.port, **options)
    with gemps.Client(restarted.target) as client:
        client.register(PARAMS, BUFFERS)  # not the initialiser now: it receives the restored buffers
        assert client.central is not None
        np.testing.assert_array_equal(client.central.buffers, trained.buffers)
        np.testing.assert_array_equal(client.central.flat, trained.flat)
    result, exported = export(directory, tmp_path / "model.safetensors")
    assert "4 tensors, 8 parameters, 6 buffer values" in result.stdout
    np.testing.assert_array_equal(exported["bn.running_var"], trained.named_buffers()["bn.running_var"])
    np.testing.assert_array_equal(exported["w"], trained.named()["w"])


def test_gemps_status_shows_the_buffers_and_eta(server: InProcessServer) -> None:
    with gemps.Client(server.target) as client:
        client.register(PARAMS, BUFFERS)
        shown = subprocess.run(
            [sys.executable, "-m", "gemps_cli", "status", "--server", server.target],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert shown.returncode == 0, shown.stderr
    assert "buffers         6 in 2 tensors" in shown.stdout
    assert "learning rate   0.05 now (constant schedule)" in shown.stdout


# 2**24: where float32 stops counting
COUNTED: dict[str, np.ndarray] = {**BUFFERS, "bn.num_batches_tracked": np.array(2**24, np.int64)}


@pytest.mark.usefixtures("plane")  # commits and pulls over the data plane and over gRPC
@pytest.mark.parametrize("streaming", ["never", "always"])  # unary calls, and RegisterStream/PullStream/CommitStream
def test_integer_buffers_count_past_2_to_the_24_exactly_everywhere(
    tmp_path: Path, start_server_process: StartServerProcess, streaming: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 28: an integer buffer is int64 on the wire, on the server, in checkpoints and in the
    export, so num_batches_tracked counts on past 2**24 (float32 stayed at 16,777,216)."""
    if streaming == "always":  # registration in pieces too: models past the threshold register so
        monkeypatch.setattr(gemps.grpc_transport, "STREAM_THRESHOLD_BYTES", 0)
    directory = tmp_path / "ckpt"
    options = {"checkpoint_dir": directory, "checkpoint_every": 1, "checkpoint_interval": 0}
    server = start_server_process(**options)
    counted = 2**24
    with gemps.Client(server.target, streaming=streaming) as client, gemps.Client(server.target) as observer:
        client.register(PARAMS, COUNTED)
        assert client.buffer_spec[-1] == ParameterSpec("bn.num_batches_tracked", (), INT64)
        for _ in range(3):
            delta = {**{name: np.zeros_like(value) for name, value in BUFFERS.items()}}
            delta["bn.num_batches_tracked"] = np.array(1)
            named = client.commit(GRADIENT, buffer_delta=delta).parameters.named_buffers()
            counted += 1
            assert named["bn.num_batches_tracked"].dtype == np.int64
            assert int(named["bn.num_batches_tracked"]) == counted
        assert int(observer.pull().named_buffers()["bn.num_batches_tracked"]) == counted
        assert observer.status().buffer_spec == client.buffer_spec
    assert server.stop() == 0
    saved = load(list_checkpoints(directory)[-1][1])
    assert saved.image.buffers.integers.tolist() == [counted]
    restarted = start_server_process(port=server.port, **options)
    with gemps.Client(restarted.target, streaming=streaming) as client:
        client.register(PARAMS, COUNTED)  # not the initialiser now: it receives the restored count
        assert client.central is not None
        assert int(client.central.named_buffers()["bn.num_batches_tracked"]) == counted
    counter = export(directory, tmp_path / "model.safetensors")[1]["bn.num_batches_tracked"]
    assert counter.dtype == np.int64 and counter.shape == () and int(counter) == counted


def test_a_float_spec_for_an_integer_buffer_is_a_mismatch(server: InProcessServer) -> None:
    """The buffer spec says each buffer's kind: a worker whose counter is float does not match."""
    with gemps.Client(server.target) as first, gemps.Client(server.target) as second:
        first.register(PARAMS, COUNTED)
        with pytest.raises(gemps.FailedPreconditionError, match=r"num_batches_tracked.* int64"):
            second.register(PARAMS, {**COUNTED, "bn.num_batches_tracked": np.array(0.0, np.float32)})


def past_int64(value: int) -> str:
    """The SDK's refusal of `value` in the counter, with or without numpy."""
    return f"buffer 'bn.num_batches_tracked': {value} is outside int64's range [-2**63, 2**63 - 1]"


@pytest.mark.parametrize(("counter", "value"), [(2**64, 2**64), ([1, 2**63], 2**63)], ids=["2**64", "2**63 by 1"])
def test_an_integer_buffer_int64_cannot_hold_is_refused_by_name_before_anything_is_sent(
    server: InProcessServer, counter: int | list[int], value: int
) -> None:
    """Issue 77, item 7: numpy typed 2**64 as an object and [1, 2**63] as float64, so the counter
    registered as a float32 buffer (no integer buffer at all), silently; without numpy it was a
    bare OverflowError. Now the SDK refuses it naming the buffer and int64's range (the same error
    without numpy: test_sdk_without_numpy.py), registering nothing; a delta likewise."""
    with gemps.Client(server.target) as client:
        with pytest.raises(ValueError, match=re.escape(past_int64(value))):
            client.register(PARAMS, {**COUNTED, "bn.num_batches_tracked": counter})
        assert not client.status().initialized  # nothing was sent
        client.register(PARAMS, COUNTED)
        delta: dict[str, Any] = {name: np.zeros_like(values) for name, values in BUFFERS.items()}
        with pytest.raises(ValueError, match=re.escape(past_int64(2**64))):
            client.commit(GRADIENT, buffer_delta={**delta, "bn.num_batches_tracked": 2**64})
        assert client.pull().version == 0


def test_a_raw_clients_integer_delta_past_int64_is_refused_naming_the_buffer(server: InProcessServer) -> None:
    """Issue 77, item 7: no int64 on the wire holds 2**64, but a delta can take a buffer past
    2**63 - 1; the server refused it without saying which buffer."""
    stub = open_stub(server.target)
    top = np.array(2**63 - 1, "<i8")
    registered = stub.Register(
        pb.RegisterRequest(
            spec=[pb.ParameterSpec(name="w", shape=[2], dtype=pb.DTYPE_FLOAT32)],
            initial_parameters=tensor_to_proto(np.zeros(2, np.float32)),
            buffer_spec=[pb.ParameterSpec(name="bn.num_batches_tracked", dtype=pb.DTYPE_INT64)],
            initial_integer_buffers=pb.Tensor(dtype=pb.DTYPE_INT64, data=top.tobytes()),
        )
    )
    step = pb.Tensor(
        dtype=pb.DTYPE_INT64, shape=[1], data=np.array([1], "<i8").tobytes()
    )  # flat, as the server holds them
    commit = pb.CommitRequest(
        worker_id=registered.worker_id,
        kind=pb.PAYLOAD_KIND_GRADIENT,
        payload=tensor_to_proto(np.zeros(2, np.float32)),
        integer_buffer_delta=step,
    )
    with pytest.raises(grpc.RpcError) as refused:
        stub.Commit(commit)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (
        "integer_buffer_delta makes buffer 'bn.num_batches_tracked' leave int64's range [-2**63, 2**63 - 1] "
        f"({2**63 - 1} + 1)"
    ) in str(refused.value.details())
    assert stub.Status(pb.StatusRequest()).version == 0
