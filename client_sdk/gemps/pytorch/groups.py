"""The ranks of a torch.distributed process group as one gemps worker (DDP inside a worker).

A worker node with several GPUs runs DistributedDataParallel inside and gemps across nodes. DDP
all-reduces the gradients, so every rank holds the same, group-wide gradient: were each rank a gemps
worker, the server would apply it once per rank. Instead the group is one worker. Its leader
(group rank 0) alone has a gemps Client: it registers, commits the all-reduced gradient and
buffers, and broadcasts what the server replied (the registration, the commit's figures, θ and the
buffers as flat vectors, or the failure) to the other ranks, which load the same θ and buffers; every
rank's step returns once that broadcast arrived. The samples a step commits are the group's: each
rank's counted forwards, summed. As DDP's own collectives, `step`, `commit_update` and `pull` are
called by every rank of the group, in the same order.

Which group (gemps.pytorch's `process_group=`): "auto", the default, takes the process group of the
DistributedDataParallel wrapper the model is in, else the default group when torch.distributed is
initialised with more than one rank (a DDP model's inner module given to RemoteOptimizer, or
gradients the user all-reduces: a WARNING says so, since gemps cannot tell); a ProcessGroup names
one; None makes every rank its own gemps worker (ranks that train apart).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gemps.errors import GempsError
from gemps.pytorch.values import host_tensor
from gemps.pytorch.wrappers import data_parallel_wrapper
from gemps.records import CentralVariable, CommitResult, Registration

AUTO = "auto"

log = logging.getLogger("gemps.pytorch")


class GroupLeaderError(GempsError):
    """On a rank other than the group's leader: the leader's call to the server failed (the
    message is its error's), so this rank's step fails too."""


@dataclass
class Outcome:
    """What the leader's call to the server gave, as every rank of the group learns it."""

    registration: Registration | None  # as the server last registered the leader
    central: CentralVariable | None = None  # to load (None: the model keeps its values)
    result: CommitResult | CentralVariable | None = None  # the call's return value
    error: str = ""  # the leader's failure, raised on every rank after `central` is loaded


def process_group_of(model: torch.nn.Module, chosen: object) -> Any:
    """The process group whose ranks are one gemps worker (None: this process is one on its own)."""
    if chosen is None:
        return None
    if chosen == AUTO:
        wrapper = data_parallel_wrapper(model)
        if wrapper is not None:
            chosen = wrapper.process_group
        elif dist.is_available() and dist.is_initialized():
            chosen = dist.group.WORLD
            if dist.get_world_size() > 1 and dist.get_rank() == 0:  # not silent: the other ranks' own
                log.warning(  # gradients, unless DDP or the user all-reduced them, are not committed
                    "gemps: torch.distributed is initialised with %d ranks and the model is not wrapped in "
                    "DistributedDataParallel: the ranks are one gemps worker, rank 0 commits the gradient it "
                    "holds (all-reduce it first), every rank loads the reply; RemoteOptimizer(..., "
                    "process_group=None) makes each rank its own gemps worker",
                    dist.get_world_size(),
                )
        else:
            return None
    if not (dist.is_available() and isinstance(chosen, dist.ProcessGroup)):
        raise ValueError(f"process_group={chosen!r}: give 'auto', a torch.distributed ProcessGroup or None")
    return chosen if dist.get_world_size(chosen) > 1 else None


class GroupWorker:
    """Shares the leader's outcomes with the other ranks of `group`."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.leads = dist.get_rank(group) == 0
        self.rank = dist.get_rank()
        # NCCL moves only CUDA tensors: the flat vectors travel through the current GPU there.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def samples(self, seen: int | None) -> int | None:
        """The samples every rank's forwards saw since the last step, summed over the group."""
        count = torch.tensor([seen or 0], dtype=torch.int64, device=self.device)
        dist.all_reduce(count, group=self.group)
        return int(count.item()) or None

    def share(self, outcome: Outcome | None) -> Outcome:
        """The leader's `outcome` on every rank (the leader passes it, the others None): the small
        records through broadcast_object_list, θ and the buffers as flat tensors."""
        header: list[Any] = [None]
        values: tuple[np.ndarray, ...] = ()
        if self.leads:
            assert outcome is not None
            central = outcome.central
            bare = None
            if central is not None:
                values = (central.flat, central.buffers, central.integer_buffers)
                bare = dataclasses.replace(
                    central, flat=_EMPTY_FLOATS, buffers=_EMPTY_FLOATS, integer_buffers=_EMPTY_INTEGERS
                )
            result = outcome.result
            if isinstance(result, CommitResult):
                assert bare is not None  # a commit's reply is what the model loads
                result = dataclasses.replace(result, parameters=bare)
            elif isinstance(result, CentralVariable):
                result = bare
            header = [(dataclasses.replace(outcome, central=bare, result=result), tuple(v.size for v in values))]
        dist.broadcast_object_list(header, group=self.group, group_src=0, device=self.device)
        shared, sizes = header[0]
        vectors = [self._broadcast(values[i] if values else None, size, _DTYPES[i]) for i, size in enumerate(sizes)]
        if self.leads:
            assert outcome is not None
            return outcome
        if shared.central is not None:
            flat, buffers, integers = vectors
            shared.central = dataclasses.replace(shared.central, flat=flat, buffers=buffers, integer_buffers=integers)
        if isinstance(shared.result, CommitResult):
            assert shared.central is not None
            shared.result = dataclasses.replace(shared.result, parameters=shared.central)
        elif isinstance(shared.result, CentralVariable):
            shared.result = shared.central
        assert isinstance(shared, Outcome)
        return shared

    def _broadcast(self, values: np.ndarray | None, size: int, dtype: torch.dtype) -> np.ndarray:
        """The leader's flat `values` on every rank (the others pass None)."""
        if values is not None:
            vector = host_tensor(np.ascontiguousarray(values)).to(self.device)
        else:
            vector = torch.empty(size, dtype=dtype, device=self.device)
        if size:
            dist.broadcast(vector, group=self.group, group_src=0)
        return vector.cpu().numpy() if values is None else values


_DTYPES = (torch.float32, torch.float32, torch.int64)  # θ, the float buffers, the integer ones
_EMPTY_FLOATS = np.empty(0, np.float32)  # a central variable's values in the header: sent apart
_EMPTY_INTEGERS = np.empty(0, np.int64)
