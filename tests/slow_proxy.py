"""A TCP proxy whose answers arrive late: each chunk the upstream sends back, and its hang-up, is
held `delay` seconds before it is passed on (a loaded or distant service, without tc or namespaces);
with `request_delay`, what the client sends is held too (a distant client)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator


def _pipe(source: socket.socket, sink: socket.socket, delay: float) -> None:
    with contextlib.suppress(OSError):
        while chunk := source.recv(65536):
            time.sleep(delay)
            sink.sendall(chunk)
    time.sleep(delay)  # the hang-up is late too
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def slow_proxy(
    upstream: tuple[str, int], delay: float, request_delay: float = 0.0, listen: tuple[str, int] = ("127.0.0.1", 0)
) -> Iterator[int]:
    """Listen at `listen` (the port is yielded) and relay each connection to `upstream`, its
    answers each `delay` seconds late and its requests `request_delay` seconds; closed on exit."""
    listener = socket.create_server(listen)
    listener.settimeout(0.2)
    stop = threading.Event()
    opened: list[socket.socket] = []

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            server = socket.create_connection(upstream)
            opened.extend((client, server))
            threading.Thread(target=_pipe, args=(client, server, request_delay), daemon=True).start()
            threading.Thread(target=_pipe, args=(server, client, delay), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1])
    finally:
        stop.set()
        listener.close()
        thread.join(5)
        for sock in opened:
            sock.close()
