"""A torch model's values as the wire carries them (gemps.pytorch.values, gemps.tied_names)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from gemps.errors import InvalidArgumentError
from gemps.pytorch.values import gather_gradients, host_array, persistent_buffers, trained_parameters
from gemps.records import CentralVariable, ParameterSpec
from gemps.tied_names import expanded


def test_a_tied_tensor_is_listed_once_under_every_name_state_dict_has() -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    scale = torch.ones(2)
    model.register_buffer("scale", scale)
    model[1].register_buffer("shared_scale", scale)  # a shared buffer too
    assert [name for name, _ in trained_parameters(model)] == ["0.weight=1.weight"]
    assert [name for name, _ in persistent_buffers(model)] == ["scale=1.shared_scale"]
    central = CentralVariable(
        version=1,
        flat=np.arange(15, dtype=np.float32),
        spec=(ParameterSpec("0.weight=1.weight", (5, 3)),),
        buffers=np.ones(2, np.float32),
        buffer_spec=(ParameterSpec("scale=1.shared_scale", (2,)),),
    )
    state = central.state_dict()
    assert set(state) == set(model.state_dict()) and state["0.weight"] is state["1.weight"]
    assert list(expanded({"a=b": 1, "c": 2})) == ["a", "b", "c"]


def test_a_name_with_the_separator_is_refused_naming_it() -> None:
    model = nn.Module()
    model.register_parameter("w=v", nn.Parameter(torch.zeros(2)))
    with pytest.raises(InvalidArgumentError, match=r"'w=v'.*rename"):
        trained_parameters(model)


def test_bfloat16_and_sparse_values_become_float32_and_dense() -> None:
    values = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    np.testing.assert_array_equal(host_array(values), np.array([1.5, -2.0], np.float32))
    embedding = nn.Embedding(4, 2, sparse=True)
    linear = nn.Linear(2, 1).to(torch.bfloat16)
    embedding(torch.tensor([1, 1, 3])).sum().backward()  # row 1 twice: its two gradients add up
    linear(torch.ones(1, 2, dtype=torch.bfloat16)).sum().backward()
    out = torch.full((8 + 3,), float("nan"))
    gather_gradients([embedding.weight, linear.weight, linear.bias], out)
    np.testing.assert_array_equal(out.numpy(), [0, 0, 2, 2, 0, 0, 1, 1, 1, 1, 1])
