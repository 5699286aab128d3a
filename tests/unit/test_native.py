"""The server's compiled loops (csrc/, the module _native) are built, and agree with numpy."""

from __future__ import annotations

import numpy as np
import pytest

from gemps_proto.tensor_codec import all_finite as numpy_all_finite
from gemps_server import native
from gemps_server.domain.rules.base import median


def test_the_extension_was_built() -> None:
    # Optional at install (no compiler: numpy serves); here, where CI runs, it must be there.
    assert native.compiled is not None, "gemps_server._native was not built: is a C compiler installed?"


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 1023, 1024, 70_001])
def test_all_finite_finds_any_nan_or_inf(bad: float, where: int) -> None:
    values = np.full(70_002, 3e38, np.float32)  # large but finite: no sum may overflow
    values[1::2] = -3e38
    values[7] = np.float32(1e-45)  # denormal
    assert native.all_finite(values) and numpy_all_finite(values)
    values[where] = bad
    assert not native.all_finite(values) and not numpy_all_finite(values)


def test_other_layouts_fall_back_to_numpy() -> None:
    strided = np.ones(20, np.float32)[::2]
    assert native.all_finite(strided)
    strided[3] = np.nan
    assert not native.all_finite(strided)
    assert native.all_finite(np.empty(0, np.float32))


@pytest.mark.parametrize("size", [1, 2, 1023, 8192, 8193])
@pytest.mark.parametrize("clamped", [0.0, 0.5, 0.51, 0.9])  # the share at 0 and at 5, as pi is with many workers
def test_median_in_place_is_the_rules_median(size: int, clamped: float) -> None:
    rng = np.random.default_rng(size)
    values = rng.choice(np.array([0.0, 5.0, 0.25, 1.0, 3.5], np.float32), size)  # ties, as pi has
    values[: size // 3] = rng.random(size // 3, dtype=np.float32)
    values[: int(size * clamped)] = 0.0
    values[size - int(size * clamped / 2) :] = 5.0
    assert native.median_in_place(values.copy()) == median(values)  # exactly: the same two values


BRACKET_ORDERS = ["shuffled", "sorted", "reversed", "periodic", "zeros-below-half", "zeros-at-half", "zeros-past-half"]


@pytest.mark.parametrize("size", [1023, 1024, 7692, 7693, 8192, 8193])
@pytest.mark.parametrize("order", BRACKET_ORDERS)
def test_the_median_through_its_bracket_or_without_it_is_exact(size: int, order: str) -> None:
    """Past 1,024 values the median is selected among those inside a bracket that a spread sample of
    them gives (csrc/checks.c, bracketed_kth). Ordered values, values repeating at the sample's
    stride (so the sample represents them badly: the bracket misses and the whole selection runs),
    and π clamped at 0 for about half the values (as 8 GEM workers' π at 100K was: the median at
    the cluster's edge, each middle value in it or beside it) give the same value as the rule's median."""
    rng = np.random.default_rng(size)
    values = np.clip(rng.normal(0.8, 0.5, size), 0.0, 1.0).astype(np.float32)  # a third clamped at 1
    if order.startswith("zeros"):
        values = rng.random(size, dtype=np.float32) * 3
        zeros = size // 2 + {"zeros-below-half": -2, "zeros-at-half": 0, "zeros-past-half": 1}[order]
        values[rng.permutation(size)[:zeros]] = 0.0
    elif order == "sorted":
        values.sort()
    elif order == "reversed":
        values = np.sort(values)[::-1].copy()
    elif order == "periodic":
        values = np.resize(rng.random(size // 256 or 1, dtype=np.float32), size)
    assert native.median_in_place(values.copy()) == median(values)


def test_copy_max_abs_copies_and_finds_the_peak_or_a_value_that_is_not_finite() -> None:
    source = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
    target = np.empty_like(source)
    assert native.copy_max_abs(source, target) == float(np.abs(source).max())
    np.testing.assert_array_equal(target, source)
    source[77_777] = np.inf
    assert np.isnan(native.copy_max_abs(source, target)) or np.isinf(native.copy_max_abs(source, target))
    strided = np.empty(2 * source.size, np.float32)[::2]  # not contiguous: numpy's copy, same answer
    source[77_777] = -9.0
    assert native.copy_max_abs(source, strided) == 9.0 and np.array_equal(strided, source)


def gem_pass(update: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One in-place compiled GEM pass of `update` on fixed state; the new θ, m_i and s_i."""
    assert native.compiled is not None
    rng = np.random.default_rng(1)
    theta, proxy, last_seen = (rng.standard_normal(update.size).astype(np.float32) for _ in range(3))
    samples = np.empty(update.size, np.float32)
    native.compiled.gem_update(
        theta, proxy, last_seen, update, None, None, -0.05, 0.9, 1.0, 5.0, 1e-16, 1, samples, None, None, 1, 0, bound
    )
    return theta, proxy, last_seen


def test_a_held_payload_is_read_within_its_bound() -> None:
    """A payload in memory its sender may still write (bound >= 0) is read once per value and held
    to [-bound, bound]: values within it pass bit for bit as they are, a NaN or a larger value
    written after the check cannot reach θ, m_i or s_i."""
    update = np.random.default_rng(0).standard_normal(5_000).astype(np.float32)
    peak = float(np.abs(update).max())
    for kept, held in zip(gem_pass(update, -1.0), gem_pass(update, peak), strict=True):
        np.testing.assert_array_equal(held, kept)  # an honest payload: the same bits
    poisoned = update.copy()
    poisoned[[3, 1500, 4999]] = [np.nan, np.inf, -3e38]
    clamped = np.clip(np.nan_to_num(poisoned, nan=-peak), -peak, peak).astype(np.float32)
    for got, want in zip(gem_pass(poisoned, peak), gem_pass(clamped, -1.0), strict=True):
        assert np.isfinite(got).all()
        np.testing.assert_array_equal(got, want)
