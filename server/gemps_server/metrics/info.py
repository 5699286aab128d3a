"""The server process itself: its CPU, memory and descriptors, its build, and the training config it announces."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Info
from prometheus_client.process_collector import ProcessCollector

from gemps_proto import versions
from gemps_proto.schema import TrainingConfig


class ServerInfo:
    def __init__(self, registry: CollectorRegistry) -> None:
        ProcessCollector(registry=registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.info = Info("gemps_server", "The training config the server announces.", registry=registry)
        # Set once: which gemps serves, so a mixed fleet after an upgrade shows on the dashboard.
        self.build = Info("gemps_build", "The server's software and protocol versions.", registry=registry)
        self.build.info(
            {
                "version": versions.SOFTWARE_VERSION,
                "protocol": str(versions.PROTOCOL_VERSION),
                "oldest_protocol": str(versions.OLDEST_PROTOCOL_VERSION),
            }
        )

    def describe(self, training: TrainingConfig) -> None:
        """The training config as the info metric's labels, one per field."""
        values = training.as_dict().items()
        self.info.info({key: f"{value:g}" if isinstance(value, float) else str(value) for key, value in values})
