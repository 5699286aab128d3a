"""The allocator settings gemps' processes apply (see gemps_server/allocator.py)."""

from __future__ import annotations

import platform

import pytest

from gemps_server.allocator import BUFFERS_KEPT, HEAP_BUFFERS_MAX, keep_large_allocations, thresholds_for, tune_for

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="a no-op without glibc")


@glibc
def test_glibc_thresholds_are_raised() -> None:
    assert keep_large_allocations() is True
    assert keep_large_allocations() is True  # idempotent: the server may call it again on restart
    assert tune_for(4 * 100_000) is True


def test_thresholds_keep_a_commits_buffers_and_no_more() -> None:
    mmap, trim = thresholds_for(4_000_000)  # 1M parameters
    assert mmap == BUFFERS_KEPT * 4_000_000 and trim == 2 * BUFFERS_KEPT * 4_000_000
    assert thresholds_for(100) == (128 << 10, 2 << 20)  # tiny models: glibc's own floor
    largest_kept = HEAP_BUFFERS_MAX // BUFFERS_KEPT  # 2M parameters
    assert thresholds_for(largest_kept) == (HEAP_BUFFERS_MAX, 2 * HEAP_BUFFERS_MAX)


def test_past_the_heap_budget_theta_sized_buffers_are_mmapped() -> None:
    for buffer_bytes in (HEAP_BUFFERS_MAX // BUFFERS_KEPT + 1, 40_000_000, 4 << 30):  # 10M and 1G parameters
        mmap, trim = thresholds_for(buffer_bytes)
        assert mmap <= buffer_bytes and trim <= HEAP_BUFFERS_MAX
