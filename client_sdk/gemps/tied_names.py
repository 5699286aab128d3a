"""Tied and shared tensors' names: one spec entry that `state_dict()` lists under several names.

A torch model whose output head is tied to its embedding (`head.weight = emb.weight`) holds one
tensor that `state_dict()` lists twice, as `emb.weight` and `head.weight`; `named_parameters()`
names it once. gemps.pytorch registers such a tensor once, as one spec entry whose name joins
every name it goes by with `=` (`emb.weight=head.weight`, in the order `state_dict()` lists them):
the server keeps it as any other name (in its state, its checkpoints and Status), and whatever
turns the central variable into a state dict (`CentralVariable.state_dict()`, `gemps export`)
gives its values under each name, so that `load_state_dict(strict=True)` finds them all.

So a name registered through the plain Client with `=` in it is read the same way (torch never
names a parameter or buffer with `=`: gemps.pytorch refuses a model whose names have one).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

SEPARATOR = "="

Value = TypeVar("Value")


def joined(names: Sequence[str]) -> str:
    """One spec name for a tensor that goes by `names` (at least one)."""
    if not names:
        raise ValueError("a tensor has at least one name")
    return SEPARATOR.join(names)


def aliases(name: str) -> list[str]:
    """Every name a spec entry's tensor goes by (one, unless it is tied or shared)."""
    return name.split(SEPARATOR)


def expanded(named: Mapping[str, Value]) -> dict[str, Value]:
    """`named` with each tied or shared entry's value under every name it goes by (the same value,
    not a copy), in order."""
    return {alias: value for name, value in named.items() for alias in aliases(name)}
