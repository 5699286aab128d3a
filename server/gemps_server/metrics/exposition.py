"""What /metrics serves: a server's registry, with constant labels added when it has any, and the
HTTP endpoint that serves it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator, Mapping
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric

# How often the endpoint's thread looks for a stop, which waits for that look: prometheus_client's
# start_http_server looks every half second, most of the time a test's server took to stop.
STOP_POLL_SECONDS = 0.05


class Labelled:
    """The metrics of `registry` with constant labels added to every sample, e.g. the partition
    of θ a server holds (`partition="1"`): K partitions scraped as one target (gemps server
    --partitions K) or as K pods still give one series per partition."""

    def __init__(self, registry: CollectorRegistry, labels: Mapping[str, str]) -> None:
        self._registry = registry
        self._labels = dict(labels)

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            labelled = Metric(family.name, family.documentation, family.type, family.unit)
            labelled.samples = [sample._replace(labels={**sample.labels, **self._labels}) for sample in family.samples]
            yield labelled


def exposed(registry: CollectorRegistry, labels: Mapping[str, str]) -> CollectorRegistry:
    """What to serve on /metrics: `registry` itself, or with `labels` added when there are any."""
    if not labels:
        return registry
    outer = CollectorRegistry(auto_describe=True)
    outer.register(Labelled(registry, labels))
    return outer


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        """No line per scrape."""


def serve(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve `registry` on /metrics at host:port (port 0: any free one) from a daemon thread, as
    prometheus_client.start_http_server does (a thread per scrape, the address family the host's),
    looking for a stop every STOP_POLL_SECONDS. OSError when it cannot listen."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingMixIn, WSGIServer):
        address_family = family
        daemon_threads = True  # a scrape in flight does not hold the process at exit

    server = make_server(str(address[0]), port, make_wsgi_app(registry), Server, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, args=(STOP_POLL_SECONDS,), name="gemps-metrics")
    thread.daemon = True
    thread.start()
    return server
