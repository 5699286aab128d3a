"""The highest epoch this replica has seen, kept on its disk: etcd may lose its data, a replica's
disk says which epochs were already used (docs/DESIGN.md §3d, "when etcd loses its data").

A replica raises the record *before* it acts on a new epoch: before it serves as that epoch's
primary, and before it follows that epoch's primary (so before anything it checkpoints, forwards
or acknowledges names the epoch). After etcd restarted empty, the first primary's epoch is chosen
above every live replica's record (election.py), so no epoch number is ever used twice.

The file is `replica-epoch.json` in the replica's checkpoint directory, written atomically (a
temporary file, fsync, rename, fsync of the directory). A replica without a checkpoint directory
keeps the record in memory only: it holds nothing on disk either, so after a restart it reports
epoch 0 and version 0, and only the other replicas' records (and etcd) say which epochs were used.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from gemps_server.checkpoint_files import write_atomically

#: the record's file name in a replica's checkpoint directory
FILE_NAME = "replica-epoch.json"


class EpochRecordError(RuntimeError):
    """The record on disk cannot be read or written: the replica must not act on a new epoch."""


class EpochRecord:
    """The highest epoch seen, in `directory`'s FILE_NAME (None: in memory only)."""

    def __init__(self, directory: Path | None) -> None:
        self.path = directory / FILE_NAME if directory is not None else None
        self._lock = threading.Lock()  # the coordinator's thread and a promotion may raise it at once
        self._seen = self._load()

    @property
    def seen(self) -> int:
        """The highest epoch this replica (in this and earlier processes, when on disk) has seen."""
        return self._seen

    def raise_to(self, epoch: int) -> None:
        """Record `epoch` if it is above the record (durably, when on disk) before returning; an
        epoch at or below it changes nothing. EpochRecordError when the disk refuses."""
        with self._lock:
            if epoch <= self._seen:
                return
            if self.path is not None:
                text = json.dumps({"epoch": epoch})
                try:
                    write_atomically(self.path, lambda temporary: _write(temporary, text))
                except OSError as error:
                    raise EpochRecordError(f"cannot record epoch {epoch} in {self.path}: {error}") from error
            self._seen = epoch

    def _load(self) -> int:
        if self.path is None or not self.path.exists():
            return 0
        try:
            epoch = json.loads(self.path.read_text())["epoch"]
            if not isinstance(epoch, int) or epoch < 0:
                raise ValueError(f"epoch {epoch!r} is not a count")
            return epoch
        except (OSError, ValueError, KeyError, TypeError) as error:
            # Read as 0, a lost record could let an epoch be reused: refuse, naming the file.
            raise EpochRecordError(
                f"unreadable epoch record {self.path}: {error}; it holds the highest epoch this replica saw "
                "(remove it only if etcd still holds this job's keys)"
            ) from error


def _write(path: Path, text: str) -> None:
    path.write_text(text)
