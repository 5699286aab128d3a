"""etcd's start-up check against a real listener that drops plain http: a replica given an http://
endpoint of a TLS etcd refuses to start, naming the TLS options, whether the listener closed the
connection or reset it (which of the two etcd's does depends on timing; a loaded CI machine saw the
reset, and the replica waited as for an etcd still starting)."""

from __future__ import annotations

import re
import socket
import struct
import threading

import pytest

from gemps_server.replication.etcd_client import EtcdAccessRefused, EtcdEndpoints


class HangingUp:
    """A listener that reads each request whole and then drops the connection, closing it (FIN) or
    resetting it (RST), as etcd's TLS listener does with plain http."""

    def __init__(self, reset: bool) -> None:
        self.reset = reset
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                connection, _ = self.listener.accept()
            except OSError:  # closed
                return
            with connection:
                read_request(connection)  # then, waiting for an answer, the client sees the drop
                if self.reset:  # a zero linger: the close sends a reset, not a FIN
                    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def read_request(connection: socket.socket) -> None:
    """Read one HTTP request whole: its head, then its Content-Length of body."""
    received = b""
    while b"\r\n\r\n" not in received and (chunk := connection.recv(65536)):
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    declared = re.search(rb"(?i)content-length: *(\d+)", head)
    length = int(declared.group(1)) if declared else 0
    while len(body) < length and (chunk := connection.recv(65536)):
        body += chunk


@pytest.mark.parametrize("reset", [False, True], ids=["closed", "reset"])
def test_plain_http_dropped_by_the_listener_is_refused_at_start(reset: bool) -> None:
    """A listener that takes the connection and drops the request is not an etcd starting up (that
    refuses the connection): the start-up check names the TLS options instead of waiting for it."""
    hanging_up = HangingUp(reset)
    etcd = EtcdEndpoints(hanging_up.endpoint, 2.0)
    try:
        with pytest.raises(EtcdAccessRefused, match=re.escape("give an https:// endpoint and etcd_ca")):
            etcd.check("/gemps/probe")
    finally:
        etcd.close()
        hanging_up.listener.close()
