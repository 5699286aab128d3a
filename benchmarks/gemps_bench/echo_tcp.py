"""The socket ceiling: a raw TCP echo server returning each payload as it came (`echo-tcp`).

A length-prefixed frame each way on a plain socket, one thread per connection, payloads received
with `recv_into` into a buffer kept per connection and sent from it: what any transport of θ's
bytes over loopback TCP in Python can reach, with no protocol, no math and no copy of its own.
gemps' data plane is measured against it, as its gRPC path is against `echo-unary`.
"""

from __future__ import annotations

import argparse
import socket
import struct
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gemps_bench.loopback import LoopbackServer
from gemps_server.allocator import keep_large_allocations

LENGTH = struct.Struct("<Q")


def receive_exactly(sock: socket.socket, into: memoryview) -> bool:
    """Fill `into` from `sock`; False when the peer closed first."""
    received = 0
    while received < len(into):
        count = sock.recv_into(into[received:])
        if count == 0:
            return False
        received += count
    return True


def _echo_connection(sock: socket.socket) -> None:
    header = bytearray(LENGTH.size)
    buffer = bytearray(0)
    with sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while receive_exactly(sock, memoryview(header)):
            (length,) = LENGTH.unpack(header)
            if len(buffer) < length:
                buffer = bytearray(length)
            payload = memoryview(buffer)[:length]
            if not receive_exactly(sock, payload):
                return
            sock.sendall(header)
            sock.sendall(payload)


def serve(port_file: Path, address: str = "127.0.0.1") -> None:
    listener = socket.create_server((address, 0))
    temporary = port_file.with_suffix(".tmp")  # renamed: a reader never sees a partial file
    temporary.write_text(f"{listener.getsockname()[1]}\n")
    temporary.replace(port_file)
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=_echo_connection, args=(connection,), daemon=True).start()


class TcpEchoServer(LoopbackServer):
    """The TCP echo server in a child process (`with TcpEchoServer() as echo: echo.target`);
    elsewhere than on loopback: listening on `address`, started by `launcher` (a simulated host's
    `Host.command([])`, benchmarks/gemps_bench/cross_host.py)."""

    def __init__(self, address: str = "127.0.0.1", launcher: Sequence[str] = ()) -> None:
        super().__init__("echo-tcp", address)
        self.launcher = tuple(launcher)

    def command(self, port_file: Path) -> list[str]:
        module = [sys.executable, "-m", "gemps_bench.echo_tcp", "--port-file", str(port_file)]
        return [*self.launcher, *module, "--address", self.address]


class TcpEchoClient:
    """Sends the gradient's bytes as they are (no copy) and reads the echo into a float32 array."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._sock = socket.create_connection((host, int(port)))
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._header = bytearray(LENGTH.size)
        self.received = np.empty(0, dtype=np.float32)

    def commit(self, gradient: np.ndarray) -> int | None:
        payload = gradient.data.cast("B")
        self._sock.sendall(LENGTH.pack(len(payload)))
        self._sock.sendall(payload)
        if not receive_exactly(self._sock, memoryview(self._header)):
            raise ConnectionError("echo-tcp closed the connection")
        (length,) = LENGTH.unpack(self._header)
        received = np.empty(length // 4, dtype=np.float32)  # a new array a reply, as a client keeps θ
        if not receive_exactly(self._sock, received.data.cast("B")):
            raise ConnectionError("echo-tcp closed the connection")
        self.received = received
        return None

    def close(self) -> None:
        self._sock.close()


@dataclass(frozen=True)
class TcpEchoClientFactory:
    target: str

    def __call__(self, index: int) -> TcpEchoClient:
        return TcpEchoClient(self.target)


def main() -> None:
    parser = argparse.ArgumentParser(description="raw TCP echo server (the benchmarks' socket ceiling)")
    parser.add_argument("--port-file", type=Path, required=True)
    parser.add_argument("--address", default="127.0.0.1", help="the address to listen on")
    args = parser.parse_args()
    keep_large_allocations()  # the same allocator settings as gemps' server
    serve(args.port_file, args.address)


if __name__ == "__main__":
    main()
