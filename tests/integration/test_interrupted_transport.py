"""A transport the primary watch woke serves the session's next call (issue 77, found by the Jepsen
suite with a second job).

The watch wakes a call blocked on a replica by interrupting its transport (gemps.primary_watch),
which closed the transport's gRPC channel for good, and the session relied on moving to another
address to replace it. Since a move is made only to a replica that proves it is the job's
(DESIGN §3d, "One job, one θ"), a refused move (the list's next address another job's server, or
not answering) leaves the session on the woken transport: its commits went on over the data
plane's new connection, but every gRPC call (Leave, Status, a registration) raised
ValueError("Cannot invoke RPC on closed channel!"), out of Client.__exit__ too, and the Jepsen
trial's worker died at its end with its history unwritten. A woken transport now opens a new
channel for its next call.
"""

from __future__ import annotations

import numpy as np
import pytest

import gemps
from tests.integration.conftest import StartServer

PARAMETERS = 1000


@pytest.mark.parametrize("plane", ["grpc", "auto"])
def test_every_call_after_the_watch_woke_the_transport_is_served(start_server: StartServer, plane: str) -> None:
    server = start_server()
    ones = np.ones(PARAMETERS, np.float32)
    with gemps.Client(server.target, name="woken", plane=plane, timeout=10) as client:
        client.register({"w": np.zeros(PARAMETERS, np.float32)})
        client.commit(ones, kind="update")
        # What the watch does to the transport of a call it wakes; here no move follows (none refused
        # or made): the session goes on with the same transport, as after a refused move.
        client._router.sessions[0].link.interrupt()
        assert client.commit(ones, kind="update").version == 2
        assert client.status().version == 2  # gRPC (Status): ValueError before
        client.leave()  # gRPC (Leave): ValueError before
    with gemps.Client(server.target, timeout=10) as observer:
        assert observer.status().active_workers == 0
