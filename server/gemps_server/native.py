"""The server's compiled loops (csrc/, the module _native), numpy in their place where not built.

The extension is optional: `pip install` builds it where a C compiler is at hand and goes on
without it elsewhere. `compiled` is the module, or None.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from gemps_proto.compiled_codes import optional_extension
from gemps_proto.tensor_codec import all_finite as numpy_all_finite

compiled = optional_extension("gemps_server._native")


def all_finite(values: np.ndarray) -> bool:
    """True when no value is NaN or +-Inf: one compiled pass without a temporary (numpy's
    isfinite allocates a bool per value) for contiguous float32, numpy otherwise."""
    if compiled is not None and values.dtype == np.float32 and values.flags.c_contiguous:
        return bool(compiled.all_finite(values.reshape(-1)))
    return numpy_all_finite(values)


def max_abs(values: np.ndarray) -> float:
    """The largest |value| (0.0 when there are none), NaN when one is NaN or +-Inf: a finiteness
    check that also gives the bound the rules use to update in place (rules/gem.py)."""
    if values.size == 0:
        return 0.0
    if compiled is not None and values.dtype == np.float32 and values.flags.c_contiguous:
        return float(compiled.max_abs(values.reshape(-1)))
    if not numpy_all_finite(values):
        return math.nan
    return float(np.abs(values).max())


def copy_max_abs(source: np.ndarray, target: np.ndarray) -> float:
    """Copy float32 `source` into `target` (same size) and return max_abs(source): one pass where
    both are contiguous float32, a copy and max_abs otherwise."""
    if (
        compiled is not None
        and source.dtype == target.dtype == np.float32
        and source.flags.c_contiguous
        and target.flags.c_contiguous
    ):
        return float(compiled.copy_max_abs(source.reshape(-1), target.reshape(-1)))
    np.copyto(target, source)
    return max_abs(target)


def median_in_place(values: np.ndarray) -> float:
    """rules.base.median's value for contiguous float32 `values` without NaN, which it reorders:
    a compiled selection in O(n), GIL held (samples are short; the compiled kernel's statistics use it)."""
    assert compiled is not None and values.dtype == np.float32 and values.flags.c_contiguous
    return float(compiled.median_in_place(values.reshape(-1)))


#: how a commit moves the noise scale's window sum w (domain/noise.py): w = u, w += u, or w read only
WINDOW_START, WINDOW_ADD, WINDOW_LAST = 0, 1, 2
#: the noise scale samples runs of this many consecutive parameters (csrc/shared.h's NOISE_RUN)
NOISE_RUN = 16


def noise_window_size(size: int, stride: int) -> int:
    """The window sum's length for `size` parameters sampled every `stride`-th run: `size` for
    stride 1, else NOISE_RUN per sampled run (the last run may have fewer parameters)."""
    runs = -(-size // NOISE_RUN)
    return size if stride == 1 else -(-runs // stride) * NOISE_RUN


@functools.lru_cache(maxsize=4)
def noise_sample(size: int, stride: int) -> np.ndarray:
    """The sampled parameters' indices: every `stride`-th run of NOISE_RUN, in order."""
    runs = np.arange(0, size, stride * NOISE_RUN)
    indices = (runs[:, None] + np.arange(NOISE_RUN)[None, :]).reshape(-1)
    return indices[indices < size]


def noise_window(
    update: np.ndarray, window: np.ndarray, stride: int, mode: int, bound: float = -1.0
) -> tuple[float, float]:
    """(|u|^2, |w + u|^2, or |u|^2 when `mode` starts the window) with u the update's sampled
    values (noise_sample) and w the noise scale's window sum (float32, noise_window_size), which
    `mode` writes: WINDOW_START w = u, WINDOW_ADD w += u, WINDOW_LAST leaves it (a window's last
    commit needs only the norm). One compiled pass for contiguous float32, numpy otherwise (GEM's
    compiled pass folds the same sums into its own: gem_update's `window`). `bound` >= 0: the
    update lies in memory its sender can still write, and each value is read within it (a NaN as
    -bound), as the rule's pass read it (csrc/shared.h: held_block)."""
    flat = update.reshape(-1)
    if compiled is not None and update.dtype == np.float32 and update.flags.c_contiguous:
        payload, total = compiled.noise_window(flat, window, stride, mode, bound)
        return float(payload), float(total)
    sampled = flat if stride == 1 else flat[noise_sample(flat.size, stride)]
    if bound >= 0:
        sampled = np.clip(np.nan_to_num(sampled, nan=-bound), -bound, bound)
    slots = window[: sampled.size]
    payload = float(np.dot(sampled, sampled))
    if mode == WINDOW_START:
        np.copyto(slots, sampled)
        return payload, payload
    summed = np.add(slots, sampled, out=slots if mode == WINDOW_ADD else None)
    return payload, float(np.dot(summed, summed))


#: the compiled commit core (csrc/core.c, domain/core.py's common case), or None where not built
native_commit: Callable[[Any, Any, Any, Any], Any] | None = None if compiled is None else compiled.core_commit


def setup_core(*types_and_values: object) -> None:
    """Hand the compiled commit core the Python types and values it makes and passes (once, by
    domain/core.py: ApplyStats, Receipt, PayloadKind.GRADIENT)."""
    if compiled is not None:
        compiled.core_setup(*types_and_values)
