"""A raw HTTP/2 client that speaks just enough gRPC to misbehave: declare a message and never
finish it, keep a zero receive window and never read, open calls by the hundred on one socket.
The hostile tests use it against real server processes."""

from __future__ import annotations

import socket
import struct
import time
from collections import Counter
from collections.abc import Callable

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings

from tests.helpers import wait_for


def _text(header: bytes | str) -> str:
    return header.decode() if isinstance(header, bytes) else header


def grpc_frame(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


class RawConnection:
    """An HTTP/2 client on one socket that speaks just enough gRPC to misbehave."""

    def __init__(self, port: int, receive_window: int | None = None) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        if receive_window is not None:
            self.h2.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: receive_window}
            )
        self.h2.initiate_connection()
        self.statuses: dict[int, str] = {}  # stream id: grpc-status, once the server ended it
        self.reasons: dict[int, str] = {}  # stream id: gemps-reason of a refusal that had one
        self.received: Counter[int] = Counter()  # stream id: bytes of replies received (never acknowledged)
        self.answered: set[int] = set()  # stream ids whose response headers came (a handler replies)
        self.closed_by_server = False
        self._flush()

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(self, method: str, body: bytes | None = None, metadata: tuple[tuple[str, str], ...] = ()) -> int:
        """A call to `method`; with `body`, its request is sent whole and the stream half-closed."""
        stream = self.h2.get_next_available_stream_id()
        headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "gemps")]
        headers += [("content-type", "application/grpc"), ("te", "trailers"), *metadata]
        self.h2.send_headers(stream, headers)
        if body is not None:
            self.h2.send_data(stream, body, end_stream=True)
        self._flush()
        return stream

    def pump(self, seconds: float) -> None:
        """Handle what the server sends for `seconds`, reading none of the calls' data."""
        deadline = time.monotonic() + seconds
        while not self.closed_by_server and (left := deadline - time.monotonic()) > 0:
            self._receive(left)

    def until(self, condition: Callable[[], bool], timeout: float, what: str) -> None:
        """Handle what the server sends until `condition()` holds; fail after `timeout` seconds."""

        def pumped() -> bool:
            self.pump(0.05)
            return condition()

        wait_for(pumped, timeout, what)

    def _receive(self, timeout: float) -> None:
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return
        except ConnectionResetError:
            data = b""
        if not data:
            self.closed_by_server = True
            return
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError:  # frames after GOAWAY: only the socket's end matters now
            return
        for event in events:
            if isinstance(event, h2.events.TrailersReceived | h2.events.ResponseReceived):
                self.answered.add(event.stream_id)
                headers = {_text(key): _text(value) for key, value in event.headers or ()}
                if "grpc-status" in headers:
                    self.statuses[event.stream_id] = headers["grpc-status"]
                if "gemps-reason" in headers:
                    self.reasons[event.stream_id] = headers["gemps-reason"]
            elif isinstance(event, h2.events.DataReceived):
                self.received[event.stream_id] += len(event.data)
            elif isinstance(event, h2.events.StreamReset):
                self.statuses.setdefault(event.stream_id, "reset")
        self._flush()

    def send_all_but_the_last_byte(self, streams: list[int], declared: int, seconds: float) -> int:
        """Declare a message of `declared` bytes on each stream and send all of it but its last
        byte, as far as flow control allows within `seconds`; the bytes the server took."""
        sent = dict.fromkeys(streams, 0)
        total = 5 + declared - 1
        zeros = bytes(16384)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            open_streams = [s for s in streams if s not in self.statuses and sent[s] < total]
            if not open_streams or self.closed_by_server:
                break
            for stream in open_streams:
                while sent[stream] < total:
                    room = min(self.h2.local_flow_control_window(stream), self.h2.max_outbound_frame_size)
                    if room <= 0:
                        break
                    piece = zeros[: min(room, total - sent[stream])]
                    if sent[stream] == 0:
                        piece = (b"\x00" + struct.pack(">I", declared) + piece)[: len(piece)]
                    self.h2.send_data(stream, piece)
                    sent[stream] += len(piece)
                    self._flush()
            self._receive(0.05)
        return sum(sent.values())

    def close(self) -> None:
        self.sock.close()
