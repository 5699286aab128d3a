"""The server's compiled loops (csrc/, the module _native; the codec's passes, gemps_proto._codes),
numpy and the shared codec in their place where not built.

The extensions are optional: `pip install` builds them where a C compiler is at hand and goes on
without them elsewhere. `compiled` is the server's module, or None.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from gemps_proto import compiled_codes
from gemps_proto.block_quantisation import int8_nbytes
from gemps_proto.tensor_codec import INT8_BLOCK, EncodedTensor
from gemps_proto.tensor_codec import all_finite as numpy_all_finite
from gemps_proto.vectors import Vector

compiled = compiled_codes.optional_extension("gemps_server._native")


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


def decoded_payload(payload: EncodedTensor, out: np.ndarray | None = None) -> tuple[Vector, float | None]:
    """A commit payload's values, as `payload.decode_payload(out)` (TensorDecodeError where they do
    not decode), and their max |value| where it was measured on the way (else None, for the rules'
    overflow bounds): int8 codes of a flat payload are checked, decoded into `out` and measured in
    one compiled pass, each byte read once (a payload its sender can still write cannot pass a check
    with one byte and be used with another), where the codec's decode would leave the peak to one
    more pass. A payload the compiled pass refuses is decoded by the codec again, which words the
    refusal, so the errors are the codec's, word for word."""
    codes = compiled_codes.compiled
    if (
        codes is not None
        and out is not None
        and payload.dtype == INT8_BLOCK
        and payload.shape == (out.size,)
        and out.dtype == np.float32
        and out.flags.c_contiguous
        and memoryview(payload.data).nbytes == int8_nbytes(out.size)
    ):
        peak: float = codes.decode_int8(payload.data, out)
        if peak >= 0.0:  # else refused (-1.0 a scale, -2.0 a code): the codec words why
            return out, peak
    return payload.decode_payload(out), None


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
