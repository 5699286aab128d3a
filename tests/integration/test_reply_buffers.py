"""A reply's θ that its caller keeps is never written by a later reply (gemps/reply_buffers.py: a
data-plane connection reads replies into buffers it keeps, once nothing else holds them), through a
real server over TCP and through shared memory, with θ whole and with difference replies."""

from __future__ import annotations

import numpy as np
import pytest
from gemps_bench import sdk_replies

import gemps
from gemps.reply_buffers import SMALLEST_KEPT
from tests.integration.conftest import StartServer

P = SMALLEST_KEPT // 4 + 1000  # float32s: each reply past the size whose buffers are kept
RATE = 0.5


@pytest.mark.parametrize("reply_compression", [None, "int8"], ids=["whole", "int8-differences"])
@pytest.mark.parametrize("shared_memory", [False, True], ids=["tcp", "shared"])
def test_a_kept_reply_is_never_written_by_the_next(
    start_server: StartServer, shared_memory: bool, reply_compression: str | None
) -> None:
    server = start_server(rule="downpour", learning_rate=RATE)
    with gemps.Client(
        server.target, plane="data", shared_memory=shared_memory, reply_compression=reply_compression
    ) as client:
        client.register({"w": np.zeros(P, np.float32)})
        kept: list[tuple[np.ndarray, np.ndarray]] = []
        for step in range(1, 7):
            flat = client.commit(np.full(P, -float(step), np.float32)).parameters.flat
            kept.append((flat, np.array(flat)))
            if step == 4:
                del kept[:2]  # the first two let go: their buffers may be taken again
            for held, bits in kept:
                np.testing.assert_array_equal(held, bits)
        values = [float(np.asarray(held)[0]) for held, _ in kept]
        assert values == sorted(set(values)) and len(values) == 4  # every reply its own θ, rising
        np.testing.assert_allclose(values[-1], RATE * sum(range(1, 7)), rtol=1e-2)


@pytest.mark.parametrize(("transport", "partitions"), [("tcp", 1), ("shared", 1), ("tcp", 2)])
def test_a_worker_past_the_heaps_reach_faults_in_no_page_a_commit(transport: str, partitions: int) -> None:
    """`python -m gemps_bench.sdk_replies`: a client process on its own allocator, θ of 40 MB (past
    glibc's largest mmap threshold, 32 MiB, so a new buffer is mapped afresh each time), holding
    each reply until the next. Before, it faulted in every reply's pages, and the finiteness
    check's mask of a byte a value, at every commit: 57 pages a commit through shared memory and
    568 over TCP (one run each, the pages huge where the kernel could make them so). With θ in 2
    partitions the client assembled it into a new array of θ's size each commit."""
    figures = sdk_replies.measure(10_000_000, commits=3, transport=transport, partitions=partitions)
    cpu, faults = figures["client_cpu_ms_per_commit"], figures["page_faults_per_commit"]
    assert isinstance(cpu, float) and cpu > 0, figures
    assert isinstance(faults, int | float) and faults <= 4, figures
