"""scripts/adam_workers.py's reference and figures without a run (tests/e2e/test_adam_workers.py runs
it): DDP's global batch is every rank's own mini-batch together, the loss at the middle is read
between snapshots, and a DDP reference judges losses only, not times."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from gemps_worker.nanogpt import BATCH, SHAPES, char_gpt, shard_batches
from tests.script_modules import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "adam_workers.py"


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script(SCRIPT, "adam_workers")


@pytest.mark.parametrize(("shape", "seed"), [("project", 0), ("user", 0), ("project", 2)])
def test_ddps_batch_is_every_ranks_own_batch_together(script: ModuleType, shape: str, seed: int) -> None:
    """At every --seed: the workers' shards of that seed, together (seed 2 is another split)."""
    inputs = np.arange(800 * 3, dtype=np.int64).reshape(800, 3)
    targets = inputs + 1
    world, batch = 4, SHAPES[shape].batch
    together = list(itertools.islice(script.ddp_batches(inputs, targets, world, batch, seed), 3))
    ranks = [
        list(itertools.islice(shard_batches(inputs, targets, rank, world, seed, batch), 3)) for rank in range(world)
    ]
    if seed:
        assert not torch.equal(together[0][0], next(script.ddp_batches(inputs, targets, world, batch))[0])
    assert batch == {"project": BATCH, "user": 32}[shape]
    for step, (x, y) in enumerate(together):
        assert x.shape == (world * batch, 3)
        assert torch.equal(x, torch.cat([ranks[rank][step][0] for rank in range(world)]))
        assert torch.equal(y, torch.cat([ranks[rank][step][1] for rank in range(world)]))


def test_the_loss_at_given_samples_lies_between_the_snapshots_either_side(script: ModuleType) -> None:
    curve = [[1.0, 0, 4.0], [2.0, 100, 3.0], [3.0, 300, 2.0]]
    assert script.loss_at(curve, 100) == 3.0
    assert script.loss_at(curve, 200) == 2.5
    assert script.loss_at(curve, 400) is None


def test_a_ddp_reference_is_held_to_losses_at_the_end_and_the_middle_and_not_to_times(script: ModuleType) -> None:
    ddp = [[10.0, 0, 4.0], [20.0, 100, 3.0], [30.0, 200, 2.0]]
    gemps = {1.0: [[5.0, 0, 4.0], [8.0, 100, 3.3], [12.0, 200, 2.1]]}
    summary = script.summary("ddp", ddp, gemps)["gemps x1"]
    assert summary["loss_vs_ddp"] == pytest.approx(0.05)
    assert summary["middle_vs_ddp"] == pytest.approx(0.1)
    assert summary["sooner"] is None  # one process's times are not DDP's on 16 machines
    alone = script.summary("alone", ddp, {1.0: [[5.0, 0, 4.0], [8.0, 100, 2.5], [12.0, 200, 1.9]]})["gemps x1"]
    assert alone["loss_vs_alone"] == pytest.approx(-0.05) and alone["sooner"] == pytest.approx(30 / 12)


@pytest.mark.parametrize("shape", ["project", "user"])
def test_the_ddp_reference_steps_on_every_ranks_batch_and_counts_their_samples(tmp_path: Path, shape: str) -> None:
    """The reference's own process (`--role ddp`, as the script launches it): 4 steps of 4 ranks'
    batches (256 samples at the project's batch of 16, 512 at the user's 32), its last snapshot says
    so, and it says it is done."""
    (tmp_path / "go").touch()
    samples = 4 * 4 * SHAPES[shape].batch
    argv = [sys.executable, str(SCRIPT), "--role", "ddp", "--rank", "0", "--world", "4", "--samples", str(samples),
            "--folder", str(tmp_path), "--warmup", "1", "--snapshot-every", "60", "--shape", shape]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    snapshots = sorted(tmp_path.glob("snapshot-*.npy"))
    assert [path.stem.split("-")[2] for path in snapshots] == [str(samples)]
    assert np.load(snapshots[0]).size == sum(p.numel() for p in char_gpt(0, SHAPES[shape]).parameters())
    assert (tmp_path / "done-ddp-0").exists() and (tmp_path / "ready-ddp-0").exists()


def test_each_seed_starts_its_processes_from_its_own_model(tmp_path: Path) -> None:
    """`--seed` reaches a process the script launches: after one step of the DDP reference, the
    snapshot at seed 1 lies next to seed 1's model and far from seed 0's run."""
    snapshots = []
    for seed in (0, 1):
        folder = tmp_path / str(seed)
        folder.mkdir()
        (folder / "go").touch()
        argv = [sys.executable, str(SCRIPT), "--role", "ddp", "--rank", "0", "--world", "1", "--samples", "16",
                "--folder", str(folder), "--warmup", "1", "--snapshot-every", "60", "--seed", str(seed)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
        snapshots.append(np.load(next(folder.glob("snapshot-*.npy"))))
    assert not np.array_equal(snapshots[0], snapshots[1])
    first = char_gpt(1, SHAPES["project"])
    moved = np.abs(snapshots[1] - torch.nn.utils.parameters_to_vector(first.parameters()).detach().numpy())
    assert moved.max() < 0.01  # one AdamW step at warm-up's rate from seed 1's model, not from seed 0's
    assert moved.max() < 0.1 * np.abs(snapshots[0] - snapshots[1]).max()


@pytest.mark.parametrize(
    ("arguments", "said"),
    [
        (["--reference-learning-rate=-3e-3"], "give a rate above 0"),
        (["--reference", "ddp", "--reference-learning-rate", "0"], "give a rate above 0"),
        (["--reference", "ddp", "--reference-warmup", "-1"], "give 0 or more steps"),
        (["--beta1", "1"], "lies in [0, 1)"),
        (["--beta1-to", "1"], "--beta1-to is 1: AdamW's β1 lies in [0, 1)"),
        (["--beta1-to", "0.95", "--beta1-ramp", "0"], "--beta1-ramp is 0: a share of the steps"),
        (["--beta1-ramp", "0.5"], "--beta1-ramp 0.5 without --beta1-to"),
        (["--rule", "adamw", "--beta1-to", "0.95"], "under --rule adamw they commit gradients"),
        (["--rule", "adamw", "--round-momentum"], "--round-momentum is for rounds of windows"),
        (["--seed", "-1"], "--seed is -1: give 0 or more"),
        (["--server-option", "kappa"], "takes NAME=VALUE"),
    ],
)
def test_settings_it_cannot_use_as_meant_are_refused_naming_them(arguments: list[str], said: str) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), *arguments], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and said in done.stderr, done.stderr
