"""The replicas' etcd client: one gateway client per endpoint, and the one way a request is made.

Every request goes through `EtcdEndpoints.call`: it turns etcd's and the HTTP stack's errors into
CoordinationUnavailable and moves the next call on to the next endpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar
from urllib.parse import urlsplit

from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import Etcd3Exception

T = TypeVar("T")

#: etcd's HTTP/JSON gateway path: etcd 3.4 and later (Debian bookworm's etcd-server is 3.4)
API_PATH = "/v3/"


class CoordinationUnavailable(Exception):
    """etcd could not be reached in time, or answered with an error: who is primary is not known."""


def _clients(endpoints: str, timeout: float) -> list[Etcd3Client]:
    """One gateway client per comma-separated endpoint ("http://host:port" or "host:port")."""
    clients = []
    for endpoint in filter(None, (part.strip() for part in endpoints.split(","))):
        url = urlsplit(endpoint if "//" in endpoint else f"http://{endpoint}")
        if url.hostname is None:
            raise ValueError(f"etcd endpoint {endpoint!r}: expected http://host:port")
        clients.append(
            Etcd3Client(
                host=url.hostname, port=url.port or 2379, protocol=url.scheme, timeout=timeout, api_path=API_PATH
            )
        )
    if not clients:
        raise ValueError("no etcd endpoint given")
    return clients


class EtcdEndpoints:
    """The comma-separated `endpoints` of one etcd cluster; each request bounded by `timeout`."""

    def __init__(self, endpoints: str, timeout: float) -> None:
        self._clients = _clients(endpoints, timeout)
        self._current = 0  # the endpoint calls go to; the next one after a failure

    def call(self, what: str, request: Callable[[Etcd3Client], T]) -> T:
        """Run one request against the current endpoint; errors become CoordinationUnavailable,
        and the next call goes to the next endpoint."""
        index = self._current
        client = self._clients[index]
        try:
            return request(client)
        # etcd3gw raises Etcd3Exception for timeouts, refused connections and error statuses;
        # requests' other errors are OSErrors; a garbled answer is a ValueError or KeyError.
        except (Etcd3Exception, OSError, ValueError, KeyError) as error:
            self._current = (index + 1) % len(self._clients)
            raise CoordinationUnavailable(f"etcd {what} at {client.base_url}: {error!r}") from error

    def close(self) -> None:
        """Close the HTTP connections."""
        for client in self._clients:
            client.session.close()
