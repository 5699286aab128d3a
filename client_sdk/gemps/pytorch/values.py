"""A torch model's values as the wire carries them: which tensors travel, under which names, and
their conversion to and from float32 (int64 for integer buffers).

- Any floating dtype torch trains in (float32, float16, bfloat16, float64) travels as float32 and
  is loaded back in the parameter's own dtype: the central variable is float32 (DESIGN §2), so a
  bfloat16 parameter holds θ rounded to bfloat16 after each load.
- Sparse gradients (`nn.Embedding(sparse=True)`) are made dense before they are sent: the server
  applies a dense vector (a row no batch touched contributes zeros, as a dense gradient would).
- A tensor `state_dict()` lists under several names (a head tied to the embedding) travels once,
  under the names joined by `=` (gemps.tied_names).
- What cannot travel (complex or integer parameters, sparse parameters) is refused when the model
  is bound, with InvalidArgumentError naming the parameter and what to do.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import TypeVar

import numpy as np
import torch

from gemps.errors import InvalidArgumentError
from gemps.records import Buffers, CentralVariable
from gemps.tied_names import SEPARATOR, joined
from gemps_proto.reasons import Reason

T = TypeVar("T", bound=torch.Tensor)


def trained_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters that make up the central variable, in order: those that require grad, each
    once, named by every name `state_dict()` has for it (joined by `=` when tied or shared)."""
    return [(name, p) for name, p in _named_once(model.named_parameters(remove_duplicate=False)) if p.requires_grad]


def persistent_buffers(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The buffers that travel: those `state_dict()` holds, in `named_buffers()` order (each once)."""
    kept = set(model.state_dict().keys())
    listed = ((name, b) for name, b in model.named_buffers(remove_duplicate=False) if name in kept)
    return _named_once(listed)


def _named_once(named: Iterable[tuple[str, T]]) -> list[tuple[str, T]]:
    """Each tensor once, at its first name's place, under all its names."""
    names: dict[int, list[str]] = {}
    tensors: dict[int, T] = {}
    for name, tensor in named:
        if SEPARATOR in name:
            raise InvalidArgumentError(
                f"the model names a tensor {name!r}: gemps joins a tied tensor's names with {SEPARATOR!r}, "
                "so a name may not hold one (rename the module or attribute)",
                InvalidArgumentError.code,
                Reason.BAD_SPEC,
            )
        names.setdefault(id(tensor), []).append(name)
        tensors.setdefault(id(tensor), tensor)
    return [(joined(names[key]), tensors[key]) for key in names]


def check_trainable(named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """InvalidArgumentError naming the first parameter whose values cannot travel as float32."""
    for name, parameter in named:
        problem = ""
        if parameter.layout != torch.strided:
            problem = f"is a {parameter.layout} tensor: keep the parameter dense (sparse gradients are fine)"
        elif parameter.is_complex():
            problem = "is complex: gemps' central variable is real (train torch.view_as_real(...) of it)"
        elif not parameter.is_floating_point():
            problem = "is not floating point: only floating parameters train (set requires_grad=False)"
        if problem:
            raise InvalidArgumentError(
                f"parameter {name!r} ({parameter.dtype}) {problem}", InvalidArgumentError.code, Reason.BAD_DTYPE
            )


def wire_dtype(buffer: torch.Tensor) -> torch.dtype:
    """How a buffer travels: floating ones as float32, integer (and boolean) ones as int64."""
    return torch.float32 if buffer.is_floating_point() or buffer.is_complex() else torch.int64


def host_array(tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> np.ndarray:
    """A copy of `tensor` on the CPU in `dtype` (float32 or int64), as numpy: numpy has no
    bfloat16, so the conversion happens in torch."""
    values = tensor.detach()
    return (values.to_dense() if values.layout != torch.strided else values).to("cpu", dtype).numpy()


def flat(tensors: Iterable[torch.Tensor], dtype: torch.dtype = torch.float32) -> np.ndarray:
    parts = [t.detach().reshape(-1).to("cpu", dtype) for t in tensors]
    return torch.cat(parts).numpy() if parts else torch.empty(0, dtype=dtype).numpy()


def buffer_values(buffers: Sequence[tuple[str, torch.Tensor]]) -> Buffers:
    """The model's buffers by kind, each flat in order (as the client splits them)."""
    tensors = [b for _, b in buffers]
    return Buffers(
        flat((b for b in tensors if wire_dtype(b) == torch.float32), torch.float32),
        flat((b for b in tensors if wire_dtype(b) == torch.int64), torch.int64),
    )


def gather_gradients(parameters: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """Each parameter's gradient into its range of the float32 vector `out` (zeros where there is
    none), converted from its dtype and made dense when sparse. Non-blocking: a GPU's copies into
    pinned memory are done once the caller synchronises its devices."""
    offset = 0
    for p in parameters:
        n = p.numel()
        if p.grad is None:
            out[offset : offset + n].zero_()
        else:
            grad = p.grad.detach()
            grad = grad.to_dense() if grad.layout != torch.strided else grad  # duplicates of a row add up
            out[offset : offset + n].copy_(grad.reshape(-1), non_blocking=True)
        offset += n


def gather_values(parameters: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Each parameter's values into its range of the float32 CPU vector `out`, converted from its
    dtype and device (a blocking copy: `out` holds them on return); `out` returned."""
    offset = 0
    for p in parameters:
        n = p.numel()
        out[offset : offset + n].copy_(p.detach().reshape(-1))
        offset += n
    return out


def host_tensor(values: np.ndarray) -> torch.Tensor:
    """A CPU tensor sharing `values`' memory, to read from (a reply's θ is read-only, which
    torch.from_numpy warns about: nothing writes through this tensor)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(values)


def copy_into(parameters: Sequence[torch.Tensor], source: torch.Tensor) -> None:
    """Each parameter's range of the flat `source`, copied into the parameter itself: its device,
    storage and dtype stay as they are (vector_to_parameters would swap in views of `source`,
    moving a CUDA model's parameters to the CPU). Non-blocking: from pinned memory the copies to a
    GPU overlap, and the stream orders them before any kernel that reads the parameters."""
    offset = 0
    for parameter in parameters:
        count = parameter.numel()
        parameter.copy_(source[offset : offset + count].view_as(parameter), non_blocking=True)
        offset += count


def load_buffers(buffers: Iterable[tuple[str, torch.Tensor]], central: CentralVariable) -> None:
    """Copy the central buffers into `buffers` (the model's persistent ones, by spec name)."""
    named = dict(buffers)
    for name, values in central.named_buffers().items():
        buffer = named[name]  # integer ones arrive as int64: exact
        buffer.copy_(host_tensor(values).reshape(buffer.shape))
