"""A request the server fails on (an exception no refusal names: a bug, injected here into a real
in-process server's applier) is INTERNAL to its client at once, on every route, with reason
`internal`, the failure named and the server's log holding the traceback: the client does not
take a dropped call or connection for a server that is away and retry it until its patience
ends. The server keeps serving: the next commit applies."""

from __future__ import annotations

import time
from typing import Any

import grpc
import numpy as np
import pytest

import gemps
from gemps_proto.reasons import Reason
from gemps_server.domain.core import CommitCore
from tests.helpers import InProcessServer

pytestmark = pytest.mark.usefixtures("plane")  # shared memory, the data plane over TCP, gRPC

PATIENCE = 10.0  # what a dropped call or connection would have been retried for


def test_a_commit_the_server_fails_on_is_internal_at_once(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    applied = CommitCore.commit_and_reply
    failures = iter([RuntimeError("injected fault")])

    def failing_once(self: CommitCore, *args: Any, **kwargs: Any) -> Any:
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return applied(self, *args, **kwargs)

    with gemps.Client(server.target, patience=PATIENCE) as client:
        client.register({"w": np.zeros(4, np.float32)})
        monkeypatch.setattr(CommitCore, "commit_and_reply", failing_once)
        started = time.monotonic()
        with pytest.raises(gemps.GempsError) as raised:
            client.commit(np.ones(4, np.float32))
        waited = time.monotonic() - started
        assert raised.value.code == grpc.StatusCode.INTERNAL and raised.value.reason == Reason.INTERNAL
        assert "RuntimeError: injected fault" in str(raised.value) and "log has the traceback" in str(raised.value)
        assert waited < PATIENCE / 2 and client.retries == 0  # heard at once, not retried
        log = server.log()
        assert "internal error" in log and "injected fault" in log and "Traceback" in log
        result = client.commit(np.ones(4, np.float32))  # the server keeps serving
        assert result.version == 1
