"""Versions: this build's software and protocol versions, and when two ends may talk.

The software version is the package's (pyproject.toml, through its metadata): for humans, logs
and metrics. The protocol version is an integer that changes only when an older peer would
misread the wire (a field whose loss changes a request's meaning, a changed frame); fields an
older peer may ignore leave it as it is. Each end says the newest protocol it speaks and the
oldest it still speaks; two ends are compatible when those ranges overlap, and each end checks
the same rule (the SDK on Register and Status replies, the server on Register requests), so both
refuse with an error that names both ends. A peer that sends no versions (field absent, as
before versions existed) speaks protocol 1 only: what every gemps spoke then.
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass

#: the newest protocol this build speaks
PROTOCOL_VERSION = 1
#: the oldest protocol this build still speaks
OLDEST_PROTOCOL_VERSION = 1
#: what a peer from before versions speaks (it sends none)
LEGACY_PROTOCOL_VERSION = 1
#: characters of a peer's software version kept (a refusal's details and log lines repeat it)
MAX_SOFTWARE_LENGTH = 64


def _software_version() -> str:
    try:
        return importlib.metadata.version("gemps")  # pyproject.toml's, the one definition
    except importlib.metadata.PackageNotFoundError:  # run from a source tree never installed
        return "unknown"


SOFTWARE_VERSION = _software_version()


@dataclass(frozen=True)
class Versions:
    """One end's versions (gemps.v1.Versions): its software, and the protocols it speaks."""

    software: str = ""  # "": not said (a peer from before versions)
    protocol: int = LEGACY_PROTOCOL_VERSION  # the newest it speaks
    oldest_protocol: int = LEGACY_PROTOCOL_VERSION  # the oldest it still speaks

    def describe(self) -> str:
        """`gemps 0.9.0 (protocol 1)`, `gemps 2.0 (protocols 2-3)`, `gemps before versions (protocol 1)`."""
        software = f"gemps {self.software}" if self.software else "gemps before versions"
        if self.oldest_protocol == self.protocol:
            return f"{software} (protocol {self.protocol})"
        return f"{software} (protocols {self.oldest_protocol}-{self.protocol})"


#: this build's versions
THIS = Versions(SOFTWARE_VERSION, PROTOCOL_VERSION, OLDEST_PROTOCOL_VERSION)
#: what a peer that sends no versions is taken to be
LEGACY = Versions()


def received(software: str, protocol: int, oldest_protocol: int) -> Versions:
    """A peer's versions as sent; 0 (a field absent on the wire) means the legacy protocol. The
    software string is the peer's say: cut to MAX_SOFTWARE_LENGTH printable characters, since
    refusals and logs repeat it."""
    newest = protocol or LEGACY_PROTOCOL_VERSION
    shown = "".join(c if c.isprintable() else "?" for c in software[:MAX_SOFTWARE_LENGTH])
    return Versions(shown, newest, min(oldest_protocol or newest, newest))


def compatible(one: Versions, other: Versions) -> bool:
    """Whether two ends share a protocol: their [oldest, newest] ranges overlap."""
    return one.oldest_protocol <= other.protocol and other.oldest_protocol <= one.protocol


def incompatibility(server: Versions, client: Versions) -> str | None:
    """The refusal's message when `server` and `client` share no protocol, naming both; None
    when they do."""
    if compatible(server, client):
        return None
    newer = "server" if server.oldest_protocol > client.protocol else "client"
    return (
        f"incompatible versions: server {server.describe()}, client {client.describe()}; "
        f"upgrade the {'client' if newer == 'server' else 'server'} (docs/guides/sdk.md: version policy)"
    )
