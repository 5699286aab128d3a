"""The model a wrapper holds, so that wrapper prefixes never reach the server.

`torch.compile(model)` returns an `OptimizedModule` that names every parameter `_orig_mod.*`, and
`DistributedDataParallel(model)` or `DataParallel(model)` one that names them `module.*`. A worker
that registered such names would be refused beside one that did not (FAILED_PRECONDITION: another
spec) and its export would not load into the plain model. gemps.pytorch names the tensors of the
model inside every such wrapper (any nesting: a compiled DDP model, a DDP-wrapped compiled one), so
compiled, DDP and plain workers share a server and `gemps export` loads into the unwrapped model
with `load_state_dict(strict=True)`. The parameters are the same tensors either way; the forward
the user calls (the wrapper) is the one whose inputs are counted (gemps.pytorch.batches).

FSDP shards the parameters across its ranks (each holds a slice of a flat parameter), which one
gemps worker cannot commit or load as the model's tensors: a model wrapped in FSDP (or with an FSDP
submodule, or `fully_shard`) is refused with InvalidArgumentError saying what to do instead.
"""

from __future__ import annotations

import sys

import torch

from gemps.errors import InvalidArgumentError
from gemps_proto.reasons import Reason

FSDP_REFUSAL = (
    "gemps cannot train an FSDP model: FSDP shards the parameters across its ranks, and a gemps worker "
    "commits and loads whole tensors. Wrap the model in DistributedDataParallel inside the worker instead (its "
    "ranks are then one gemps worker: rank 0 commits, every rank loads the reply), or run each rank as its own "
    "gemps worker with an unwrapped model (RemoteOptimizer(model, address, process_group=None))"
)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside `model`'s torch.compile, DistributedDataParallel and DataParallel wrappers
    (`model` itself when it has none); InvalidArgumentError for an FSDP model."""
    refuse_sharded(model)
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
            model = model.module
        else:
            inner = _compiled(model)
            if inner is None:
                return model
            model = inner


def data_parallel_wrapper(model: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The outermost DistributedDataParallel among `model`'s wrappers, if any."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model
        if isinstance(model, torch.nn.DataParallel):
            model = model.module
        else:
            inner = _compiled(model)
            if inner is None:
                return None
            model = inner


def refuse_sharded(model: torch.nn.Module) -> None:
    """InvalidArgumentError when `model` or a module inside it is sharded by FSDP."""
    fsdp = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be FSDP's
    if fsdp is None:
        return
    kinds = tuple(getattr(fsdp, name) for name in ("FullyShardedDataParallel", "FSDPModule") if hasattr(fsdp, name))
    if kinds and any(isinstance(module, kinds) for module in model.modules()):
        raise InvalidArgumentError(FSDP_REFUSAL, InvalidArgumentError.code, Reason.BAD_SPEC)


def _compiled(model: torch.nn.Module) -> torch.nn.Module | None:
    """The model inside torch.compile's wrapper, when `model` is one; looked up only once
    torch._dynamo is loaded (importing it costs seconds)."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")
    if dynamo is None or not isinstance(model, dynamo.OptimizedModule):
        return None
    inner = model._orig_mod
    assert isinstance(inner, torch.nn.Module)
    return inner
