"""What both roles of the data-plane protocol core share (data_plane_protocol.py): where a
connection stands, and the reader that takes a frame's preamble, then its header, then its payload
into the right buffer, exactly as many bytes as the protocol needs next."""

from __future__ import annotations

import enum
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from gemps_proto.data_plane_events import (
    NEED_DATA,
    ClientEvent,
    NeedData,
    PayloadComplete,
    ProtocolError,
    ServerEvent,
)
from gemps_proto.data_plane_frames import PREAMBLE, Preamble

M = TypeVar("M", bound=Message)


class State(enum.Enum):
    HELLO = "hello"  # server: nothing proven yet; client: nothing sent
    PROVING = "proving"  # server: its answer sent, the HELLO next; client: the answer proven, the HELLO next
    IDLE = "idle"  # between requests
    HEADER = "header"  # a frame's header is being read
    PAYLOAD = "payload"  # a payload is being read
    REPLY_DUE = "reply due"  # server: a request read whole; client: a request sent
    CLOSED = "closed"


def parsed(message_class: type[M], data: bytes | bytearray) -> M | None:
    try:
        return message_class.FromString(bytes(data))
    except DecodeError:
        return None


class Reader:
    """What both roles share: a preamble, then a header, then a payload, read into the right buffer."""

    def __init__(self) -> None:
        self.state = State.HELLO
        self.frame: Preamble | None = None  # the frame being read or answered
        self.shared = False  # shared memory is attached
        self._preamble = bytearray(PREAMBLE.size)
        self._header = bytearray()
        self._view = memoryview(self._preamble)  # where the next bytes go
        self._filled = 0
        self._reading_preamble = True
        self._pending: list[ServerEvent | ClientEvent] = []
        self._extra = bytearray()  # receive_data's bytes past what the protocol asked for

    def read_view(self) -> memoryview:
        """Where the next bytes go: exactly as many as the protocol needs now (empty: none, until
        an event is handled)."""
        return self._view[self._filled :]

    def received(self, count: int) -> None:
        """`count` bytes were written at the start of `read_view()`."""
        self._filled += count
        if self._filled < len(self._view):
            return
        if self._reading_preamble:
            self._reading_preamble = False
            self._pending.extend(self._on_preamble())
        elif self.state is State.HEADER:
            header = bytes(self._header)
            self._header = bytearray()
            self._pending.extend(self._on_header(header))
        elif self.state is State.PAYLOAD:
            self.payload_landed()

    def next_event(self) -> ServerEvent | ClientEvent | NeedData:
        if not self._pending and self._extra and len(self.read_view()):
            self._feed(b"")
        if self._pending:
            return self._pending.pop(0)
        return NEED_DATA

    def receive_data(self, data: bytes | bytearray | memoryview) -> list[ServerEvent | ClientEvent]:
        """Feed bytes in hand; every event they complete (a payload needs `payload_into` first:
        the bytes after a CommitHeader or ReplyReceived wait for it)."""
        self._feed(data)
        events: list[ServerEvent | ClientEvent] = []
        while (event := self.next_event()) is not NEED_DATA:
            assert not isinstance(event, NeedData)
            events.append(event)
        return events

    def _feed(self, data: bytes | bytearray | memoryview) -> None:
        self._extra += data
        while self._extra and self.state is not State.CLOSED:
            view = self.read_view()
            if not len(view):
                return
            count = min(len(view), len(self._extra))
            view[:count] = self._extra[:count]
            del self._extra[:count]
            self.received(count)

    def payload_into(self, view: memoryview) -> None:
        """The payload announced goes into `view` (its exact size): read_view() is it from now."""
        frame = self.frame
        assert self.state is State.PAYLOAD and frame is not None, self.state
        if len(view) != frame.payload_bytes:
            raise ValueError(f"a view of {len(view)} bytes for a payload of {frame.payload_bytes}")
        self._expect(view.cast("B"))

    def payload_landed(self) -> None:
        """The payload announced is in the caller's memory (read by the caller itself)."""
        assert self.state is State.PAYLOAD, self.state
        self._payload_done()
        self._pending.append(PayloadComplete())

    def _expect(self, view: memoryview) -> None:
        self._view, self._filled = view, 0

    def _read_header(self, size: int) -> list[ServerEvent | ClientEvent]:
        """After the preamble: its header next (an empty one is complete at once)."""
        self.state = State.HEADER
        self._header = bytearray(size)
        self._expect(memoryview(self._header))
        return self._on_header(b"") if not size else []

    def _next_frame(self) -> None:
        self._reading_preamble = True
        self._expect(memoryview(self._preamble))

    def _nothing_to_read(self) -> None:
        self._expect(memoryview(b""))

    def _close(self, error: ProtocolError) -> list[ServerEvent | ClientEvent]:
        self.state = State.CLOSED
        self._nothing_to_read()
        return [error]

    def _on_preamble(self) -> list[ServerEvent | ClientEvent]:
        raise NotImplementedError

    def _on_header(self, header: bytes) -> list[ServerEvent | ClientEvent]:
        raise NotImplementedError

    def _payload_done(self) -> None:
        raise NotImplementedError
