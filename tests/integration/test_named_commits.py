"""Named payloads on a real server (issue 49, item 1): a commit's payload or buffer delta given
as a mapping is matched to the registered spec by name, whatever its order; a missing,
unknown or misspelled name, or a wrong shape, is refused by the SDK (NamedPayloadError,
INVALID_ARGUMENT) naming it, before anything is sent, and θ and the buffers stay as they were. A
later worker registering the same entries in another order is refused, told the server's order."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.schema import Buffers
from tests.helpers import InProcessServer
from tests.integration.conftest import StartServer

W, B = np.zeros((3, 2), np.float32), np.zeros(2, np.float32)
BUFFERS = {"bn.running_mean": np.zeros(3, np.float32), "bn.running_var": np.ones(3, np.float32)}


@pytest.fixture
def downpour(start_server: StartServer) -> InProcessServer:
    """θ moves by exactly -g: each commit's effect can be read off θ."""
    return start_server(rule="downpour", learning_rate=1.0)


def _refused(client: gemps.Client, payload: Any, **options: Any) -> gemps.NamedPayloadError:
    """The NamedPayloadError a commit raises; the server's version and θ are checked unchanged."""
    before = client.pull()
    with pytest.raises(gemps.NamedPayloadError) as refused:
        client.commit(payload, **options)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(refused.value, gemps.InvalidArgumentError)
    with gemps.Client(client.target) as observer:  # a fresh read of the server's θ, not the client's copy
        after = observer.pull()
        assert after.version == before.version
        np.testing.assert_array_equal(after.flat, before.flat)
        np.testing.assert_array_equal(after.buffers, before.buffers)
    return refused.value


def test_a_commit_by_name_applies_each_array_to_its_own_parameter(downpour: InProcessServer) -> None:
    """The issue's repro: registered {"w", "b"}, committed {"b": ones, "w": zeros}."""
    with gemps.Client(downpour.target) as client:
        client.register({"w": W, "b": B})
        result = client.commit({"b": np.ones(2, np.float32), "w": np.zeros((3, 2), np.float32)})
        named = result.parameters.named()
        np.testing.assert_array_equal(named["w"], np.zeros((3, 2)))  # was -1 before: b's ones landed in w
        np.testing.assert_array_equal(named["b"], [-1.0, -1.0])
        flat = client.commit(np.concatenate([np.full(6, 2, np.float32), np.zeros(2, np.float32)]))  # as before
        np.testing.assert_array_equal(flat.parameters.named()["w"], np.full((3, 2), -2.0))


def test_a_misspelled_or_missing_name_is_refused_before_anything_is_sent(downpour: InProcessServer) -> None:
    with gemps.Client(downpour.target) as client:
        client.register({"weight": W, "bias": B})
        client.commit({"weight": np.ones((3, 2), np.float32), "bias": np.ones(2, np.float32)})
        misspelled = _refused(client, {"weight": np.ones((3, 2), np.float32), "bais": np.ones(2, np.float32)})
        assert misspelled.reason == gemps.Reason.SPEC_MISMATCH
        assert (misspelled.missing, misspelled.unknown) == (("bias",), ("bais",))
        assert "missing parameter 'bias' [2]" in misspelled.message
        assert "no parameter named bais (did you mean 'bias'?)" in misspelled.message
        missing = _refused(client, {"weight": np.ones((3, 2), np.float32)})
        assert missing.missing == ("bias",) and not missing.unknown
        extra = {"weight": np.ones((3, 2), np.float32), "bias": np.ones(2, np.float32), "scale": np.ones(1)}
        assert "no parameter named scale" in _refused(client, extra, kind="update").message


def test_a_wrong_shape_is_refused_naming_expected_and_given(downpour: InProcessServer) -> None:
    with gemps.Client(downpour.target) as client:
        client.register({"w": W, "b": B})
        transposed = _refused(client, {"w": np.ones((2, 3), np.float32), "b": np.ones(2, np.float32)})
        assert transposed.reason == gemps.Reason.BAD_SHAPE
        assert transposed.shapes == {"w": ((3, 2), (2, 3))}
        assert "'w' has 6 values of shape [2, 3], registered [3, 2]" in transposed.message
        longer = _refused(client, {"w": np.ones((3, 2), np.float32), "b": np.ones(3, np.float32)})
        assert "'b' has 3 values of shape [3], registered [2]" in longer.message
        assert client.commit({"w": np.ones((3, 2), np.float32), "b": np.ones(2, np.float32)}).version == 1


def test_buffer_deltas_are_matched_by_name_and_refused_alike(downpour: InProcessServer) -> None:
    with gemps.Client(downpour.target) as client:
        client.register({"w": W, "b": B}, BUFFERS)
        gradient = np.zeros(8, np.float32)
        delta = {"bn.running_var": np.full(3, 2, np.float32), "bn.running_mean": np.full(3, 0.5, np.float32)}
        named = client.commit(gradient, buffer_delta=delta).parameters.named_buffers()
        np.testing.assert_array_equal(named["bn.running_mean"], [0.5, 0.5, 0.5])
        np.testing.assert_array_equal(named["bn.running_var"], [3.0, 3.0, 3.0])
        misspelled = {"bn.running_mean": np.ones(3, np.float32), "bn.runing_var": np.ones(3, np.float32)}
        refused = _refused(client, gradient, buffer_delta=misspelled)
        assert (refused.missing, refused.unknown) == (("bn.running_var",), ("bn.runing_var",))
        assert "no buffer named bn.runing_var (did you mean 'bn.running_var'?)" in refused.message
        reshaped = {"bn.running_mean": np.ones((1, 3), np.float32), "bn.running_var": np.ones(3, np.float32)}
        refused = _refused(client, gradient, buffer_delta=reshaped)  # as many values, another shape
        assert refused.shapes == {"bn.running_mean": ((3,), (1, 3))}
        with pytest.raises(gemps.InvalidArgumentError, match="has 5 float32 and 0 int64 values"):
            client.commit(gradient, buffer_delta=Buffers(np.ones(5, np.float32)))


def test_a_later_worker_listing_its_names_in_another_order_is_told_the_order(downpour: InProcessServer) -> None:
    """Refused, as before, but saying why: registered in the server's order instead, its flat
    payloads (RemoteModel's gradients, in the model's order) would be applied to other parameters."""
    with gemps.Client(downpour.target) as first, gemps.Client(downpour.target) as later:
        first.register({"w": W, "b": B}, BUFFERS)
        with pytest.raises(gemps.FailedPreconditionError) as reordered:
            later.register({"b": B, "w": W}, dict(reversed(BUFFERS.items())))
        assert reordered.value.reason == gemps.Reason.SPEC_MISMATCH
        assert (
            "the worker lists the same parameters in another order; register them in the central variable's: w, b"
            in (reordered.value.message)
        )
        assert "same buffers in another order; register them in the central variable's: bn.running_mean, " in (
            reordered.value.message
        )
        with pytest.raises(gemps.FailedPreconditionError) as different:
            later.register({"b": B, "w": np.zeros((2, 3), np.float32)}, BUFFERS)  # not only the order
        assert "another order" not in different.value.message
        assert not later.register({"w": W, "b": B}, BUFFERS).initialized_central  # in the server's order: in
