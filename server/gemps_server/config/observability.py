"""How the server is watched: its Prometheus endpoint and its log lines."""

from __future__ import annotations

from dataclasses import dataclass, field

from gemps_proto.ranges import DEFAULT_TEXT, RANGE, Range
from gemps_server.config.listen import FOLLOWS_PORT
from gemps_server.logs import LOG_FORMATS

LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ObservabilityOptions:
    metrics_port: int = field(
        default=FOLLOWS_PORT,
        metadata={
            "help": "Prometheus /metrics port; -1 disables; 0 picks a free one; by default 9109 + (--port - 50051), "
            "9109 for the default --port, or a free one where --port is 0 or that is no port",
            DEFAULT_TEXT: "9109 + (--port - 50051)",
            RANGE: Range(-1, 65535),
        },
    )
    metrics_host: str = field(default="", metadata={"help": "metrics address (default: same as --host)"})
    log_level: str = field(default="info", metadata={"help": "log level", "choices": LOG_LEVELS})
    log_format: str = field(
        default="text",
        metadata={"help": "log lines: text (key=value fields) or json (one object per line)", "choices": LOG_FORMATS},
    )

    def problems(self) -> list[str]:
        """An unknown log level or format (the metrics port's range: ServerConfig)."""
        found = []
        if self.log_level not in LOG_LEVELS:
            found.append(f"unknown log_level {self.log_level!r} (choose from {', '.join(LOG_LEVELS)})")
        if self.log_format not in LOG_FORMATS:
            found.append(f"unknown log_format {self.log_format!r} (choose from {', '.join(LOG_FORMATS)})")
        return found
