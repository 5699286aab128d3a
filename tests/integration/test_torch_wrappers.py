"""Wrapped torch models through RemoteOptimizer against a real server (issue 50, items 1 and 2):
torch.compile's and DDP's prefixes never reach the server, and the ranks of a DDP process group
are one gemps worker."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

import gemps
from gemps.pytorch import RemoteOptimizer
from tests.helpers import InProcessServer, free_port, gemps_export, scrape
from tests.integration.conftest import StartServer


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def test_a_compiled_worker_and_a_plain_one_share_a_server_and_the_export_loads_unwrapped(
    start_server: StartServer, tmp_path: Path
) -> None:
    """f264f8e registered the compiled model's names as `_orig_mod.*`: the plain worker beside it
    was refused (FAILED_PRECONDITION) and the export carried the prefix. The eager backend keeps
    the test fast: the wrapper, and its names, are torch.compile's whatever the backend."""
    server = start_server(rule="downpour", learning_rate=0.05)
    plain, compiled_inner = net(), net()
    compiled = torch.compile(compiled_inner, backend="eager")
    assert isinstance(compiled, nn.Module)
    assert next(iter(dict(compiled.named_parameters()))).startswith("_orig_mod.")
    inputs = torch.randn(16, 4)
    targets = inputs.sum(dim=1, keepdim=True)
    with RemoteOptimizer(compiled, server.target) as first, RemoteOptimizer(plain, server.target) as second:
        assert [entry.name for entry in first.remote.client.spec] == list(dict(plain.named_parameters()))
        for _ in range(3):
            for model, optimizer in ((compiled, first), (plain, second)):
                optimizer.zero_grad()
                loss = F.mse_loss(model(inputs), targets)
                loss.backward()
                optimizer.step(loss=loss)
        assert second.version == 6
        # The compiled model's forwards are counted (the hook is on the module the user calls).
        assert scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")["gemps_training_samples_total"] == 6 * 16
        first.remote.pull()
        state = {name: value.clone() for name, value in compiled_inner.state_dict().items()}
        exported = gemps_export("--server", server.target, out=tmp_path / "model.safetensors")
        assert exported.returncode == 0, exported.stderr
    fresh = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    fresh.load_state_dict(load_file(str(tmp_path / "model.safetensors")), strict=True)
    for name, value in fresh.state_dict().items():
        torch.testing.assert_close(value, state[name], msg=name)


