"""Where a data-plane transport stands (`DataPlaneTransport.state`), the moves between its states,
and how soon it tries the data plane again after falling back to gRPC."""

from __future__ import annotations

import enum

# A transport that fell back to gRPC tries the data plane again after RETRY_FIRST seconds, then
# after twice as long each time that fails, at most RETRY_MAX, each wait ±RETRY_JITTER of itself
# (so workers that fell back together do not all come back at once); an attempt waits at most
# RETRY_CONNECT_TIMEOUT for the connection and its HELLO.
RETRY_FIRST = 1.0
RETRY_MAX = 60.0
RETRY_JITTER = 0.25
RETRY_CONNECT_TIMEOUT = 2.0


class Link(enum.Enum):
    """Where a data-plane transport stands (`DataPlaneTransport.state`)."""

    NOT_OFFERED = "not offered"  # no registration yet, or its server offers no data plane: gRPC
    OFFERED = "offered"  # a registration's offer, no connection open: the next call opens one
    CONNECTED = "connected"  # a connection whose HELLO was answered
    SHARED = "shared"  # that connection with shared memory attached (a local socket)
    FELL_BACK = "fell back"  # auto: the data plane could not be used; gRPC until `_retry_at`
    CLOSED = "closed"  # the transport is closed


#: the moves `_become` allows (a state may always become itself)
MOVES: dict[Link, frozenset[Link]] = {
    Link.NOT_OFFERED: frozenset({Link.OFFERED, Link.FELL_BACK, Link.CLOSED}),
    Link.OFFERED: frozenset({Link.NOT_OFFERED, Link.CONNECTED, Link.FELL_BACK, Link.CLOSED}),
    Link.CONNECTED: frozenset({Link.NOT_OFFERED, Link.OFFERED, Link.SHARED, Link.FELL_BACK, Link.CLOSED}),
    Link.SHARED: frozenset({Link.NOT_OFFERED, Link.OFFERED, Link.FELL_BACK, Link.CLOSED}),
    # a return, a retry that failed again, or a registration gone (the fallback's wait still runs)
    Link.FELL_BACK: frozenset({Link.CONNECTED, Link.CLOSED}),
    Link.CLOSED: frozenset(),
}
OPEN = frozenset({Link.CONNECTED, Link.SHARED})
