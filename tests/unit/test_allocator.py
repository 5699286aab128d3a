"""The allocator setting gemps' processes apply at start (see gemps_server/allocator.py)."""

from __future__ import annotations

import platform

import pytest

from gemps_server.allocator import GLIBC_MMAP_THRESHOLD_MAX, keep_large_allocations, keep_large_allocations_for


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a no-op without glibc")
def test_glibc_thresholds_are_raised() -> None:
    assert keep_large_allocations() is True
    assert keep_large_allocations() is True  # idempotent: the server may call it again on restart


def test_small_models_keep_glibc_defaults() -> None:
    assert keep_large_allocations_for(GLIBC_MMAP_THRESHOLD_MAX - 1) is False
