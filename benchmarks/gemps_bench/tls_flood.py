"""A flood of TLS handshakes at a data port (issue 42, item 4): what scripts/tls_flood.py (at commit
745f064) measured an honest worker beside, and what tests/integration/test_data_plane_tls_flood.py floods with.

Five kinds of flooder, each a thread of its own that connects (from `source`) as fast as it can:
- "hello": sends a ClientHello (one made once, replayed: costs the flooder nothing, the server a
  key exchange and a signature each time) and closes once the server answered;
- "hold": sends the same ClientHello and never says more, keeping up to HOLD connections open
  (each opened again when the server closes it);
- "full": completes a real handshake, then closes;
- "dh": as "hello", but the ClientHello offers only the ffdhe8192 group (RFC 7919), which
  OpenSSL servers accept by default: about 80 ms of the server's CPU each, nothing of the flooder's;
- "connect": connects and resets, no byte sent: what any port, TLS or not, takes (the floor).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import selectors
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KINDS = ("hello", "hold", "full", "dh", "connect")
HOLD = 16  # connections a "hold" flooder keeps open at once
FFDHE8192 = 0x0104  # the named group's code point (RFC 7919)
SUPPORTED_GROUPS, KEY_SHARE = 0x000A, 0x0033  # the ClientHello extensions rewritten for "dh"


def client_hello() -> bytes:
    """A TLS ClientHello's bytes, as a real client (this Python's OpenSSL) would send it."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def dh_client_hello() -> bytes:
    """`client_hello()` offering only ffdhe8192, its key share the public value 4 (valid: a
    quadratic residue; the server checks it with a modular exponentiation of its own)."""
    hello = client_hello()
    body = hello[9:]  # past the record's header (5 bytes) and the handshake's (4)
    at = 2 + 32  # version, random
    at += 1 + body[at]  # session id
    at += 2 + int.from_bytes(body[at : at + 2], "big")  # cipher suites
    at += 1 + body[at]  # compression methods
    extensions, rest = bytearray(), body[at + 2 :]
    while rest:
        kind, size = int.from_bytes(rest[:2], "big"), int.from_bytes(rest[2:4], "big")
        data, rest = rest[4 : 4 + size], rest[4 + size :]
        if kind == SUPPORTED_GROUPS:
            data = (2).to_bytes(2, "big") + FFDHE8192.to_bytes(2, "big")
        elif kind == KEY_SHARE:
            share = FFDHE8192.to_bytes(2, "big") + (1024).to_bytes(2, "big") + (4).to_bytes(1024, "big")
            data = len(share).to_bytes(2, "big") + share
        extensions += kind.to_bytes(2, "big") + len(data).to_bytes(2, "big") + data
    body = body[:at] + len(extensions).to_bytes(2, "big") + extensions
    handshake = hello[5:6] + len(body).to_bytes(3, "big") + body
    return hello[:3] + len(handshake).to_bytes(2, "big") + handshake


@dataclass
class Flood:
    """`threads` flooders of `kind` at 127.0.0.1:`port` until stop(); `attempts` counts connections tried."""

    port: int
    kind: str
    threads: int = 2
    source: str = "127.0.0.1"  # the address it connects from (any of 127.0.0.0/8 on loopback)
    attempts: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Flood:
        if self.kind not in KINDS:
            raise ValueError(f"a flood is one of {', '.join(KINDS)}, not {self.kind!r}")
        run: Callable[[], None] = {
            "hello": self._hellos,
            "hold": self._holds,
            "full": self._full,
            "dh": self._hellos,
            "connect": self._connects,
        }[self.kind]
        for number in range(self.threads):
            thread = threading.Thread(target=run, name=f"tls-flood-{self.kind}-{number}", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def __enter__(self) -> Flood:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()

    def _connect(self) -> socket.socket | None:
        self.attempts += 1  # a race between flooders loses a count at worst
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=2, source_address=(self.source, 0))
        except OSError:
            time.sleep(0.001)  # the backlog is full: let the server breathe a moment
            return None
        # Closed with a reset: no TIME_WAIT left behind to slow the next connect's choice of port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        return sock

    def _hellos(self) -> None:
        hello = dh_client_hello() if self.kind == "dh" else client_hello()
        while not self._stop.is_set():
            sock = self._connect()
            if sock is None:
                continue
            with sock, contextlib.suppress(OSError):
                sock.sendall(hello)
                sock.recv(1)  # the server did the work (or refused): then go

    def _connects(self) -> None:
        while not self._stop.is_set():
            sock = self._connect()
            if sock is not None:
                sock.close()

    def _holds(self) -> None:
        hello = client_hello()
        selector = selectors.DefaultSelector()
        while not self._stop.is_set():
            while len(selector.get_map()) < HOLD and not self._stop.is_set():
                sock = self._connect()
                if sock is None:
                    break
                try:
                    sock.sendall(hello)
                except OSError:
                    sock.close()
                    continue
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ)
            for key, _events in selector.select(0.01):
                held = key.fileobj
                assert isinstance(held, socket.socket)
                try:
                    gone = not held.recv(1 << 16)  # the server's reply read and dropped; b"": closed
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    selector.unregister(held)
                    held.close()
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    def _full(self) -> None:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        while not self._stop.is_set():
            sock = self._connect()
            if sock is None:
                continue
            try:
                context.wrap_socket(sock).close()
            except OSError:  # refused, or closed before the handshake
                sock.close()


class FloodProcess:
    """`Flood(port, kind, threads, source)` in a process of its own (its threads would take the
    GIL from the client measured beside it), until the block ends; `attempts` then."""

    def __init__(
        self,
        port: int,
        kind: str,
        threads: int = 2,
        source: str = "127.0.0.1",
        cpus: set[int] | None = None,
        nice: int = 0,
    ) -> None:
        """`cpus`: the CPUs it runs on (None: those of this process); `nice`: added to its niceness
        (19: it runs on what the server and its clients leave, as an attacker's own machine would)."""
        context = multiprocessing.get_context("spawn")
        self._stop, self._attempts = context.Event(), context.Value("q", 0)
        self._process = context.Process(
            target=_flood_until,
            args=(port, kind, threads, source, cpus, nice, self._stop, self._attempts),
            daemon=True,
        )
        self.attempts = 0

    def __enter__(self) -> FloodProcess:
        self._process.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._process.join(30)
        self.attempts = int(self._attempts.value)


def _flood_until(
    port: int, kind: str, threads: int, source: str, cpus: set[int] | None, nice: int, stop: Any, attempts: Any
) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    os.nice(nice)  # before the flooders start: Linux keeps a niceness per thread, and new ones inherit it
    running = Flood(port, kind, threads, source).start()
    stop.wait()
    running.stop()
    attempts.value = running.attempts
