"""Compressed commits with error feedback (`Client(compression="int8" | "int4" | "topk")`, issue 47).

A commit's slice for each server is sent as blockwise int8 or int4 codes (gemps_proto's
block_quantisation: a float32 scale per 256 values) or as each block's 16 largest values
(block_topk). What the codes round away or leave out is not lost: the
client keeps it per server (the residual) and adds it to that server's next slice before encoding,
so over commits the server receives every gradient's sum (error feedback, as Seide et al.'s 1-bit
SGD and Deep Gradient Compression keep theirs). The residual is soft state:
- encoded once per commit, so a retried attempt resends the same bytes (exactly once holds: the
  server deduplicates by request id);
- kept only once that server applied the commit: a refused commit leaves it as it was (the
  commit's gradient is dropped, as an uncompressed refused commit's is);
- zeroed when the client registers, never saved: a worker that restarts loses at most half a
  code's step per value (1/254 of its block's largest value with int8, 1/14 with int4); with
  topk it loses what its blocks left out: up to about 256 / 16 commits' worth of a small value.
"""

from __future__ import annotations

from gemps_proto import vectors
from gemps_proto.tensor_codec import COMPRESSIONS, quantised_subtracting
from gemps_proto.vectors import Vector


class Compressor:
    """One client's encoder for commits and its residual per server (by index in the layout)."""

    def __init__(self, compression: str) -> None:
        self.dtype = COMPRESSIONS[compression]
        self._residuals: dict[int, Vector] = {}

    def encode(self, server: int, values: Vector) -> tuple[bytes, Vector]:
        """The wire bytes of `values` plus the residual kept for `server`, and what the codes leave
        of that sum (the residual to keep once `server` has applied the commit: `applied`)."""
        vectors.require("compression")  # the client refused it without numpy: numpy's arrays from here
        held = self._residuals.get(server)
        if held is None or held.shape != values.shape:
            total = vectors.copy(vectors.as_float32(values))  # the caller's values are left as they are
        else:
            total = vectors.as_float32(values + held)  # this encoder's own
        # The residual in the sum's place, block by block: no θ-sized array of the decoded values.
        return quantised_subtracting(total, self.dtype), total

    def applied(self, server: int, residual: Vector) -> None:
        self._residuals[server] = residual

    def reset(self) -> None:
        """Forget every residual (at registration)."""
        self._residuals.clear()

    def residual(self, server: int) -> Vector | None:
        return self._residuals.get(server)