def ddp_ranks(target: str, tmp_path: Path, *options: str, world: int = 2) -> list[dict[str, Any]]:
    """Each rank of a gloo group in a process of its own (tests/ddp_worker.py); their records."""
    port = free_port()
    outs = [tmp_path / f"rank{rank}.json" for rank in range(world)]
    command = [sys.executable, "-m", "tests.ddp_worker", "--world", str(world), "--port", str(port), "--target", target]
    ranks = [
        subprocess.Popen(
            [*command, "--rank", str(rank), "--out", str(out), *options],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank, out in enumerate(outs)
    ]
    for rank in ranks:
        output, _ = rank.communicate(timeout=120)
        assert rank.returncode == 0, output
    return [json.loads(out.read_text()) for out in outs]


def test_a_ddp_group_overlaps_its_commits_as_one_worker(start_server: StartServer, tmp_path: Path) -> None:
    """Overlap (issue 59, item 3) in a process group: rank 0's commit in flight, every rank loading
    its reply at the next step; each commit applied once, and both ranks end on the server's θ."""
    server = start_server(rule="downpour", learning_rate=1.0)
    records = ddp_ranks(server.target, tmp_path, "--steps", "4", "--overlap")
    for record in records:
        # the model holds the θ of the commit before: none at the first step, then 1, 2, 3
        assert [step["version"] for step in record["steps"]] == [0, 1, 2, 3]
        assert "failed" not in record
    assert records[0]["steps"] == records[1]["steps"] and records[0]["flushed"] == records[1]["flushed"]
    with gemps.Client(server.target) as observer:
        status = observer.status()
        assert status.version == status.commits_applied == 4
        torch.testing.assert_close(torch.from_numpy(observer.pull().flat.copy()), torch.tensor(records[0]["flushed"]))


def test_a_ddp_group_sends_the_step_after_a_refusal_in_flight_on_every_rank(
    start_server: StartServer, tmp_path: Path
) -> None:
    """Issue 77 item 3 in a process group: step 2's NaN commit is refused in flight; step 3 raises
    that on every rank (the leader's error, GroupLeaderError's on rank 1), each naming both steps,
    and step 3's gradients are sent all the same: both ranks load its reply."""
    server = start_server(rule="downpour", learning_rate=1.0)
    leader, other = ddp_ranks(server.target, tmp_path, "--steps", "4", "--overlap", "--poison-step", "1")
    named = "step 2's commit (its gradients computed at version 0) failed: "
    assert leader["failed"].startswith(f"InFlightInvalidArgumentError: {named}payload contains NaN or Inf")
    assert other["failed"].startswith(f"InFlightGroupLeaderError: {named}the gemps worker's leader (group rank 0)")
    for record in (leader, other):
        assert record["failed"].endswith("step 3's gradients (computed at version 1) were sent after it all the same")
        assert [step["version"] for step in record["steps"]] == [0, 1]  # steps 1 and 2; step 3 raised
    assert leader["flushed"] == other["flushed"]
    with gemps.Client(server.target) as observer:
        assert observer.status().commits_applied == 2  # steps 1 and 3
        torch.testing.assert_close(torch.from_numpy(observer.pull().flat.copy()), torch.tensor(leader["flushed"]))


@pytest.mark.parametrize("given", ["ddp", "inner"])
def test_a_ddp_group_is_one_worker_whose_all_reduced_gradient_is_applied_once(
    start_server: StartServer, tmp_path: Path, given: str
) -> None:
    """f264f8e: each rank registered as its own worker and committed the same all-reduced gradient,
    so θ moved by -2 per step under downpour with η = 1, under names prefixed `module.`. Given the
    DDP wrapper, its group; given the model inside, the initialised default group."""
    server = start_server(rule="downpour", learning_rate=1.0)
    records = ddp_ranks(server.target, tmp_path, "--steps", "3", "--given", given)
    for record in records:
        assert record["registered_version"] == 0
        assert [step["version"] for step in record["steps"]] == [1, 2, 3]
        assert record["learning_rate"] == 1.0
        for step in record["steps"]:
            # Rank r's 2 rows are all r + 1: the all-reduced (mean) weight gradient is (2 + 4) / 2, the bias 2.
            assert step["gradient"] == [3.0, 3.0, 3.0, 2.0]
            moved = [before - gradient for before, gradient in zip(step["before"], step["gradient"], strict=True)]
            assert step["after"] == pytest.approx(moved)  # -η·g with η = 1: once
    assert records[0]["steps"] == records[1]["steps"]  # the same θ on both ranks, before and after each step
    assert records[0]["names"] == ["weight", "bias"]
    assert "rank 1 does not talk to the gemps server" in records[1]["client"]
    with gemps.Client(server.target) as observer:
        status = observer.status()
        assert status.version == status.commits_applied == 3
        torch.testing.assert_close(
            torch.from_numpy(observer.pull().flat.copy()), torch.tensor(records[0]["steps"][-1]["after"])
        )
    metrics = scrape(f"http://127.0.0.1:{server.metrics_port}/metrics")
    assert metrics["gemps_training_samples_total"] == 3 * 2 * 2  # each step: both ranks' 2 rows


def test_an_fsdp_model_is_refused_with_what_to_do(server: InProcessServer, tmp_path: Path) -> None:
    records = ddp_ranks(server.target, tmp_path, "--fsdp")
    for record in records:
        assert record["refused"].startswith("InvalidArgumentError: gemps cannot train an FSDP model")
        assert "Wrap the model in DistributedDataParallel" in record["refused"]


def test_the_leaders_failure_is_raised_on_every_rank(start_server: StartServer, tmp_path: Path) -> None:
    """A refused commit (a NaN gradient, which the client refuses) on group rank 0 does not leave
    rank 1 waiting for a broadcast: it raises GroupLeaderError with the leader's error, after the
    steps before it applied."""
    server = start_server(rule="downpour", learning_rate=1.0)
    leader, other = ddp_ranks(server.target, tmp_path, "--steps", "2", "--poison")
    assert leader["failed"] == "InvalidArgumentError: payload contains NaN or Inf: not sent"
    assert other["failed"].startswith("GroupLeaderError: the gemps worker's leader (group rank 0) failed: ")
    assert leader["failed"].split(": ", 1)[1] in other["failed"]
    assert [len(record["steps"]) for record in (leader, other)] == [1, 1]
    with gemps.Client(server.target) as observer:
        assert observer.status().commits_applied == 1


def test_process_group_none_makes_each_rank_its_own_worker(start_server: StartServer, tmp_path: Path) -> None:
    server = start_server(rule="downpour", learning_rate=1.0)
    records = ddp_ranks(server.target, tmp_path, "--steps", "2", "--given", "separate")
    assert all(record["names"] == ["weight", "bias"] for record in records)
    with gemps.Client(server.target) as observer:
        assert observer.status().commits_applied == 2 * 2  # each rank's two commits
