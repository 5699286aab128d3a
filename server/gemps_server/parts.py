"""The server's parts that hold more than one call's worth (lifecycle.Part): the checkpoint
directory and the final checkpoint, the metrics endpoint, the data plane's door and the port file.
app.py declares the order they start in (and so stop in); each says here what it takes and lets go.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from gemps_server.allocator import tune_for
from gemps_server.checkpoint_files import Checkpoint
from gemps_server.checkpoint_writer import Checkpointer
from gemps_server.config import ServerConfig
from gemps_server.domain.state import ServerState
from gemps_server.listening import listening
from gemps_server.metrics import ServerMetrics, exposed
from gemps_server.metrics.exposition import serve
from gemps_server.service import ParameterService
from gemps_server.wire.data_plane import DataPlaneServer


class CheckpointDirectory:
    """Held while the server runs (one server per directory), restored from before anything
    serves: workers register against the restored state."""

    name = "checkpoint directory"

    def __init__(self, checkpointer: Checkpointer, state: ServerState) -> None:
        self._checkpointer = checkpointer
        self._state = state
        self.restored: Checkpoint | None = None

    async def start(self) -> None:
        self.restored = self._checkpointer.restore()
        tune_for(4 * self._state.core.num_parameters)  # see allocator.py

    async def stop(self, grace: float) -> None:
        self._checkpointer.close()  # after the final checkpoint


class FinalCheckpoint:
    """Written once the applier drained (it stops before this part does). `durable`: whether every
    acknowledged commit is in a checkpoint (False: the server exits 3, EXIT_CHECKPOINT_LOST)."""

    name = "final checkpoint"

    def __init__(self, checkpointer: Checkpointer, state: ServerState) -> None:
        self._checkpointer = checkpointer
        self._state = state
        self.durable = True

    async def start(self) -> None:
        return None

    async def stop(self, grace: float) -> None:
        try:
            await self._checkpointer.write_final()
        finally:  # from what was written, whatever failed
            state = self._state
            self.durable = self._checkpointer.last_version == state.core.version or not state.core.initialized


class CheckpointSchedule:
    """Checkpoints every N commits or T seconds while the server runs; stopped (after any write in
    progress) before the applier stops: a write waiting for an applier that no longer runs would
    never finish."""

    name = "checkpoint schedule"

    def __init__(self, checkpointer: Checkpointer) -> None:
        self._checkpointer = checkpointer

    async def start(self) -> None:
        self._checkpointer.start()

    async def stop(self, grace: float) -> None:
        await self._checkpointer.stop_schedule()


class MetricsEndpoint:
    """The Prometheus endpoint (/metrics), with the partition's and replica's labels when it has them."""

    name = "metrics endpoint"

    def __init__(self, config: ServerConfig, metrics: ServerMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self.port = 0
        self._server: WSGIServer | None = None

    async def start(self) -> None:
        config = self._config
        host = config.metrics_host or config.host
        labels = {"partition": str(config.partition)} if config.partitions > 1 else {}
        if config.replicas > 1:
            labels["replica"] = str(config.replica)
        registry = exposed(self._metrics.registry, labels)

        def start() -> int:
            server = self._server = serve(registry, host, config.metrics_port)
            return int(server.server_port)

        self.port = listening("metrics", host, config.metrics_port, start)

    async def stop(self, grace: float) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


class DataPlaneDoor:
    """The data plane's port, open before gRPC serves: every registration can announce it."""

    name = "data plane"

    def __init__(self, config: ServerConfig, data_plane: DataPlaneServer, service: ParameterService) -> None:
        self._config = config
        self._data_plane = data_plane
        self._service = service
        self.port = 0

    async def start(self) -> None:
        config = self._config
        self.port = listening("data plane", config.host, config.data_port, self._data_plane.start)
        self._service.data_plane.listening(self.port, self._data_plane.local_socket)

    async def stop(self, grace: float) -> None:
        await asyncio.to_thread(self._data_plane.stop, grace)


class PortFile:
    """The ports bound, for whoever started this process (`gemps_worker.processes`): written last,
    via a rename, so a reader never sees a partial file (and a file there means serving)."""

    name = "port file"

    def __init__(self, path: str, ports: Callable[[], tuple[int, ...]]) -> None:
        self._path = path
        self._ports = ports  # read once the parts before this one bound theirs

    async def start(self) -> None:
        tmp = Path(self._path + ".tmp")
        tmp.write_text("".join(f"{port}\n" for port in self._ports()))
        tmp.replace(self._path)

    async def stop(self, grace: float) -> None:
        return None
