"""Which transport should carry θ's bytes? Echo ceilings of the candidates, measured alike.

Issue 27 asks to choose the data plane's transport by measurement: keep a well-kept library if
it is within 10% of a raw socket, else a plain socket written small. Each candidate here is an
echo server in its own process (the payload returned as it came, no math), driven by the bench's
own load generator (closed-loop clients over 2 processes, a fresh float32 array per reply):

- `grpc-unary`: a bare grpc.aio unary echo, identity serializers (`echo-unary` in the bench);
- `tcp-threads`: a plain socket, a thread per connection, `recv_into` (`echo-tcp` in the bench);
- `tcp-asyncio`: a plain socket served by asyncio, payloads received in place
  (`BufferedProtocol.get_buffer`), replies written from the received buffer;
- `zmq`: pyzmq, a ROUTER socket, zero-copy frames both ways (`copy=False`);
- `flight`: Arrow Flight `DoExchange` (gRPC underneath, C++ zero-copy paths), the payload as one
  record batch of a float32 column.

    pip install pyzmq pyarrow   # the library candidates; not dependencies of gemps
    python scripts/transport_candidates.py --sizes 100K,1M,10M --clients 8 --rounds 2 \
        --out docs/results/transport_candidates.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gemps_bench.counts import parse_counts
from gemps_bench.echo import EchoClientFactory, EchoServer
from gemps_bench.echo_tcp import LENGTH, TcpEchoClientFactory, TcpEchoServer
from gemps_bench.loadgen import ClientFactory, LoadPlan, run_load
from gemps_bench.loopback import LoopbackServer

CANDIDATES = ("grpc-unary", "tcp-threads", "tcp-asyncio", "zmq", "flight")


# -- tcp-asyncio: the same frames as echo-tcp, served by one event loop ---------------------------


class _EchoProtocol(asyncio.BufferedProtocol):
    """Reads a length, then the payload into one buffer in place; echoes it from that buffer."""

    def __init__(self) -> None:
        self._header = bytearray(LENGTH.size)
        self._buffer = bytearray(0)
        self._target = memoryview(self._header)
        self._filled = 0
        self._in_payload = False
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._target[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._target):
            return
        assert self._transport is not None
        if not self._in_payload:
            (length,) = LENGTH.unpack(self._header)
            if len(self._buffer) < length:
                self._buffer = bytearray(length)
            self._target, self._filled, self._in_payload = memoryview(self._buffer)[:length], 0, True
            if length:
                return
        self._transport.write(self._header)
        self._transport.write(self._target)
        self._target, self._filled, self._in_payload = memoryview(self._header), 0, False


async def _serve_asyncio(port_file: Path) -> None:
    server = await asyncio.get_running_loop().create_server(_EchoProtocol, "127.0.0.1", 0)
    _write_port(port_file, server.sockets[0].getsockname()[1])
    await server.serve_forever()


# -- zmq ------------------------------------------------------------------------------------------


def _serve_zmq(port_file: Path) -> None:
    import zmq

    socket = zmq.Context().socket(zmq.ROUTER)
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    _write_port(port_file, port)
    while True:
        frames = socket.recv_multipart(copy=False)
        socket.send_multipart(frames, copy=False)


class ZmqEchoClient:
    def __init__(self, target: str) -> None:
        import zmq

        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        self._socket.connect(f"tcp://{target}")
        self.received = np.empty(0, dtype=np.float32)

    def commit(self, gradient: np.ndarray) -> int | None:
        self._socket.send(gradient, copy=False)
        frame = self._socket.recv(copy=False)
        self.received = np.frombuffer(frame.buffer, dtype=np.float32)
        return None

    def close(self) -> None:
        self._socket.close(linger=0)


# -- Arrow Flight ---------------------------------------------------------------------------------


def _serve_flight(port_file: Path) -> None:
    import pyarrow.flight as flight

    class Echo(flight.FlightServerBase):  # type: ignore[misc]
        def do_exchange(self, context: Any, descriptor: Any, reader: Any, writer: Any) -> None:
            started = False
            for chunk in reader:
                if not started:
                    writer.begin(chunk.data.schema)
                    started = True
                writer.write_batch(chunk.data)

    server = Echo("grpc://127.0.0.1:0")
    _write_port(port_file, server.port)
    server.serve()


class FlightEchoClient:
    def __init__(self, target: str) -> None:
        import pyarrow as pa
        import pyarrow.flight as flight

        self._pa = pa
        self._client = flight.FlightClient(f"grpc://{target}")
        self._descriptor = flight.FlightDescriptor.for_command(b"echo")
        self.received = np.empty(0, dtype=np.float32)

    def commit(self, gradient: np.ndarray) -> int | None:
        pa = self._pa
        batch = pa.record_batch([pa.array(gradient)], names=["theta"])  # wraps the array, no copy
        writer, reader = self._client.do_exchange(self._descriptor)
        writer.begin(batch.schema)
        writer.write_batch(batch)
        writer.done_writing()
        reply = reader.read_chunk().data
        self.received = reply.column(0).to_numpy(zero_copy_only=True)
        writer.close()
        return None

    def close(self) -> None:
        self._client.close()


# -- the harness ----------------------------------------------------------------------------------


def _write_port(port_file: Path, port: int) -> None:
    temporary = port_file.with_suffix(".tmp")
    temporary.write_text(f"{port}\n")
    temporary.replace(port_file)


SERVERS: dict[str, Callable[[Path], None]] = {
    "tcp-asyncio": lambda port_file: asyncio.run(_serve_asyncio(port_file)),
    "zmq": _serve_zmq,
    "flight": _serve_flight,
}


class CandidateServer(LoopbackServer):
    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind

    def command(self, port_file: Path) -> list[str]:
        return [sys.executable, __file__, "--serve", self.kind, "--port-file", str(port_file)]


@dataclass(frozen=True)
class ZmqEchoClientFactory:
    target: str

    def __call__(self, index: int) -> ZmqEchoClient:
        return ZmqEchoClient(self.target)


@dataclass(frozen=True)
class FlightEchoClientFactory:
    target: str

    def __call__(self, index: int) -> FlightEchoClient:
        return FlightEchoClient(self.target)


def measure(kind: str, plan: LoadPlan) -> float:
    """Commits per second of the `kind` echo under `plan`."""
    server: LoopbackServer
    factory: ClientFactory
    if kind == "grpc-unary":
        server = EchoServer()
    elif kind == "tcp-threads":
        server = TcpEchoServer()
    else:
        server = CandidateServer(kind)
    with server as running:
        target = running.target  # type: ignore[attr-defined]
        factories: dict[str, ClientFactory] = {
            "grpc-unary": EchoClientFactory(target, False, 1 << 20),
            "tcp-threads": TcpEchoClientFactory(target),
            "tcp-asyncio": TcpEchoClientFactory(target),
            "zmq": ZmqEchoClientFactory(target),
            "flight": FlightEchoClientFactory(target),
        }
        factory = factories[kind]
        return run_load(kind, factory, plan, running.pid).commits_per_second


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="100K,1M,10M")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2, help="alternated rounds of every candidate")
    parser.add_argument("--candidates", default=",".join(CANDIDATES))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve", choices=sorted(SERVERS), help=argparse.SUPPRESS)
    parser.add_argument("--port-file", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        threading.current_thread().name = args.serve
        SERVERS[args.serve](args.port_file)
        return
    rows: list[dict[str, Any]] = []
    for size in parse_counts(args.sizes):
        warmup, window = (2.0, 6.0) if size <= 1_000_000 else (3.0, 10.0)
        plan = LoadPlan(size, args.clients, window, warmup)
        for round_ in range(args.rounds):
            for kind in args.candidates.split(","):
                rate = measure(kind, plan)
                rows.append(
                    {
                        "candidate": kind,
                        "num_parameters": size,
                        "clients": args.clients,
                        "round": round_,
                        "commits_per_second": rate,
                    }
                )
                print(f"{kind:>12} P={size:>11,} n={args.clients} round {round_}: {rate:9.2f} commits/s", flush=True)
    print_table(rows)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


def print_table(rows: list[dict[str, Any]]) -> None:
    """Mean commits/s of each candidate as a ratio to grpc-unary and to tcp-threads, by size."""
    sizes = sorted({row["num_parameters"] for row in rows})
    kinds = list(dict.fromkeys(row["candidate"] for row in rows))

    def mean(kind: str, size: int) -> float:
        values = [r["commits_per_second"] for r in rows if r["candidate"] == kind and r["num_parameters"] == size]
        return float(np.mean(values)) if values else float("nan")

    print("| P | " + " | ".join(kinds) + " |")
    print("|---|" + "---|" * len(kinds))
    for size in sizes:
        base, raw = mean("grpc-unary", size), mean("tcp-threads", size)
        cells = [
            f"{mean(k, size):.1f} ({mean(k, size) / base:.2f}x grpc, {mean(k, size) / raw:.2f}x tcp)" for k in kinds
        ]
        print(f"| {size:,} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
