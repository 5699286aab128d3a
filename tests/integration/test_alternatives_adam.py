"""The comparison's Adam path run for real (issue 78, item 3), each program as the rig starts it but
without the rig (no quota groups, loopback): DDP's program with nanoGPT's AdamW and torch's
bf16_compress_hook in a two-process gloo group, and gemps-adam's worker (LocalSteps around AdamW)
committing to a real `--rule downpour` server, whose θ must be the AdamW run's step for step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from gemps_bench.alternatives.contract import GO_FILE, local_optimizer, snapshot_times, worker_argv
from gemps_bench.alternatives.systems.ddp_program import bf16_on_gloo
from gemps_bench.alternatives.workloads import loss, workload
from torch._C._distributed_c10d import HashStore
from torch.nn.parallel import DistributedDataParallel

from gemps.client import Client
from gemps.pytorch import load_central
from tests.helpers import InProcessServer, free_port, wait_for

ROOT = Path(__file__).resolve().parents[2]
#: seconds each program trains (from its own start: imports and the group's rendezvous count)
DEADLINE_S = 6.0
#: chance on the digits' ten classes is 0.1
ABOVE_CHANCE = 0.3
#: steps each DDP rank takes before the run is ended (its first ~30 snapshots' worth at 0.5 s)
STEPS = 150


def steps_of(run_dir: Path, rank: int) -> list[dict[str, float]]:
    """Rank `rank`'s step lines so far (none before its log exists)."""
    log = run_dir / f"worker-{rank}.jsonl"
    lines = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [line for line in lines if line["event"] == "step"]


def test_ddp_with_adamw_and_the_bf16_hook_trains_the_digits_in_a_gloo_group(tmp_path: Path) -> None:
    """Two ddp_program processes as torchrun would start them (its environment), the gate open, ended
    as the harness ends a run, by SIGTERM (each rank's deadline is its own: the first to pass it
    would leave the other inside an all-reduce)."""
    (tmp_path / GO_FILE).touch()
    port = free_port()
    processes = []
    for rank in range(2):
        argv = worker_argv("gemps_bench.alternatives.systems.ddp_program", "digits", rank, 2, 0, 32, 2e-3, tmp_path,
                           300.0, 0.5, "adamw")  # fmt: skip
        environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1"}  # fmt: skip
        command = [sys.executable, *argv, "--comm-hook", "bf16"]
        processes.append(subprocess.Popen(command, cwd=ROOT, env=environment, stderr=subprocess.PIPE, text=True))
    try:

        def trained_or_ended() -> bool:
            trained = all(len(steps_of(tmp_path, rank)) >= STEPS for rank in range(2))
            return (trained and len(snapshot_times(tmp_path)) >= 2) or any(p.poll() is not None for p in processes)

        wait_for(trained_or_ended, timeout=120, what="both ranks' steps", tolerate=(json.JSONDecodeError,))
        alive = [process.poll() is None for process in processes]
    finally:
        for process in processes:
            process.terminate()
    errors = [process.communicate(timeout=60)[1] for process in processes]
    assert alive == [True, True], errors
    for rank in range(2):
        steps = steps_of(tmp_path, rank)
        assert steps[-1]["applied"] == steps[-1]["samples"] == 32 * len(steps), rank
    digits = workload("digits")
    model = digits.build_model()
    model.load_state_dict(torch.load(snapshot_times(tmp_path)[-1][1], weights_only=True))
    assert digits.evaluate(model)["accuracy"] > ABOVE_CHANCE


def test_the_bf16_hook_all_reduces_the_gradients_in_bfloat16_on_gloo() -> None:
    """Registered under DDP on a CPU gloo group (torch refuses bf16_compress_hook by its name without
    NCCL): every gradient the optimizer then sees is a bfloat16 value, which plain DDP's is not."""
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        gradients = []
        for hooked in (False, True):
            model = workload("digits").build_model()
            ddp = DistributedDataParallel(model)
            if hooked:
                ddp.register_comm_hook(None, bf16_on_gloo)
            inputs, targets = next(workload("digits").batches(0, 1, 0))
            loss(ddp, inputs, targets).backward()
            gradients.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    finally:
        dist.destroy_process_group()
    plain, compressed = gradients
    assert not torch.equal(plain, plain.bfloat16().float())
    assert torch.equal(compressed, compressed.bfloat16().float())
    assert torch.allclose(compressed, plain, rtol=1e-2, atol=1e-6)


def test_gemps_adam_commits_each_adamw_step_through_local_steps_to_a_downpour_server(tmp_path: Path) -> None:
    """One worker (no staleness, so LocalSteps starts each window at the reply): under downpour the
    server's θ after the run is one AdamW training's after as many steps, on the same batches, each
    step landed as the server lands it: θ + (θ_stepped - θ) in float32, which rounds a value off by
    up to an ulp from θ_stepped itself. Without that the two runs part by rounding alone, and AdamW's
    normalised steps grow the difference with the run's length, which the deadline makes the host's
    speed (1,267 steps on a fast host: 0.056 apart, 10 % of the move; 195 steps: 1.8e-7)."""
    (tmp_path / GO_FILE).touch()
    rate = 2e-3
    with InProcessServer(rule="downpour", learning_rate=0.05) as server:
        argv = worker_argv("gemps_bench.alternatives.systems.gemps_program", "digits", 0, 1, 0, 32, rate, tmp_path,
                           DEADLINE_S, 2.0, "adamw")  # fmt: skip
        command = [sys.executable, *argv, "--coordinator", server.target, "--mode", "local-steps"]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        with Client(server.target, name="observer") as observer:
            central = observer.pull()
    steps = steps_of(tmp_path, 0)
    assert len(steps) > 10 and steps[-1]["applied"] == steps[-1]["samples"] == 32 * len(steps)
    assert (tmp_path / "worker-0.jsonl").read_text().splitlines()[-1].count('"exit"') == 1  # at its deadline
    assert central.version == len(steps)  # one commit a step: LocalSteps' steps=1
    digits = workload("digits")
    served = digits.build_model()
    load_central(served, central)
    replayed = digits.build_model()
    adamw = local_optimizer("adamw", replayed, rate)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the worker computes
    try:
        for _, (inputs, targets) in zip(range(len(steps)), digits.batches(0, 1, 0), strict=False):
            adamw.zero_grad()
            loss(replayed, inputs, targets).backward()
            before = [parameter.detach().clone() for parameter in replayed.parameters()]
            adamw.step()
            with torch.no_grad():  # the window's update, committed and added to θ on the server
                for parameter, start in zip(replayed.parameters(), before, strict=True):
                    parameter.copy_(start + (parameter - start))
    finally:
        torch.set_num_threads(threads)
    start = torch.nn.utils.parameters_to_vector(digits.build_model().parameters())
    expected = torch.nn.utils.parameters_to_vector(replayed.parameters()).detach()
    got = torch.nn.utils.parameters_to_vector(served.parameters()).detach()
    moved = (expected - start).abs().max().item()
    assert moved > 10 * rate  # many AdamW steps, each about `rate` a parameter
    assert (got - expected).abs().max().item() < 1e-5 * moved
