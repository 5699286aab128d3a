"""The replication stream's TLS socket, safe for a reader and a writer thread at once.

A primary's link to a backup has two threads on one socket (the forwarder's sender, and its reader
of acknowledgements), and OpenSSL's SSL_read and SSL_write must not run at once on one connection
(CPython does not serialize them; concurrent use corrupts the session: cpython#76714, and the
websocket libraries that met it). So once the TLS handshake is done (`serialize()`), the socket
is non-blocking underneath: each read or write holds a lock only while OpenSSL runs, and waits
for the kernel (poll) outside it, within the timeout set with settimeout() as a blocking socket
would. Used through the contexts' `sslsocket_class` (credentials.py).
"""

from __future__ import annotations

import select
import ssl
import threading
import time
from typing import Any

#: bytes one SSL_write is given at most: the lock is held that long, no longer
_CHUNK = 1 << 18


class SerialSSLSocket(ssl.SSLSocket):
    _serial: threading.Lock | None = None
    _wait: float | None = None

    def serialize(self) -> None:
        """From now on: one OpenSSL call at a time, waits outside the lock."""
        self._wait = super().gettimeout()
        super().settimeout(0.0)
        self._serial = threading.Lock()

    def settimeout(self, value: float | None) -> None:
        if self._serial is None:
            super().settimeout(value)
        else:
            self._wait = value

    def gettimeout(self) -> float | None:
        return super().gettimeout() if self._serial is None else self._wait

    def recv_into(self, buffer: Any, nbytes: int | None = None, flags: int = 0) -> int:
        if self._serial is None:
            return super().recv_into(buffer, nbytes, flags)
        deadline = None if self._wait is None else time.monotonic() + self._wait
        while True:
            with self._serial:
                try:
                    return super().recv_into(buffer, nbytes, flags)
                except ssl.SSLWantReadError:
                    events = select.POLLIN
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
            self._await(events, deadline)

    def sendall(self, data: Any, flags: int = 0) -> None:
        if self._serial is None:
            super().sendall(data, flags)
            return
        view = memoryview(data).cast("B")
        deadline = None if self._wait is None else time.monotonic() + self._wait
        while view.nbytes:
            with self._serial:
                try:
                    # A write that wanted the kernel is retried with the same bytes (OpenSSL's rule).
                    view = view[super().send(view[:_CHUNK], flags) :]
                    continue
                except ssl.SSLWantWriteError:
                    events = select.POLLOUT
                except ssl.SSLWantReadError:
                    events = select.POLLIN
            self._await(events, deadline)

    def shutdown(self, how: int) -> None:
        if self._serial is None:
            super().shutdown(how)
        else:
            with self._serial:
                super().shutdown(how)

    def _await(self, events: int, deadline: float | None) -> None:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise TimeoutError("timed out")
        descriptor = self.fileno()
        if descriptor < 0:
            raise ConnectionError("the replication stream's socket is closed")
        poller = select.poll()
        poller.register(descriptor, events)
        if not poller.poll(None if left is None else max(int(left * 1000), 1)):
            raise TimeoutError("timed out")
