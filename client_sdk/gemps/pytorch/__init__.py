"""Torch helpers (the `torch` extra): keep a model on the central variable, as a wrapper or as a drop-in optimizer.

    optimizer = RemoteOptimizer(model, "127.0.0.1:50051")   # instead of torch.optim.SGD(...)
    for inputs, targets in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step(loss=loss)   # loss= for the server's loss metrics; step() works too
    optimizer.close()

`RemoteModel` is the same with the commit's figures returned (`remote.step(loss=...)`).
`LocalSteps(model, torch.optim.AdamW(...), address)` keeps the user's own optimizer for local
steps and commits their update (gemps.pytorch.local_steps): the path for models that need Adam.

What travels, for any torch.nn.Module (gemps.pytorch.values):
- the parameters that train (`requires_grad=True`), in `named_parameters()` order, are the
  central variable; a parameter without a gradient this step contributes zeros. Frozen
  parameters (`requires_grad=False`, e.g. a pretrained backbone) are not sent at all: every
  worker keeps its own copy, so load the same weights into every worker's model. Any floating
  dtype travels as float32 and is loaded back in the parameter's own (bfloat16 stays bfloat16);
  sparse gradients (`nn.Embedding(sparse=True)`) are made dense; a tensor tied or shared under
  several names travels once, under all of them (gemps.tied_names);
- the persistent buffers (those in `state_dict()`: batch-norm running mean and variance and
  `num_batches_tracked`, ...) live on the server too. Each commit carries how the worker's
  buffers changed since it last loaded the central ones, the server adds that change to its
  buffers (as DOWNPOUR adds updates), and every reply brings the central buffers back. With one
  worker this is exactly local training; with many, the running statistics see every worker's
  batches. Integer buffers (`num_batches_tracked`) travel and are kept as int64, exactly; the
  others as float32. A model without buffers sends nothing more than before.

θ is loaded into the parameters in place (each keeps its device, storage and dtype), through a
pinned staging vector and non-blocking copies when a parameter lives on a GPU.

A step without `num_samples=` sends the samples of the model's inputs since the last step, and
one without `loss=` sends the loss the model's forward returned (output.loss, or nanoGPT's
`(logits, loss)`), else logs a WARNING once saying how to pass it (gemps.pytorch.batches).
`weight_decay=` is applied by the worker, to the gradient it commits (under `--rule adamw`, which
applies AdamW's own, it is refused: gemps.pytorch.refusals).
Binding a model sets torch's intra-op threads so that the workers of one machine do not
oversubscribe its cores, unless they were set otherwise (`threads=`, gemps.pytorch.threads).

A model wrapped by torch.compile, DistributedDataParallel or DataParallel is named as the model
inside (gemps.pytorch.wrappers: no `_orig_mod.` or `module.` reaches the server; FSDP is refused), and
the ranks of a DDP process group are one gemps worker: group rank 0 commits, every rank loads its
reply (gemps.pytorch.groups).

So `gemps export` and `client.pull().state_dict()` give a state dict that loads with
`model.load_state_dict(..., strict=True)` when the model has no frozen parameters.

Its modules, each of one job: `remote` (RemoteModel, load_central), `optimizer` (RemoteOptimizer),
`local_steps` (LocalSteps), `beta1_ramp` (Adam's β1 raised over a run's first steps), `overlap`
(one commit in flight), `values` (a model's values as the wire carries them), `batches` (the
samples a step counts, the warning without a loss), `threads` (torch's intra-op threads),
`schedules` (the learning rate the server owns), `trainer_arguments` (a Hugging Face Trainer's
arguments that do not train, said once), `refusals` (a torch optimizer's arguments refused, each
naming where gemps sets it), `wrappers` (the model inside torch.compile's and DDP's wrappers),
`groups` (a process group as one gemps worker).
"""

from __future__ import annotations

try:  # the torch layer converts tensors through numpy: both come with the torch extra
    import numpy  # noqa: F401
    import torch  # noqa: F401  (the guard: remote.py and the others use it)
except ImportError as missing:
    raise ImportError(
        f"gemps.pytorch needs the torch extra ({missing.name} is not installed): pip install 'gemps[torch]' "
        "(on a machine without a GPU, install torch from its CPU index first: docs/guides/install.md)",
        name=missing.name,
    ) from missing

from gemps.pytorch.beta1_ramp import Beta1Ramp
from gemps.pytorch.groups import GroupLeaderError
from gemps.pytorch.local_steps import LocalSteps
from gemps.pytorch.optimizer import RemoteOptimizer
from gemps.pytorch.overlap import InFlightCommitError
from gemps.pytorch.remote import RemoteModel, load_central
from gemps.pytorch.schedules import ServerOwnsLearningRateError, ServerSchedule
from gemps.pytorch.values import persistent_buffers, trained_parameters

__all__ = [
    "Beta1Ramp",
    "GroupLeaderError",
    "InFlightCommitError",
    "LocalSteps",
    "RemoteModel",
    "RemoteOptimizer",
    "ServerOwnsLearningRateError",
    "ServerSchedule",
    "load_central",
    "persistent_buffers",
    "trained_parameters",
]
