"""The transport ceiling: a bare gRPC echo server returning each payload as it came.

Raw bytes in and out (no protobuf, no math), in the two layouts gemps uses: one unary message
per commit, and the payload streamed in chunks both ways. No gRPC-based parameter server that
must receive P floats and send P floats back per commit can beat it with the same layout.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from gemps_bench.loopback import LoopbackServer
from gemps_server.allocator import keep_large_allocations

SERVICE = "gemps.bench.Echo"
MAX_MESSAGE = 2**31 - 1
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]


def _identity(data: bytes) -> bytes:
    return data


async def _unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def _stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    # Like a parameter server, reply once the whole payload is in (not chunk by chunk).
    chunks = [chunk async for chunk in requests]
    for chunk in chunks:
        yield chunk


async def _serve(port_file: Path) -> None:
    server = grpc.aio.server(options=CHANNEL_OPTIONS)
    handlers = {
        "Unary": grpc.unary_unary_rpc_method_handler(_unary, _identity, _identity),
        "Stream": grpc.stream_stream_rpc_method_handler(_stream, _identity, _identity),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    temporary = port_file.with_suffix(".tmp")  # renamed: a reader never sees a partial file
    temporary.write_text(f"{port}\n")
    temporary.replace(port_file)
    await server.wait_for_termination()


class EchoServer(LoopbackServer):
    """The echo server in a child process on a free port (`with EchoServer() as echo: echo.target`)."""

    def __init__(self) -> None:
        super().__init__("echo")

    def command(self, port_file: Path) -> list[str]:
        return [sys.executable, "-m", "gemps_bench.echo", "--port-file", str(port_file)]


def chunked(data: bytes, chunk_bytes: int) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(data), chunk_bytes):
        yield bytes(view[start : start + chunk_bytes])


class EchoClient:
    """Sends the gradient's bytes and decodes the echoed bytes as float32, like a gemps client."""

    def __init__(self, target: str, streamed: bool, chunk_bytes: int) -> None:
        self._channel = grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self._streamed = streamed
        self._chunk_bytes = chunk_bytes
        self._unary = self._channel.unary_unary(f"/{SERVICE}/Unary", _identity, _identity)
        self._stream = self._channel.stream_stream(f"/{SERVICE}/Stream", _identity, _identity)
        self.received = np.empty(0, dtype=np.float32)

    def commit(self, gradient: np.ndarray) -> int | None:
        data = gradient.tobytes()
        if self._streamed:
            reply = b"".join(self._stream(chunked(data, self._chunk_bytes), timeout=600))
        else:
            reply = self._unary(data, timeout=600)
        self.received = np.frombuffer(reply, dtype=np.float32)
        return None

    def close(self) -> None:
        self._channel.close()


@dataclass(frozen=True)
class EchoClientFactory:
    target: str
    streamed: bool
    chunk_bytes: int

    def __call__(self, index: int) -> EchoClient:
        return EchoClient(self.target, self.streamed, self.chunk_bytes)


def main() -> None:
    parser = argparse.ArgumentParser(description="bare gRPC echo server (the benchmarks' transport ceiling)")
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args()
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    keep_large_allocations()  # the same allocator settings as gemps' server
    asyncio.run(_serve(args.port_file))


if __name__ == "__main__":
    main()
