"""A GPT-2-small-sized job through gemps (issue 79, items 1 and 4): the real width and depth, trained
by several worker processes through `gemps server --partitions K`, then exported and loaded strictly
into a fresh Hugging Face model that generates text; beside it, one AdamW process alone at equal
tokens on the same device.

- The model: `transformers.GPT2LMHeadModel` from its config (12 layers, 12 heads, width 768) with
  a byte-level vocabulary of 256 (no tokenizer files can be downloaded): 85M parameters at a
  context of 128 (the exact count is in the record).
- The data: the standard library's source as bytes, every tenth file held out (as
  gemps_worker.text_data splits it); each worker reads windows of its own shard.
- The workers: the transformer recipe, AdamW (nanoGPT's groups, betas 0.9/0.95, warm-up and
  cosine) inside `LocalSteps` (`--local-steps` a commit, look-ahead 1) under `--rule downpour`,
  int8 codes both ways (`--compression`).
- The server: on the machine's CPU cores, K partition processes, every default as shipped.
- On CUDA (`--device cuda`, the default where there is one) every worker shares the one GPU, and a
  sampler records its utilisation (nvidia-smi); `--alone` adds the AdamW process alone.

Records: tokens/s of the workers together and of the process alone, the share of a worker's
step time spent in its optimizer's step (the window's commit and its reply included), train and
held-out loss curves, the export's size and the strict load, and a generated sample.

    .venv/bin/python scripts/gpu_job.py --steps 150 --json docs/results/gpt2/cpu.json        # here: ~25 min
    .venv/bin/python scripts/gpu_job.py --device cuda --workers 4 --steps 600 --alone --json gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from gemps.client import Client
from gemps.pytorch import LocalSteps
from gemps_worker.cluster import ServerProcess
from gemps_worker.nanogpt import cosine_schedule, decay_groups
from gemps_worker.processes import GEMPS_COMMAND
from gemps_worker.text_data import split_bytes, stdlib_files

SCRIPT = Path(__file__).resolve()
VOCABULARY = 256  # bytes
HELD_OUT_WINDOWS = 32


def gpt2(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCABULARY, n_positions=args.context, n_embd=args.width, n_layer=args.layers, n_head=args.heads,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def byte_text() -> tuple[np.ndarray, np.ndarray]:
    """(training bytes, held-out bytes): the standard library's modules, held out by file."""
    train, held = split_bytes(stdlib_files())
    return np.frombuffer(train, np.uint8), np.frombuffer(held, np.uint8)


def batch_at(tokens: np.ndarray, starts: np.ndarray, context: int, device: str) -> torch.Tensor:
    offsets = starts[:, None] + np.arange(context + 1)[None, :]
    return torch.from_numpy(tokens[offsets].astype(np.int64)).to(device)


def loss_of(model: torch.nn.Module, windows: torch.Tensor) -> torch.Tensor:
    logits = model(windows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), windows[:, 1:].reshape(-1))


def held_out_loss(model: torch.nn.Module, held: np.ndarray, context: int, device: str) -> float:
    """Nats per byte over HELD_OUT_WINDOWS windows evenly spread over the held-out text."""
    starts = np.linspace(0, len(held) - context - 2, HELD_OUT_WINDOWS).astype(np.int64)
    model.eval()
    with torch.no_grad():
        loss = float(loss_of(model, batch_at(held, starts, context, device)))
    model.train()
    return loss


