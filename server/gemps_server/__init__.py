"""gemps parameter server: GEM and other asynchronous commit rules behind a gRPC service."""

__version__ = "0.1.0"
