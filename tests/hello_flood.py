"""A flood of replication hellos that never complete, run as its own process (so that it is not
slowed by the test's interpreter): `concurrent` connections at once to 127.0.0.1:`port`, from
127.0.0.1, each sending its opening bytes as soon as it connects and then nothing; one the replica
closes is dialled again at once. Opening bytes: `frame`, a gemps hello without any proof of the
job's credential; `tls`, the start of a TLS ClientHello that never ends. On SIGTERM it prints how
many connections sent their opening bytes and exits.

    python -m tests.hello_flood PORT EPOCH CONCURRENT frame|tls
"""

from __future__ import annotations

import json
import secrets
import selectors
import signal
import socket
import struct
import sys
from types import FrameType

#: a TLS 1.2 handshake record announcing a ClientHello of 512 bytes, and the first 4 of them
TLS_OPENING = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc"


def opening(kind: str, epoch: int) -> bytes:
    if kind == "tls":
        return TLS_OPENING
    hello = {
        "kind": "hello",
        "blobs": [],
        "name": "partition-0-replica-1",
        "incarnation": "flood",
        "address": "127.0.0.1:1",
        "replication": "127.0.0.1:2",
        "epoch": epoch,
        "nonce": secrets.token_hex(32),
        "admit": secrets.token_hex(32),
    }
    header = json.dumps(hello).encode()
    return struct.pack("<IQ", len(header), 0) + header


class Flood:
    def __init__(self, port: int, epoch: int, concurrent: int, kind: str) -> None:
        self.port, self.epoch, self.kind = port, epoch, kind
        self.selector = selectors.DefaultSelector()
        self.opened = 0  # connections that sent their opening bytes
        self.stopped = False
        for _ in range(concurrent):
            self.dial()

    def dial(self) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        except OSError:
            sock.close()
            return
        self.selector.register(sock, selectors.EVENT_WRITE, "connecting")

    def replace(self, sock: socket.socket) -> None:
        self.selector.unregister(sock)
        sock.close()
        self.dial()

    def run(self) -> None:
        while not self.stopped:
            for key, _ in self.selector.select(0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if key.data == "connecting":
                    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        self.replace(sock)
                        continue
                    try:
                        sock.send(opening(self.kind, self.epoch))
                    except OSError:
                        self.replace(sock)
                        continue
                    self.opened += 1
                    self.selector.modify(sock, selectors.EVENT_READ, "held")
                    continue
                try:
                    ended = not sock.recv(65536)  # what the replica says is ignored; its close is not
                except BlockingIOError:
                    continue
                except OSError:
                    ended = True
                if ended:
                    self.replace(sock)


def main() -> None:
    port, epoch, concurrent, kind = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    flood = Flood(port, epoch, concurrent, kind)

    def stop(signum: int, frame: FrameType | None) -> None:
        flood.stopped = True

    signal.signal(signal.SIGTERM, stop)
    print("flooding", flush=True)
    flood.run()
    print(f"opened {flood.opened}", flush=True)


if __name__ == "__main__":
    main()