def adamw(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.AdamW:
    """nanoGPT's AdamW groups (matrices decay by 0.1), GPT-2's betas."""
    return torch.optim.AdamW(decay_groups(model), lr=args.learning_rate, betas=(0.9, 0.95))


def train(args: argparse.Namespace) -> None:
    """One process: a gemps worker (`--role worker`) or the AdamW process alone (`--role alone`)."""
    torch.set_num_threads(args.threads)
    train_bytes, held = byte_text()
    model = gpt2(args).to(args.device)
    inner = adamw(model, args)
    scheduler = cosine_schedule(inner, args.steps, args.warmup)
    optimizer: LocalSteps | torch.optim.Optimizer = inner
    if args.role == "worker":
        codes = None if args.compression == "none" else args.compression
        optimizer = LocalSteps(
            model, inner, args.target, steps=args.local_steps, look_ahead=1.0, name=f"gpt2-{args.rank}",
            compression=codes, reply_compression=codes,
        )  # fmt: skip
    rng = np.random.default_rng(1000 + args.rank)
    shard = np.array_split(np.arange(len(train_bytes) - args.context - 2), args.world)[args.rank]
    record: dict[str, Any] = {
        "role": args.role,
        "rank": args.rank,
        "losses": [],
        "step_seconds": [],
        "optimizer_seconds": [],
    }
    began = time.perf_counter()
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = loss_of(model, batch_at(train_bytes, rng.choice(shard, args.batch), args.context, args.device))
        loss.backward()
        stepping = time.perf_counter()
        optimizer.step(loss=loss) if isinstance(optimizer, LocalSteps) else optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        if args.device == "cuda":
            torch.cuda.synchronize()
        done = time.perf_counter()
        record["losses"].append(float(loss.detach()))
        record["step_seconds"].append(done - started)
        record["optimizer_seconds"].append(done - stepping)
    record["seconds"] = time.perf_counter() - began
    record["tokens"] = args.steps * args.batch * args.context
    if isinstance(optimizer, LocalSteps):
        optimizer.close()
    else:
        record["held_out_loss"] = held_out_loss(model, held, args.context, args.device)
    Path(args.out).write_text(json.dumps(record))


def launch(
    args: argparse.Namespace, role: str, rank: int, world: int, target: str, folder: Path, *, steps: int, threads: int
) -> subprocess.Popen[bytes]:
    out = folder / f"{role}-{rank}.json"
    command = [
        sys.executable, str(SCRIPT), "--role", role, "--rank", str(rank), "--world", str(world), "--target", target,
        "--out", str(out), "--threads", str(threads), *model_flags(args), "--steps", str(steps),
    ]  # fmt: skip
    log = (folder / f"{role}-{rank}.log").open("wb")
    return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)


def model_flags(args: argparse.Namespace) -> list[str]:
    names = ("layers", "heads", "width", "context", "batch", "warmup", "learning_rate", "local_steps",
             "compression", "device")  # fmt: skip
    return [part for name in names for part in (f"--{name.replace('_', '-')}", str(getattr(args, name)))]


def wait_all(processes: list[subprocess.Popen[bytes]], folder: Path) -> None:
    for process in processes:
        if process.wait() != 0:
            for log in sorted(folder.glob("*.log")):
                print(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}", file=sys.stderr)
            raise SystemExit(f"a process of the job failed (exit {process.returncode})")


