"""Every ```python block of README.md runs as written, against a real server (in this process, port 0).

What the README leaves to the reader (`my_batches`, `MyResNet`, `grad_w`, ...) comes from a small
namespace; the block's "127.0.0.1:50051" becomes the server's address. Each block gets a fresh
server, since θ's shape differs between blocks. A block is checked by the one entry of CHECKS whose
marker it contains: a new block without one fails, so none is skipped silently.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gemps.client import Client
from gemps.records import ServerStatus
from tests.integration.conftest import StartServer

README = Path(__file__).resolve().parents[2] / "README.md"
README_ADDRESS = "127.0.0.1:50051"
FEATURES, CLASSES = 64, 10  # the README's Linear(64, 10)
BATCHES, BATCH_SIZE = 3, 8
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Block:
    line: int  # README.md's line just before the code (the fence), so line numbers in tracebacks match
    code: str


def python_blocks(text: str) -> list[Block]:
    return [Block(text.count("\n", 0, match.start()) + 1, match.group(1)) for match in BLOCK.finditer(text)]


@dataclass
class Batches:
    """`my_batches(shard)`: a few (inputs, targets) mini-batches, unpacking the shard as the README
    describes it, `(index, count)`."""

    shards: list[tuple[int, int]] = field(default_factory=list)
    yielded: int = 0

    def __call__(self, shard: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        index, count = shard
        self.shards.append((index, count))
        generator = torch.Generator().manual_seed(index)
        for _ in range(BATCHES):
            self.yielded += 1
            inputs = torch.randn(BATCH_SIZE, FEATURES, generator=generator)
            yield inputs, torch.randint(CLASSES, (BATCH_SIZE,), generator=generator)


def my_resnet() -> nn.Module:
    """Stands in for the README's `MyResNet()`: small, with batch norm (buffers the server keeps)."""
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES))


def namespace(batches: Batches) -> dict[str, Any]:
    """What the README's blocks take as given."""
    return {
        "__name__": "readme",
        "my_batches": batches,
        "MyResNet": my_resnet,
        "grad_w": np.full((CLASSES, FEATURES), 0.1, np.float32),
        "grad_b": np.full(CLASSES, 0.1, np.float32),
        "update_vector": np.full(CLASSES * FEATURES + CLASSES, 0.01, np.float32),
    }


@dataclass(frozen=True)
class Ran:
    """One block after it ran: its globals, the batches it drew, and the server's status then."""

    namespace: dict[str, Any]
    batches: Batches
    status: ServerStatus
    target: str


def trained_one_commit_per_batch(ran: Ran) -> None:
    assert ran.batches.yielded == BATCHES
    assert ran.status.version == BATCHES
    assert ran.status.active_workers == 0  # it left the server


def remote_optimizer(ran: Ran) -> None:
    trained_one_commit_per_batch(ran)
    assert ran.status.buffer_spec  # the batch norm's statistics live on the server too


def remote_model(ran: Ran) -> None:
    trained_one_commit_per_batch(ran)
    index, count = ran.namespace["shard"]  # "(index, count) assigned by the server"
    assert (index, count) == (0, 0) == ran.batches.shards[0]  # the only worker; num_shards 0: all the data


def client(ran: Ran) -> None:
    assert ran.namespace["result"].version == 1
    assert ran.status.version == 2  # the gradient, then the update
    assert ran.status.num_parameters == CLASSES * FEATURES + CLASSES
    assert ran.status.active_workers == 0


def async_client(ran: Ran) -> None:
    assert ran.namespace["result"].version == ran.status.version == 3  # one commit per step, in order
    assert ran.status.active_workers == 0


def options(ran: Ran) -> None:
    config = ran.namespace["config"]
    assert (config.server, config.epochs) == (ran.target, 1)  # the defaults: no flags, no GEMPS_* variables
    assert not ran.status.initialized  # it only parses options


# marker in the block -> what must hold after it ran
CHECKS: dict[str, Callable[[Ran], None]] = {
    "RemoteOptimizer(": remote_optimizer,
    "RemoteModel(": remote_model,
    "gemps.Client(": client,
    "options.add_arguments(": options,
    "AsyncClient(": async_client,
}
BLOCKS = python_blocks(README.read_text())


def check_of(block: Block) -> Callable[[Ran], None]:
    found = [check for marker, check in CHECKS.items() if marker in block.code]
    assert len(found) == 1, f"README.md:{block.line}: give this block exactly one entry in CHECKS ({len(found)} match)"
    return found[0]


def test_every_check_has_its_block() -> None:
    for marker in CHECKS:
        assert sum(marker in block.code for block in BLOCKS) == 1, f"{marker!r}: not in exactly one README block"


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: f"README.md:{block.line}")
def test_readme_block_runs(block: Block, start_server: StartServer, monkeypatch: pytest.MonkeyPatch) -> None:
    check = check_of(block)
    server = start_server()
    monkeypatch.setattr(sys, "argv", ["readme"])  # a block's parse_args() reads sys.argv, pytest's here
    for name in [name for name in os.environ if name.startswith("GEMPS_")]:
        monkeypatch.delenv(name)  # and options.from_sources the environment
    batches = Batches()
    globals_ = namespace(batches)
    code = "\n" * block.line + block.code.replace(README_ADDRESS, server.target)
    exec(compile(code, str(README), "exec", dont_inherit=True), globals_)  # not this file's __future__
    with Client(server.target) as observer:
        status = observer.status()
    check(Ran(globals_, batches, status, server.target))
