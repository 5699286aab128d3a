"""gemps.named_payloads: named arrays put in the spec's order by name, or refused naming what differs."""

from __future__ import annotations

import numpy as np
import pytest

from gemps import named_payloads
from gemps.errors import FailedPreconditionError, InvalidArgumentError, NamedPayloadError
from gemps_proto.reasons import Reason
from gemps_proto.schema import Buffers, ParameterSpec
from gemps_proto.tensor_codec import INT64

SPEC = (ParameterSpec("w", (2, 2)), ParameterSpec("b", (2,)))
BUFFER_SPEC = (ParameterSpec("mean", (2,)), ParameterSpec("count", (), INT64))


def test_a_mapping_is_laid_out_in_the_spec_order_whatever_its_own() -> None:
    flat = named_payloads.payload_vector({"b": np.array([5, 6]), "w": np.arange(4).reshape(2, 2)}, SPEC)
    assert flat.dtype == np.float32
    np.testing.assert_array_equal(flat, [0, 1, 2, 3, 5, 6])
    np.testing.assert_array_equal(named_payloads.payload_vector(np.ones((3, 2)), SPEC), np.ones(6))  # flat as before


def test_a_misspelled_name_is_offered_the_missing_name_it_resembles() -> None:
    with pytest.raises(NamedPayloadError) as refused:
        named_payloads.flat_by_name("payload", {"w": np.ones((2, 2)), "bb": np.ones(2)}, SPEC)
    assert refused.value.reason == Reason.SPEC_MISMATCH and refused.value.code is InvalidArgumentError.code
    assert refused.value.message == (
        "payload does not name the registered parameters: missing parameter 'b' [2]; "
        "no parameter named bb (did you mean 'b'?)"
    )


def test_a_long_list_of_problems_is_summarised() -> None:
    spec = tuple(ParameterSpec(f"layer{i}", (1,)) for i in range(20))
    with pytest.raises(NamedPayloadError) as refused:
        named_payloads.flat_by_name("payload", {}, spec)
    assert len(refused.value.missing) == 20 and refused.value.message.endswith("; and 12 more")


def test_values_that_are_not_numbers_are_refused_by_name() -> None:
    with pytest.raises(InvalidArgumentError) as refused:
        named_payloads.flat_by_name("payload", {"w": np.ones((2, 2)), "b": ["x", "y"]}, SPEC)
    assert refused.value.reason == Reason.BAD_DTYPE and "payload 'b'" in refused.value.message


def test_named_buffers_are_split_by_kind_in_the_spec_order() -> None:
    delta = named_payloads.buffer_delta({"count": np.array(3), "mean": np.array([0.5, 1.5])}, BUFFER_SPEC)
    np.testing.assert_array_equal(delta.floats, [0.5, 1.5])
    np.testing.assert_array_equal(delta.integers, [3])
    with pytest.raises(InvalidArgumentError, match="has 2 float32 and 0 int64 values; the buffer spec has 2 and 1"):
        named_payloads.buffer_delta(Buffers(np.ones(2, np.float32)), BUFFER_SPEC)


def test_a_registration_refused_for_its_order_says_so_and_another_is_left_alone() -> None:
    refused = FailedPreconditionError("FAILED_PRECONDITION: parameter spec does not match", reason=Reason.SPEC_MISMATCH)
    server = (SPEC, BUFFER_SPEC)
    explained = named_payloads.explained(refused, ((SPEC[1], SPEC[0]), BUFFER_SPEC), server)
    assert explained.message == (
        "FAILED_PRECONDITION: parameter spec does not match (the worker lists the same parameters in another "
        "order; register them in the central variable's: w, b)"
    )
    assert explained.reason == Reason.SPEC_MISMATCH and explained.code == refused.code
    other = ((SPEC[1], ParameterSpec("w", (4,))), BUFFER_SPEC)
    assert named_payloads.explained(refused, other, server) is refused