class GpuSampler:
    """nvidia-smi's utilisation and memory every second, while the job runs (CUDA only)."""

    def __init__(self) -> None:
        self.samples: list[list[float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GpuSampler:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _run(self) -> None:
        query = ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits"]
        while not self._stop.wait(1.0):
            line = subprocess.run(query, capture_output=True, text=True).stdout.splitlines()[:1]
            if line:
                self.samples.append([float(value) for value in line[0].split(",")])


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(args.folder)
    folder.mkdir(parents=True, exist_ok=True)
    train_bytes, held = byte_text()
    model = gpt2(args)
    parameters = sum(p.numel() for p in model.parameters())
    initial = held_out_loss(model, held, args.context, "cpu")
    print(
        f"GPT-2 {args.layers}x{args.width}: {parameters:,} parameters; held-out loss at start {initial:.3f} nats/byte"
    )
    record: dict[str, Any] = {
        "parameters": parameters, "config": vars(args), "initial_held_out_loss": initial,
        "training_bytes": len(train_bytes), "held_out_bytes": len(held),
    }  # fmt: skip
    server_options: dict[str, Any] = {"rule": "downpour", "partitions": args.partitions}
    server_options |= {"checkpoint_dir": str(folder / "checkpoints"), "startup_timeout": 120.0}
    with ServerProcess(log_path=folder / "server.log", **server_options) as server, GpuSampler() as gpu:
        began = time.perf_counter()
        workers = [
            launch(args, "worker", rank, args.workers, server.target, folder, steps=args.steps, threads=args.threads)
            for rank in range(args.workers)
        ]
        wait_all(workers, folder)
        record["workers_seconds"] = time.perf_counter() - began
        with Client(server.target, timeout=60.0) as observer:  # each partition's count
            record["commits_applied"] = [status.commits_applied for status in observer.statuses()]
        exported = folder / "model.safetensors"
        export = [*GEMPS_COMMAND, "export", "--server", server.target, "--out", str(exported), "--timeout", "600"]
        subprocess.run(export, check=True, capture_output=True)
        record["gpu_samples"] = gpu.samples
    record["checkpoints"] = checkpoint_events(folder)  # every partition's, the final ones at its stop included
    began = time.perf_counter()  # the server again over its checkpoints: how long until it serves
    with ServerProcess(log_path=folder / "server-restarted.log", **server_options) as restarted:
        record["restart_seconds"] = time.perf_counter() - began
        with Client(restarted.target, timeout=60.0) as observer:
            record["restored_versions"] = [status.version for status in observer.statuses()]
    record["workers"] = [json.loads((folder / f"worker-{rank}.json").read_text()) for rank in range(args.workers)]
    record |= load_and_generate(args, exported, held)
    if args.alone:
        # One AdamW process at the workers' tokens together, with the cores they had together.
        cores = args.threads * args.workers
        wait_all([launch(args, "alone", 0, 1, "", folder, steps=args.steps * args.workers, threads=cores)], folder)
        record["alone"] = json.loads((folder / "alone-0.json").read_text())
    record["summary"] = summary(record, args)
    return record


def checkpoint_events(folder: Path) -> list[dict[str, float]]:
    """Each "checkpoint written" line of the partitions' logs: its bytes and seconds."""
    events = []
    for log in sorted(folder.rglob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if "checkpoint written" in line:
                fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
                events.append({"bytes": float(fields.get("bytes", 0)), "seconds": float(fields.get("seconds", 0))})
    return events


def load_and_generate(args: argparse.Namespace, exported: Path, held: np.ndarray) -> dict[str, Any]:
    """The export loaded strictly into a fresh model of the same config: its held-out loss and a
    sample it generates (greedy, from a prompt of the held-out text)."""
    import safetensors.torch

    fresh = gpt2(args)
    state = safetensors.torch.load_file(str(exported))
    loaded = fresh.load_state_dict(state, strict=True)  # raises on a missing or unexpected key
    prompt = torch.from_numpy(held[: args.context // 4].astype(np.int64))[None, :]
    with torch.no_grad():  # within the model's context: n_positions
        generated = fresh.generate(
            prompt, max_new_tokens=args.context - prompt.shape[1], do_sample=False, pad_token_id=0
        )
    text = bytes(generated[0, prompt.shape[1] :].tolist()).decode("utf-8", errors="replace")
    return {
        "export_bytes": exported.stat().st_size,
        "strict_load": not loaded.missing_keys and not loaded.unexpected_keys,
        "exported_tensors": len(state),
        "final_held_out_loss": held_out_loss(fresh, held, args.context, "cpu"),
        "prompt": bytes(prompt[0].tolist()).decode("utf-8", errors="replace"),
        "generated": text,
    }


def summary(record: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    workers = record["workers"]
    tokens = sum(worker["tokens"] for worker in workers)
    step = sum(sum(worker["step_seconds"]) for worker in workers)
    optimizer = sum(sum(worker["optimizer_seconds"]) for worker in workers)
    out = {
        "held_out_drop_nats": record["initial_held_out_loss"] - record["final_held_out_loss"],
        "workers_tokens_per_s": tokens / max(worker["seconds"] for worker in workers),  # their training loops
        "optimizer_share_of_step": optimizer / step,
        "commits": args.workers * args.steps // args.local_steps,
    }
    if "alone" in record:
        out["alone_tokens_per_s"] = record["alone"]["tokens"] / record["alone"]["seconds"]
        out["alone_held_out_loss"] = record["alone"]["held_out_loss"]
    if record["gpu_samples"]:
        out["gpu_utilisation_mean"] = float(np.mean([sample[0] for sample in record["gpu_samples"]]))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--context", type=int, default=128, help="bytes a window (the model's n_positions)")
    parser.add_argument("--batch", type=int, default=4, help="windows a step, each worker")
    parser.add_argument("--steps", type=int, default=150, help="steps each worker takes")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--local-steps", type=int, default=1, help="LocalSteps' steps a commit")
    parser.add_argument("--compression", choices=("none", "int8", "int4"), default="int8", help="both ways")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads a process (0: the cores / workers)")
    parser.add_argument("--alone", action="store_true", help="also one AdamW process alone at equal tokens")
    parser.add_argument("--folder", default="runs/gpu_job")
    parser.add_argument("--json", type=Path, default=None, help="write the record here")
    parser.add_argument("--role", choices=("job", "worker", "alone"), default="job", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--target", default="", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    if args.role != "job":
        train(args)
        return
    record = run_job(args)
    print(json.dumps(record["summary"], indent=1))
    print(f"generated after {record['prompt'][-40:]!r}: {record['generated']!r}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
