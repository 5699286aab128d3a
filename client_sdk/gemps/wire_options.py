"""How a client's tensors travel, as `gemps.Client` takes it: the plane, shared memory, the wire
dtype, streaming, and compressed commits; each checked, or taken from its GEMPS_* variable."""

from __future__ import annotations

import os
from collections.abc import Mapping

from gemps.options import parse_bool
from gemps_proto import vectors
from gemps_proto.reply_differences import REPLY_COMPRESSIONS
from gemps_proto.tensor_codec import COMPRESSIONS, WIRE_DTYPE_NAMES

#: how commits and pulls travel (DESIGN §3c): the data plane where it can, else gRPC; or only one
PLANES = ("auto", "data", "grpc")
#: whether Commit goes by CommitStream: past 1 MiB, always, never
STREAMING_CHOICES = ("auto", "always", "never")


def resolve_plane(plane: str | None, environ: Mapping[str, str] | None = None) -> str:
    """The `plane` asked for, else GEMPS_PLANE's, else "auto"; ValueError for another value."""
    source = "plane"
    if plane is None:
        environ = os.environ if environ is None else environ
        plane, source = environ.get("GEMPS_PLANE") or "auto", "GEMPS_PLANE"
    if plane not in PLANES:
        raise ValueError(f"{source} must be one of {', '.join(PLANES)}, not {plane!r}")
    return plane


def resolve_shared_memory(shared_memory: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """`shared_memory` as asked, else GEMPS_SHARED_MEMORY's (on/off), else on."""
    if shared_memory is not None:
        return shared_memory
    environ = os.environ if environ is None else environ
    return parse_bool(environ.get("GEMPS_SHARED_MEMORY", "on"), "GEMPS_SHARED_MEMORY")


def check_wire_options(
    wire_dtype: str,
    streaming: str,
    chunk_bytes: int,
    compression: str | None = None,
    reply_compression: str | None = None,
) -> None:
    """ValueError naming the option for a value the client does not take; NumpyRequiredError for one
    that computes on every value where numpy is not installed (gemps_proto.vectors)."""
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"compression must be None or one of {', '.join(COMPRESSIONS)}, not {compression!r}")
    if reply_compression is not None and reply_compression not in REPLY_COMPRESSIONS:
        choices = ", ".join(REPLY_COMPRESSIONS)
        raise ValueError(f"reply_compression must be None or one of {choices}, not {reply_compression!r}")
    if wire_dtype not in WIRE_DTYPE_NAMES:
        raise ValueError(f"wire_dtype must be one of {', '.join(WIRE_DTYPE_NAMES)}, not {wire_dtype!r}")
    if streaming not in STREAMING_CHOICES:
        raise ValueError(f"streaming must be one of {', '.join(STREAMING_CHOICES)}, not {streaming!r}")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, not {chunk_bytes}")
    for option, value, default in (
        ("compression", compression, None),
        ("reply_compression", reply_compression, None),
        ("wire_dtype", wire_dtype, "float32"),
    ):
        if value != default:
            vectors.require(f"{option}={value!r}")
