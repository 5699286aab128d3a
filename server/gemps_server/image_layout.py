"""How a StateImage is written as named arrays and text: checkpoint files (checkpoint_files.py)
and replica seeds (replication/image_codec.py) both write it with these, so a concern every image
carries is laid out once, and a seed's digest covers it as the seed's bytes do.

The two formats differ only where their readers always did: θ's tensor name, and whether a
model without float or integer buffers gets an empty tensor for them.
"""

from __future__ import annotations

import json

import numpy as np

from gemps_proto.schema import ParameterSpec, buffer_counts
from gemps_proto.tensor_codec import INT64
from gemps_server.domain.records import PartitionOf, StateImage

BUFFERS_KEY = "buffers"
INTEGER_BUFFERS_KEY = "integer_buffers"
RULE_STATE_PREFIX = "rule."
# A spec entry's "dtype" in the metadata, when it is not float32 (files before integer buffers: none).
SPEC_DTYPES = {"int64": INT64}


def state_tensors(image: StateImage, theta_key: str, *, empty_buffers: bool) -> dict[str, np.ndarray]:
    """`image`'s arrays by name, each contiguous in the dtype it is read back as: θ under
    `theta_key`, the float and the integer buffers (a kind the model has none of only with
    `empty_buffers`), the rule's global state under RULE_STATE_PREFIX."""
    tensors: dict[str, np.ndarray] = {theta_key: np.ascontiguousarray(image.theta, dtype=np.float32)}
    floats, integers = buffer_counts(image.buffer_spec)
    if floats or empty_buffers:
        tensors[BUFFERS_KEY] = np.ascontiguousarray(image.buffers.floats, dtype=np.float32)
    if integers or empty_buffers:
        tensors[INTEGER_BUFFERS_KEY] = np.ascontiguousarray(image.buffers.integers, dtype=np.int64)
    for key, value in image.rule_state.items():
        tensors[RULE_STATE_PREFIX + key] = np.ascontiguousarray(value, dtype=np.float32)
    return tensors


def state_metadata(image: StateImage) -> dict[str, str]:
    """What describes `image`'s model, as text: its parameter and buffer specs and its partition."""
    return {
        "spec": spec_json(image.spec),
        "buffer_spec": spec_json(image.buffer_spec),
        "partition": partition_json(image.partition),
    }


def spec_json(spec: tuple[ParameterSpec, ...]) -> str:
    names = {dtype: name for name, dtype in SPEC_DTYPES.items()}
    return json.dumps([
        {"name": entry.name, "shape": list(entry.shape), **({"dtype": names[entry.dtype]} if entry.integer else {})}
        for entry in spec
    ])  # fmt: skip


def partition_json(partition: PartitionOf) -> str:
    return json.dumps({"index": partition.index, "count": partition.count})
