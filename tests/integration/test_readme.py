"""Every ```python block of README.md and of the documentation's pages (docs/index.md,
docs/getting-started.md, docs/guides/*.md) runs as written, against a real server (in this
process, port 0).

What the pages leave to the reader (`my_batches`, `MyResNet`, `grad_w`, ...) comes from a small
namespace; the block's "127.0.0.1:50051" becomes the server's address. Each block gets a fresh
server, since θ's shape differs between blocks, and runs in a folder of its own. A block is checked
by the one entry of CHECKS whose marker it contains: a new block without one fails, so none is
skipped silently; a block that reads a file the pages say another command wrote (the demo's
`runs/demo/model.npz`) has it written first by that command's own code (PREPARE). A block right
below a ```bash block of `gemps server FLAGS` runs against a server of those flags, parsed by the
command's own parser (its ports 0).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gemps_cli.server import parse_config
from torch import nn

from gemps.client import Client
from gemps.records import ServerStatus
from tests.integration.conftest import StartServer

ROOT = Path(__file__).resolve().parents[2]
# The pages whose ```python blocks run: the README and the site's pages meant to be followed.
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "docs" / "index.md",
        ROOT / "docs" / "getting-started.md",
        *(ROOT / "docs" / "guides").glob("*.md"),
    ]
)
README_ADDRESS = "127.0.0.1:50051"
FEATURES, CLASSES = 64, 10  # the README's Linear(64, 10)
BATCHES, BATCH_SIZE = 3, 8
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
# A `gemps server` command in the ```bash block just above a block (nothing but blank lines between)
SERVER_ABOVE = re.compile(r"^```bash\n\.venv/bin/gemps server (?P<flags>[^`]*?)\n```\s*\Z", re.MULTILINE)


@dataclass(frozen=True)
class Block:
    page: str  # the page's path from the repository's root
    line: int  # the page's line just before the code (the fence), so line numbers in tracebacks match
    code: str
    server: tuple[str, ...] = ()  # the flags of the `gemps server` command right above it, if any

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def python_blocks(text: str, page: str = "README.md") -> list[Block]:
    return [
        Block(page, text.count("\n", 0, match.start()) + 1, match.group(1), server_above(text[: match.start()]))
        for match in BLOCK.finditer(text)
    ]


def server_above(text: str) -> tuple[str, ...]:
    """The flags of the `gemps server` command a page's text ends with, in a ```bash block (else ())."""
    command = SERVER_ABOVE.search(text)
    return tuple(shlex.split(command["flags"].replace("\\\n", " "))) if command else ()


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


def my_transformer() -> nn.Module:
    """Stands in for the SDK page's `MyTransformer()`: matrices, and vectors AdamW's decay leaves (a
    bias, a layer norm's gain and shift)."""
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, CLASSES))


def my_resnet() -> nn.Module:
    """Stands in for the README's `MyResNet()`: small, with batch norm (buffers the server keeps)."""
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES))


