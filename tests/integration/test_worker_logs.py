"""What the reference worker's log says (issue 43, item 7): a progress line every --log-every
seconds between `registered` and `done`, the data it reads in words ("all data" without sharding,
not "shard 3/0"), and none of gRPC's own INFO lines ("Got goaway ...") unless the user asks."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import h2.config
import h2.connection
import h2.errors
import pytest

from gemps_proto.schema import Shard
from gemps_worker.progress import WorkerProgress
from gemps_worker.training import WorkerOptions, run_worker
from tests.integration.conftest import StartServer


@pytest.fixture
def goaway_server() -> Iterator[str]:
    """An HTTP/2 peer that answers every connection with a GOAWAY carrying an error code: what a
    server sends when it closes connections in trouble, and what gRPC's C core logs at INFO."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:  # closed: the test is over
                return
            with connection:
                peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
                peer.initiate_connection()
                connection.sendall(peer.data_to_send())
                with contextlib.suppress(Exception):  # whatever the client sent: it gets its GOAWAY
                    peer.receive_data(connection.recv(65535))
                peer.close_connection(error_code=h2.errors.ErrorCodes.INTERNAL_ERROR, additional_data=b"bye")
                connection.sendall(peer.data_to_send())

    threading.Thread(target=serve, daemon=True).start()
    yield f"127.0.0.1:{listener.getsockname()[1]}"
    listener.close()


def sdk_call_output(target: str, **variables: str) -> str:
    """What a program that imports gemps and calls `target` once prints (stdout and stderr)."""
    call = f"gemps.Client({target!r}, patience=1, timeout=3).status()"
    program = f"import gemps\ntry:\n    {call}\nexcept gemps.GempsError:\n    pass\n"
    environ = {k: v for k, v in os.environ.items() if k not in ("GRPC_VERBOSITY", "GRPC_TRACE")}
    result = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, env={**environ, **variables}
    )
    return result.stdout + result.stderr


def test_grpc_info_lines_stay_out_unless_the_user_asks(goaway_server: str) -> None:
    assert "Got goaway" not in sdk_call_output(goaway_server)
    assert "Got goaway" in sdk_call_output(goaway_server, GRPC_VERBOSITY="INFO")  # the user's choice stands


def test_the_worker_logs_its_progress_and_its_data_in_words(
    start_server: StartServer, caplog: pytest.LogCaptureFixture
) -> None:
    server = start_server(rule="gem", learning_rate=0.05)
    caplog.set_level(logging.INFO, logger="gemps.worker")
    options = WorkerOptions(server=server.target, model="mlp", epochs=3, max_steps=40, log_every=0.01)
    assert run_worker(options).steps == 40
    lines = [record.getMessage() for record in caplog.records if record.name == "gemps.worker"]
    registered = next(line for line in lines if line.startswith("registered"))
    assert "all data (no sharding), in an order seeded by 0" in registered and "/0" not in registered
    progress = [line for line in lines if line.startswith("progress: ")]
    assert len(progress) >= 2, lines
    for field in ("commits", "version", "loss", "samples/s", "staleness mean"):
        assert field in progress[-1]


def test_a_progress_line_sums_up_what_happened_since_the_last() -> None:
    now = [0.0]
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("test.progress")
    log.addHandler(Collect())
    log.setLevel(logging.INFO)
    progress = WorkerProgress(10.0, log, clock=lambda: now[0])
    for step, (loss, staleness) in enumerate([(2.0, 1), (1.0, 3)], start=1):
        progress.trained(32)
        progress.trained(32)  # a local step: trained on, not committed
        now[0] += 5.0
        progress.committed(step, 10 + step, loss, staleness)
    assert lines == [
        "progress: 2 commits (2 in 10 s), version 12, loss 1.5000, 12.8 samples/s, staleness mean 2.0 max 3"
    ]
    assert Shard(1, 4).describe() == "shard 1 of 4"
