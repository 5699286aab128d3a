"""GEM's update as one compiled pass (numba), for `--gem-kernel numba`.

Optional (`pip install 'gemps[numba]'`): about 3x faster than the blocked numpy pass, and it
releases the GIL, but loading LLVM costs about 125 MB of resident memory and 1-2 s of start-up
(docs/PERFORMANCE.md). The statistics still come from gem.py's sample; this kernel only moves
theta, the proxy and s_i, with the same float32 operations in the same order as the numpy pass.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

GemUpdate = Callable[..., None]


@cache
def gem_update_kernel() -> GemUpdate:
    """Compile (or load from numba's cache) the kernel; ImportError when numba is missing."""
    import numba

    vector = numba.float32[::1]
    scalar = numba.float32
    signatures = [
        numba.void(vector, vector, vector, update, scalar, scalar, scalar, scalar, scalar)
        for update in (vector, numba.types.Array(numba.float32, 1, "C", readonly=True))
    ]

    @numba.njit(signatures, nogil=True, cache=True, error_model="numpy")
    def gem_update(
        theta: Any,
        proxy: Any,
        last_seen: Any,
        update: Any,
        scale: Any,
        momentum: Any,
        kappa: Any,
        pi_max: Any,
        epsilon: Any,
    ) -> None:
        zero = numba.float32(0.0)
        for j in range(theta.size):
            delta = scale * update[j]
            m = momentum * proxy[j] + delta
            proxy[j] = m
            current = theta[j]
            movement = abs(current - last_seen[j])
            pi = min(max((kappa * abs(m) - movement) / (abs(delta) + epsilon), zero), pi_max)
            last_seen[j] = current
            theta[j] = current + pi * delta

    return gem_update