def namespace(batches: Batches) -> dict[str, Any]:
    """What the README's blocks take as given."""
    return {
        "__name__": "readme",
        "my_batches": batches,
        "MyResNet": my_resnet,
        "MyTransformer": my_transformer,
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


def readme_optimizer(ran: Ran) -> None:
    """The README's short loop: one commit per batch with the loss, then it left."""
    trained_one_commit_per_batch(ran)
    assert ran.status.recent.loss_commits == BATCHES  # step(loss=loss) reported each loss


def remote_optimizer(ran: Ran) -> None:
    trained_one_commit_per_batch(ran)
    assert ran.status.buffer_spec  # the batch norm's statistics live on the server too


def server_adamw(ran: Ran) -> None:
    """The page's `gemps server --rule adamw ...` and its loop: one worker, so every gradient closes
    its round, and AdamW's step moved θ each time; the model holds θ as the server does."""
    trained_one_commit_per_batch(ran)
    config = ran.namespace["optimizer"].remote.registration.config
    assert (config.rule, config.rule_options["backup_workers"]) == ("adamw", 1)  # the command's flags
    model = ran.namespace["model"]
    with Client(ran.target) as client:
        central = client.pull().named()
    assert set(central) == set(model.state_dict())
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(tensor.numpy(), central[name])
    assert ran.namespace["optimizer"].last_result.scaling_mean == 1.0  # taken, not dropped


def remote_model(ran: Ran) -> None:
    trained_one_commit_per_batch(ran)
    index, count = ran.namespace["shard"]  # "(index, count) assigned by the server"
    assert (index, count) == (0, 0) == ran.batches.shards[0]  # the only worker; num_shards 0: all the data


def local_steps(ran: Ran) -> None:
    """The SDK page's LocalSteps with its defaults, the recipe: a window of 1 local step per batch,
    each committed, the last one's result read from `last_result`."""
    assert ran.status.version == 3 and ran.status.active_workers == 0
    assert ran.namespace["optimizer"].last_result.version == 3


def client(ran: Ran) -> None:
    assert ran.namespace["result"].version == 1
    assert ran.status.version == 2  # the gradient, then the update
    assert ran.status.num_parameters == CLASSES * FEATURES + CLASSES
    assert ran.status.active_workers == 0


def async_client(ran: Ran) -> None:
    assert ran.namespace["result"].version == ran.status.version == 3  # one commit per step, in order
    assert ran.status.active_workers == 0


def sdk_alone(ran: Ran) -> None:
    """The SDK page's client without numpy's arrays: lists and array.array in, θ back by name."""
    assert ran.namespace["result"].version == ran.status.version == 1
    assert ran.status.num_parameters == 8
    assert len(ran.namespace["theta"].tolist()) == 6 and ran.status.active_workers == 0


def demo_model(ran: Ran) -> None:
    """Getting started's loading of the demo's model.npz: every name loaded, the version read."""
    assert ran.namespace["version"] == 0  # the checkpoint PREPARE wrote: θ as registered
    model = ran.namespace["model"]
    assert set(ran.namespace["state"]) == set(model.state_dict())
    assert 0.0 <= ran.namespace["accuracy"] <= 1.0
    assert ran.status.version == 0  # it read a file: nothing was committed


def options(ran: Ran) -> None:
    config = ran.namespace["config"]
    assert (config.server, config.epochs) == (ran.target, 1)  # the defaults: no flags, no GEMPS_* variables
    assert not ran.status.initialized  # it only parses options


def write_demo_model(target: str) -> None:
    """`runs/demo/model.npz` in the current folder, written by the demo's own writer from θ as a
    real server holds it once the demo's model registered (version 0)."""
    from gemps_worker.datasets import load_dataset
    from gemps_worker.demo import _save_checkpoint
    from gemps_worker.models import build_model

    data = load_dataset("digits")
    model = build_model("digits-cnn", data.input_shape, data.num_classes)
    with Client(target) as client:
        client.register({name: tensor.detach().numpy() for name, tensor in model.state_dict().items()})
        central = client.pull()
    Path("runs/demo").mkdir(parents=True)
    _save_checkpoint(Path("runs/demo/model.npz"), central)


# marker in the block -> what must hold after it ran
CHECKS: dict[str, Callable[[Ran], None]] = {
    "optimizer.step(loss=loss)": readme_optimizer,
    "MyResNet()": remote_optimizer,
    "MyTransformer()": server_adamw,
    "RemoteModel(": remote_model,
    "LocalSteps(": local_steps,
    "gemps.Client(": client,
    "options.add_arguments(": options,
    "AsyncClient(": async_client,
    "array.array(": sdk_alone,
    "runs/demo/model.npz": demo_model,
}
# marker -> what must exist before the block runs (given the server's address), in the block's folder
PREPARE: dict[str, Callable[[str], None]] = {"runs/demo/model.npz": write_demo_model}
BLOCKS = [block for page in PAGES for block in python_blocks(page.read_text(), str(page.relative_to(ROOT)))]


def check_of(block: Block) -> Callable[[Ran], None]:
    found = [check for marker, check in CHECKS.items() if marker in block.code]
    assert len(found) == 1, f"{block.name}: give this block exactly one entry in CHECKS ({len(found)} match)"
    return found[0]


def test_every_check_has_its_block() -> None:
    for marker in CHECKS:
        assert sum(marker in block.code for block in BLOCKS) == 1, f"{marker!r}: not in exactly one block"
    assert set(PREPARE) <= set(CHECKS)


def test_the_pages_are_read() -> None:
    """The README and the pages the site is built from, each found (a moved page fails here, not silently)."""
    names = {str(page.relative_to(ROOT)) for page in PAGES}
    assert {"README.md", "docs/index.md", "docs/getting-started.md", "docs/guides/sdk.md"} <= names
    assert {block.page for block in BLOCKS} >= {"README.md", "docs/getting-started.md", "docs/guides/sdk.md"}


def test_a_server_command_right_above_a_block_is_read() -> None:
    command = "```bash\n.venv/bin/gemps server --rule adamw \\\n    --learning-rate 3e-3\n```\n"
    page = f"Run:\n\n{command}\n```python\nx = 1\n```\n"
    assert python_blocks(page)[0].server == ("--rule", "adamw", "--learning-rate", "3e-3")
    assert python_blocks(page.replace("```\n\n```python", "```\n\nThen:\n\n```python"))[0].server == ()


@pytest.mark.parametrize("block", BLOCKS, ids=lambda block: block.name)
def test_readme_block_runs(
    block: Block, start_server: StartServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    check = check_of(block)
    ports = ("--host", "127.0.0.1", "--port", "0", "--metrics-port", "0", "--data-port", "0")
    server = start_server(config=parse_config([*block.server, *ports])) if block.server else start_server()
    monkeypatch.setattr(sys, "argv", ["readme"])  # a block's parse_args() reads sys.argv, pytest's here
    for name in [name for name in os.environ if name.startswith("GEMPS_")]:
        monkeypatch.delenv(name)  # and options.from_sources the environment
    monkeypatch.chdir(tmp_path)  # relative paths a block reads or writes stay in a folder of its own
    for marker, prepare in PREPARE.items():
        if marker in block.code:
            prepare(server.target)
    batches = Batches()
    globals_ = namespace(batches)
    code = "\n" * block.line + block.code.replace(README_ADDRESS, server.target)
    exec(compile(code, str(ROOT / block.page), "exec", dont_inherit=True), globals_)  # not this file's __future__
    with Client(server.target) as observer:
        status = observer.status()
    check(Ran(globals_, batches, status, server.target))
