"""One gemps.Client shared by several threads (committing, and one pulling beside them), on every
route its commits can take (shared memory, the data plane over TCP, gRPC): its calls are
serialised, so every answer is true, and the server applied exactly the commits that were
reported applied (issue 49, item 2)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gemps
from tests.integration.conftest import StartServer

pytestmark = pytest.mark.usefixtures("plane")

THREADS = 3
COMMITS = 300  # per thread
PULLS = 100  # by one more thread, beside the commits
SIZE = 64
ONES = np.ones(SIZE, np.float32)
JOIN_SECONDS = 300.0  # a generous bound on a hang, not a measurement


def test_threads_sharing_one_client_get_true_answers(start_server: StartServer, plane: str) -> None:
    """Downpour at η 1 adds each "ones" update to θ: after n applied commits θ is n everywhere and
    the version is n. Each reply must carry the version its own commit made, with θ at that value."""
    server = start_server(rule="downpour", learning_rate=1.0)
    versions: list[int] = []  # of every reply, from every thread
    wrong: list[str] = []  # replies (commits' and pulls') whose θ is not their version's
    raised: list[BaseException] = []
    start = threading.Barrier(THREADS + 1)
    with gemps.Client(server.target, timeout=30.0) as client:
        client.register({"w": np.zeros(SIZE, np.float32)})
        assert client.planes == ["grpc" if plane == "grpc" else "data"]

        def commit_all() -> None:
            start.wait()
            for _ in range(COMMITS):
                try:
                    result = client.commit(ONES, kind="update")
                except BaseException as error:  # counted: a refusal must be true too (see below)
                    raised.append(error)
                    continue
                versions.append(result.version)
                if not np.all(result.parameters.flat == result.version):
                    wrong.append(f"version {result.version}: θ {np.unique(result.parameters.flat)}")

        def pull_all() -> None:
            start.wait()
            for _ in range(PULLS):
                try:
                    pulled = client.pull()
                except BaseException as error:
                    raised.append(error)
                    continue
                if not np.all(pulled.flat == pulled.version):
                    wrong.append(f"pulled version {pulled.version}: θ {np.unique(pulled.flat)}")

        threads = [threading.Thread(target=commit_all, name=f"committer-{i}") for i in range(THREADS)]
        threads.append(threading.Thread(target=pull_all, name="puller"))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_SECONDS)
        assert not any(thread.is_alive() for thread in threads), "a thread never came back from its commits"
    with gemps.Client(server.target, plane="grpc") as observer:  # read-only: the server's θ as it is
        central = observer.pull()
    applied = central.version
    told = f"{len(versions)} calls returned, {len(raised)} raised ({raised[:1]!r}), the server applied {applied}"
    assert applied == len(versions), told  # every answer true
    assert raised == [], told  # and, serialised, every call applied
    assert wrong == []
    assert sorted(versions) == list(range(1, THREADS * COMMITS + 1))  # each reply its own commit's
    np.testing.assert_array_equal(central.flat, np.full(SIZE, applied, np.float32))
