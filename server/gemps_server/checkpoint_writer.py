"""When to checkpoint: every N commits, every T seconds when the version moved, and at shutdown;
and restoring the newest checkpoint when the server starts.

The consistent view (central variable, rule state, commit ledger at one version) is taken on the
applier, between two operations, which costs a copy of the rule's global state at most; the
file is written on a worker thread, so commits keep flowing while it is serialised and synced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors

from gemps_proto.status import RestoredCheckpoint
from gemps_server.checkpoint_files import (
    Checkpoint,
    CheckpointError,
    NewerCheckpointFormat,
    load_latest,
    prune,
    remove_temporaries,
    save,
)
from gemps_server.config import ServerConfig
from gemps_server.descriptors import sparing
from gemps_server.directory_lock import DirectoryLock
from gemps_server.domain import images
from gemps_server.domain.applier import Applier
from gemps_server.domain.state import ServerState
from gemps_server.logs import event
from gemps_server.metrics import ServerMetrics

log = logging.getLogger("gemps.server")

# After a failed write (a full disk, say), wait this long before the next attempt: no retry
# (and no error line) on every commit.
FAILURE_BACKOFF_SECONDS = 10.0
# Room a checkpoint's metadata may take besides its tensors (specs, receipts, config), bytes.
METADATA_ROOM = 1 << 20


class Checkpointer:
    def __init__(self, config: ServerConfig, state: ServerState, applier: Applier, metrics: ServerMetrics) -> None:
        self.directory = Path(config.checkpoint_dir)
        self.every = config.checkpoint_every
        self.interval = config.checkpoint_interval
        self.keep = config.checkpoint_keep
        self._config: dict[str, Any] = config.recorded_settings()
        self._state = state
        self._applier = applier
        self._metrics = metrics
        self.last_version: int | None = None  # of the newest checkpoint written or restored
        self.failed = False  # the last write failed
        # The epoch under which the state's commits were acknowledged, written with each checkpoint
        # (a replica's: the epoch it holds or follows; set by the server; 0: not replicated).
        self.epoch: Callable[[], int] = lambda: 0
        self._due = asyncio.Event()
        self._stopping = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the schedule's (committed() wakes it)
        self._requested = False  # a commit woke the schedule, which has not started writing yet
        self._directory_lock = DirectoryLock(self.directory)  # one server per directory

    # -- start-up ------------------------------------------------------------------------------

    def restore(self) -> Checkpoint | None:
        """Load the newest good checkpoint into the (still empty) state; None when there is none.

        Raises NewerCheckpointFormat (a ValueError) when the newest checkpoint is of a format this
        server cannot read, OSError when the directory cannot be created or written, or another
        server holds it (DirectoryInUse): better not to start than to train for hours without the
        checkpoints the operator asked for, or to mix two servers' checkpoints. Holds the
        directory until `close()` (or until the process ends).
        """
        self.directory.mkdir(parents=True, exist_ok=True)
        if not os.access(self.directory, os.W_OK | os.X_OK):
            raise PermissionError(f"checkpoint_dir {self.directory} is not writable")
        note = self._directory_lock.acquire()
        if note is not None:
            event(log, "checkpoint directory lock", level=logging.WARNING, directory=str(self.directory), note=note)
        for path in remove_temporaries(self.directory):
            event(log, "checkpoint temporary removed", level=logging.WARNING, path=str(path))

        def corrupt(path: Path, error: CheckpointError) -> None:
            event(log, "checkpoint unreadable", level=logging.ERROR, path=str(path), error=str(error))

        try:
            found = load_latest(self.directory, on_corrupt=corrupt)
        except NewerCheckpointFormat:  # the start fails (exit 2): nothing held
            self._directory_lock.release()
            raise
        if found is None:
            event(log, "no checkpoint to restore", directory=str(self.directory))
            return None
        path, checkpoint = found
        for warning in images.restore(self._state, checkpoint.image):
            event(log, "checkpoint restore warning", level=logging.WARNING, detail=warning)
        differences = {
            key: f"{checkpoint.config.get(key)!r} -> {value!r}"
            for key, value in self._config.items()
            if checkpoint.config.get(key) != value
        }
        if differences:
            event(
                log,
                "training config differs from the checkpoint's",
                level=logging.WARNING,
                **{key: str(change) for key, change in differences.items()},
            )
        self.last_version = checkpoint.version
        self._state.restored = RestoredCheckpoint(checkpoint.version, str(path))  # `gemps status` says it
        self._metrics.checkpoint_version.set(checkpoint.version)
        event(
            log,
            "checkpoint restored",
            path=str(path),
            version=checkpoint.version,
            epoch=checkpoint.epoch or None,
            parameters=checkpoint.image.num_parameters,
            requests=len(checkpoint.image.receipts),
        )
        return checkpoint

    def close(self) -> None:
        """Give the directory up for another server (after the final checkpoint)."""
        self._directory_lock.release()

    # -- while serving ---------------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.create_task(self._run(), name="gemps-checkpoints")

    def committed(self, version: int) -> None:
        """After each operation on the applier, on whichever thread ran it (commits on a primary,
        replays on a backup: the server's applier observer), with the version reached: checkpoint
        when N commits went by. The event loop is
        woken only then, once (a loop already closed is a server stopping: its final checkpoint
        comes after)."""
        if self._requested or not self._due_by_count(version) or self._loop is None:
            return
        self._requested = True
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._due.set)

    def _due_by_count(self, version: int) -> bool:
        return bool(self.every) and version - (self.last_version or 0) >= self.every

    async def _run(self) -> None:
        # Ends when told to, never by cancellation: on Python 3.11 asyncio.wait_for can swallow a
        # cancellation that arrives as the event it waits for is set (every commit sets it with
        # --checkpoint-every 1); the loop then went on to write() and waited forever for the lock
        # held by stop_schedule(), which waited for the loop: shutdown hung.
        while not self._stopping.is_set():
            await _wait(self._due, self.interval or None)
            if self._stopping.is_set():
                return
            self._due.clear()
            self._requested = False  # commits from here on may ask for the next one
            await self.write()
            if self.failed:
                await _wait(self._stopping, FAILURE_BACKOFF_SECONDS)
            elif not self._due_by_count(self._state.core.version):
                self._due.clear()  # set by commits during the write, against the previous checkpoint
                self._requested = False

    async def write(self, *, applier_running: bool = True) -> Path | None:
        """Write a checkpoint if the version moved since the last one; returns its path."""
        async with self._lock:
            state = self._state
            if not state.core.initialized or state.core.version == self.last_version:
                return None
            view = self._view()
            checkpoint = await self._applier.submit(view) if applier_running else view()
            if checkpoint.version == self.last_version:
                return None
            started = time.perf_counter()
            try:
                # Out of descriptors (connections took them all), once more with the reserve's.
                path, size, removed = await asyncio.to_thread(sparing, lambda: self._save(checkpoint))
            except Exception as error:  # a full disk must not take the server down
                self.failed = True
                self._metrics.checkpoint_failed()
                event(
                    log,
                    "checkpoint failed",
                    level=logging.ERROR,
                    directory=str(self.directory),
                    version=checkpoint.version,
                    error=f"{type(error).__name__}: {error}",
                )
                return None
            seconds = time.perf_counter() - started
            self.failed = False
            self.last_version = checkpoint.version
            self._metrics.checkpointed(checkpoint.version, size, seconds)
            event(log, "checkpoint written", path=str(path), version=checkpoint.version, bytes=size, seconds=seconds)
            for old in removed:
                event(log, "checkpoint pruned", level=logging.DEBUG, path=str(old))
            return path

    async def stop_schedule(self) -> None:
        """Stop the schedule, after any write in progress (before the applier stops: a write
        waiting for an applier that no longer runs would never finish)."""
        self._stopping.set()
        self._due.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def write_final(self) -> Path | None:
        """The shutdown checkpoint, once the applier has drained and stopped."""
        await self.stop_schedule()
        return await self.write(applier_running=False)

    def _view(self) -> Callable[[], Checkpoint]:
        state, config, epoch = self._state, dict(self._config), self.epoch
        return lambda: Checkpoint(images.checkpoint(state), config, epoch=epoch())

    def _save(self, checkpoint: Checkpoint) -> tuple[Path, int, list[Path]]:
        """Write, then keep the newest `keep`. On a full disk, first make room by deleting the
        oldest beyond `keep - 1` (never the newest: at least one good file stays) and try once
        more: a disk that holds exactly `keep` checkpoints would otherwise never take another,
        since the old ones are pruned only after a new one is written."""
        try:
            path, size = save(self.directory, checkpoint)
            removed = []
        except (OSError, safetensors.SafetensorError):  # safetensors reports ENOSPC in its own type
            if self._free_bytes() >= _file_bytes(checkpoint):
                raise  # not for want of space
            removed = prune(self.directory, max(1, self.keep - 1))
            if not removed:
                raise
            event(log, "checkpoint disk full: pruned early", level=logging.WARNING, removed=len(removed))
            path, size = save(self.directory, checkpoint)
        return path, size, removed + prune(self.directory, self.keep)

    def _free_bytes(self) -> int:
        stats = os.statvfs(self.directory)
        return stats.f_bavail * stats.f_frsize


def _file_bytes(checkpoint: Checkpoint) -> int:
    """About what the checkpoint's file takes: its tensors, plus room for the metadata."""
    image = checkpoint.image
    tensors = image.theta.nbytes + image.buffers.nbytes + sum(value.nbytes for value in image.rule_state.values())
    return tensors + METADATA_ROOM


async def _wait(event: asyncio.Event, timeout: float | None) -> None:
    """Until `event` is set or `timeout` seconds passed (None: no timeout)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
