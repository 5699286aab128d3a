"""The replay of asynchronous AdamW workers (scripts/adam_staleness.py, issue 78 item 2), reduced for
CI: each scheme through the script as the records ran it, on a few hundred samples.

With one worker every scheme is one AdamW worker: DDP's step on one gradient is `single`'s to the
bit; a window applied by the energy-matched rule (GEM with μ 0, c excluding the worker's own step:
π = 1 where nothing else moved θ) or by the adaptive-staleness rule (staleness 0) is downpour's to
the bit, and lands where one AdamW worker's step does, up to rounding. With 16 workers in turn the
schemes learn, the energy-matched one about as DDP does, and a stale scheme is not DDP's
computation (the gradient's θ tells them apart). Weight prediction (`pred:K`) at a share of 0 is
`mean:K` to the bit, and moves θ off it once a worker's gradient is predicted. DANA's look-ahead
(`dana:H`) starts a window where the workers' AdamW moments, worked out by hand in float64, say θ
is headed. The server's adamw rule over rounds (`rounds:K`) is DDP's computation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from tests.script_modules import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "adam_staleness.py"
ENERGY_MATCHED = ("--gem-outer", "1", "--gem-momentum", "0", "--gem-kappa", "1", "--gem-own-step", "excluded")


def load_replay() -> ModuleType:
    return load_script(SCRIPT, "adam_staleness")


def replay(tmp_path: Path, name: str, *arguments: str) -> dict[str, list[float]]:
    """Each variant's held-out losses, by variant."""
    record = tmp_path / f"{name}.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *arguments, "--evaluations", "2", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    results = json.loads(record.read_text())["results"]
    return {result["variant"]: [loss for _, loss in result["curve"]] for result in results}


def test_with_one_worker_every_scheme_is_one_adamw_worker(tmp_path: Path) -> None:
    variants = ("single", "ddp:1", "local:1", "gem:1", "as:1")
    losses = replay(tmp_path, "one", "--variants", *variants, "--workers", "1", "--samples", "320", *ENERGY_MATCHED)
    assert losses["ddp:1"] == losses["single"], losses
    # The rules' π is 1 here (nothing else moved θ; staleness 0): their θ is downpour's to the bit.
    assert losses["gem:1"] == losses["as:1"] == losses["local:1"], losses
    # θ + (θ' - θ) rounds, and AdamW's normalised step makes a rounding of a tiny gradient a whole
    # step: apart by under 2 % here, not to the bit.
    assert all(abs(a - b) < 0.02 * b for a, b in zip(losses["local:1"], losses["single"], strict=True)), losses


def test_the_users_setting_replays_its_own_gpt_at_its_batch_of_32(tmp_path: Path) -> None:
    """`--model user`: the 2-layer GPT of width 128 a new user tried (issue 78) at batch 32: 640
    samples are 20 steps of 32, read at the middle and the end, and DDP on one machine is `single`."""
    record = tmp_path / "user.json"
    argv = [sys.executable, str(SCRIPT), "--model", "user", "--variants", "single", "ddp:1", "--workers", "1",
            "--samples", "640", "--evaluations", "2", "--json", str(record)]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    written = json.loads(record.read_text())
    assert written["batch"] == 32
    curves = {result["variant"]: result["curve"] for result in written["results"]}
    assert [samples for samples, _ in curves["single"]] == [320, 640]
    assert curves["ddp:1"] == curves["single"]
    assert curves["single"][-1][1] < curves["single"][0][1] < 4.2  # it learns, from about a uniform guess


def test_sixteen_workers_in_turn_run_every_scheme_and_learn(tmp_path: Path) -> None:
    variants = ("ddp:16", "mean:16", "gem:1")
    losses = replay(
        tmp_path, "many", "--variants", *variants, "--workers", "16", "--samples", "1024", "--warmup", "2",
        *ENERGY_MATCHED,
    )  # fmt: skip
    assert set(losses) == set(variants)
    for variant, curve in losses.items():  # each learns (from about 4.2 nats, a uniform guess)
        assert curve[-1] < curve[0] < 4.2, (variant, curve)
    # Each window damped by what the other 15 moved θ since it started: a round of 16 commits moves
    # θ about one AdamW step, as DDP's step on their 16 gradients does (3.908 and 3.913 here).
    assert abs(losses["gem:1"][-1] - losses["ddp:16"][-1]) < 0.02 * losses["ddp:16"][-1], losses
    # DDP takes every gradient at the newest θ, `mean` at each worker's last reply: not the same run.
    assert losses["ddp:16"] != losses["mean:16"], losses


def test_weight_prediction_at_share_zero_is_mean_and_otherwise_moves_theta_ahead() -> None:
    """Two workers in turn, one server step a round: from the third round worker 1's gradient is
    taken at its reply plus the last server step's move (it waited on one server step last time)."""
    script = load_replay()
    data = script.Data()
    thetas: list[torch.Tensor] = []

    def keep_theta(model: torch.nn.Module, theta: torch.Tensor) -> float:
        """θ where the held-out loss would be: the bit-for-bit witness, and no evaluation's seconds."""
        thetas.append(theta)
        return 0.0

    data.held_out = keep_theta
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the script runs
    try:
        for variant, share in (("pred", 0.0), ("mean", 1.0), ("pred", 1.0)):
            script.server_adam(data, variant, 2, 6, 3e-3, [6], workers=2, prediction=share)
    finally:
        torch.set_num_threads(threads)
    unpredicted, mean, predicted = thetas
    assert torch.equal(unpredicted, mean)
    assert not torch.equal(predicted, mean)


def momentum_moves(gradients: list[float], window: int, lr: float = 0.01) -> list[float]:
    """By hand in float64: AdamW's first and second moments after one step on each gradient, then
    the move of `window` more steps on the first moment alone (its gradients taken as zero)."""
    beta1, beta2, eps = 0.9, 0.99, 1e-8
    moves = []
    for g in gradients:
        first, second = (1 - beta1) * g, (1 - beta2) * g * g
        terms = (
            lr * beta1**k * first / (1 - beta1 ** (1 + k)) / (math.sqrt(second / (1 - beta2 ** (1 + k))) + eps)
            for k in range(1, window + 1)
        )
        moves.append(-sum(terms))
    return moves


def test_dana_starts_a_window_where_the_workers_moments_say_theta_is_headed() -> None:
    """Two workers, each one AdamW step into training: worker 0's next window starts at θ plus
    worker 1's momentum move over a whole window and its own over one step (DANA-Zero's θ̂ at H = 1)."""
    script = load_replay()
    grads = ([0.5, -2.0, 1e-3], [-0.25, 4.0, 3.0])
    models, optimizers = [], []
    for g in grads:
        model = torch.nn.Linear(3, 1, bias=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0)
        model.weight.grad = torch.tensor([g])
        optimizer.step()
        models.append(model)
        optimizers.append(optimizer)
    theta = [1.0, 2.0, 3.0]
    for window in (1, 3):
        ahead = script.DanaLookAhead(torch.tensor(theta), 2, window)
        # Worker 1 first: worker 0's move is not known yet, so only its own first step's is ahead.
        first = ahead.start(torch.tensor(theta), 1, models[1], optimizers[1]).tolist()
        assert close(first, [t + own for t, own in zip(theta, momentum_moves(grads[1], 1), strict=True)]), first
        started = ahead.start(torch.tensor(theta), 0, models[0], optimizers[0]).tolist()
        moves = zip(theta, momentum_moves(grads[0], 1), momentum_moves(grads[1], window), strict=True)
        assert close(started, [t + own + other for t, own, other in moves]), (window, started)


def close(got: list[float], expected: list[float]) -> bool:
    """Equal to float32's precision."""
    return all(abs(a - b) < 1e-6 * abs(b) for a, b in zip(got, expected, strict=True))


def test_a_run_stopped_early_reads_the_long_runs_curve_not_a_short_runs(tmp_path: Path) -> None:
    """`--stop-at`: the issue's 51,200 samples are read inside a run planned for 204,800; a run that
    stops there is that run's curve up to there (the schedules planned for the whole run), which a
    run planned for the short length is not (its cosine ends sooner)."""
    common = ("--model", "user", "--variants", "ahead:1", "ddp:4", "--workers", "4", "--warmup", "4")
    whole = replay(tmp_path, "whole", *common, "--samples", "1280")
    stopped = replay(tmp_path, "stopped", *common, "--samples", "1280", "--stop-at", "640")
    short = replay(tmp_path, "short", *common, "--samples", "640")
    assert stopped == {variant: losses[:1] for variant, losses in whole.items()}, (stopped, whole)
    assert short["ahead:1"] != stopped["ahead:1"] and short["ddp:4"] != stopped["ddp:4"], (short, stopped)
    refused = subprocess.run(
        [sys.executable, str(SCRIPT), "--variants", "rounds:2", "--samples", "512", "--stop-at", "256"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert refused.returncode == 2 and "--stop-at is for" in refused.stderr and "rounds:2" in refused.stderr
    before = subprocess.run(  # a stop before the first evaluation would read nothing
        [
            sys.executable,
            str(SCRIPT),
            "--variants",
            "ahead:1",
            "--samples",
            "512",
            "--stop-at",
            "10",
            "--evaluations",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert before.returncode == 2 and "ends before the first evaluation, at 256 samples" in before.stderr, before.stderr


def test_the_adamw_rules_rounds_are_ddps_computation(tmp_path: Path) -> None:
    """`rounds:K` (scripts/adam_rounds.py): the server's adamw rule, each round's K gradients taken
    on its θ, is DDP's step on their mean. With the comparison's model (Adam, no decay, so both
    decay alike) at a constant rate the two curves agree to float32's rounding; they learn."""
    losses = replay(
        tmp_path, "rounds", "--model", "comparison", "--variants", "ddp:4", "rounds:4", "--workers", "4",
        "--samples", "512",
    )  # fmt: skip
    assert all(abs(a - b) < 1e-3 * b for a, b in zip(losses["rounds:4"], losses["ddp:4"], strict=True)), losses
    assert losses["rounds:4"][-1] < losses["rounds:4"][0], losses


def test_rounds_of_local_windows_are_averaged_by_the_adamw_rule(tmp_path: Path) -> None:
    """`windows:H` (scripts/adam_rounds.py): with one worker, rounds of one window of one step,
    averaged (`--outer-rate 1`), are one AdamW worker (`single`) up to the rounding of θ + (θ' - θ)
    (as `local:1` is); with 4 workers the averaged rounds learn, and the outer rate is used."""
    one = replay(tmp_path, "one", "--variants", "windows:1", "single", "--workers", "1", "--samples", "320")
    assert all(abs(a - b) < 0.02 * b for a, b in zip(one["windows:1"], one["single"], strict=True)), one
    four = replay(tmp_path, "four", "--variants", "windows:2", "--workers", "4", "--samples", "512")
    half = replay(
        tmp_path, "half", "--variants", "windows:2", "--workers", "4", "--samples", "512", "--outer-rate", "0.5"
    )
    assert four["windows:2"][-1] < four["windows:2"][0], four
    assert four["windows:2"][-1] != half["windows:2"][-1], (four, half)


def test_a_beta1_ramp_is_what_the_windows_run_when_asked(tmp_path: Path) -> None:
    """`--beta1-to` (gemps.pytorch.Beta1Ramp in every worker): a ramp to the β1 the workers start at
    changes nothing, to the bit; a ramp to another moves the curve; given to another variant, or
    outside [0, 1), it is refused, naming it."""
    windows = ("--variants", "windows:2", "--workers", "4", "--samples", "512", "--beta1", "0.5")
    plain = replay(tmp_path, "plain", *windows)
    level = replay(tmp_path, "level", *windows, "--beta1-to", "0.5", "--beta1-ramp", "0.5")
    rising = replay(tmp_path, "rising", *windows, "--beta1-to", "0.95", "--beta1-ramp", "0.5")
    assert level == plain and rising["windows:2"][-1] != plain["windows:2"][-1], (plain, rising)
    for refused in (["--variants", "ahead:1", "--beta1-to", "0.95"], ["--variants", "windows:2", "--beta1-to", "1"]):
        done = subprocess.run([sys.executable, str(SCRIPT), *refused], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and "--beta1-to is a β1 in [0, 1) for windows:H" in done.stderr, done.stderr
    alone = ["--variants", "windows:2", "--beta1-ramp", "0.5"]  # a ramp with nothing to rise to
    done = subprocess.run([sys.executable, str(SCRIPT), *alone], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--beta1-ramp 0.5 without --beta1-to" in done.stderr, done.stderr


def test_the_rounds_move_as_momentum_is_what_the_windows_run_when_asked(tmp_path: Path) -> None:
    """`--round-momentum` (gemps.pytorch.round_momentum in every worker after each round) moves the
    curve and still trains; given to another variant it is refused, naming it. β2 0.5: the moments
    are set from each worker's second step on (1/(1 - β2)), where a run this short has them."""
    windows = ("--variants", "windows:2", "--workers", "4", "--samples", "512", "--beta2", "0.5")
    plain = replay(tmp_path, "plain", *windows)
    moved = replay(tmp_path, "moved", *windows, "--round-momentum")
    assert moved["windows:2"][-1] != plain["windows:2"][-1], (plain, moved)
    assert moved["windows:2"][-1] < moved["windows:2"][0], moved
    wrong = ["--variants", "ahead:1", "--round-momentum"]
    done = subprocess.run([sys.executable, str(SCRIPT), *wrong], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--round-momentum is for windows:H: not with ahead:1" in done.stderr, done.stderr


def test_the_trainers_schedule_and_betas_are_what_the_replay_runs_when_asked() -> None:
    """`--schedule linear` is the Trainer's default (a linear warm-up, then a linear decay to 0 at the
    run's end, decaying from the start without a warm-up); `--beta1`/`--beta2` replace the model's
    optimizer's betas, each alone; the cosine without a warm-up stays a constant rate (no schedule)."""
    load_replay()  # puts scripts/ on the path, as running it does
    from adam_replay_data import Data

    linear = Data("user", beta2=0.999, schedule="linear")
    model = linear.build()
    optimizer = linear.optimizer_of(model, 1e-3)
    assert {tuple(group["betas"]) for group in optimizer.param_groups} == {(0.9, 0.999)}
    schedule = linear.schedule_of(optimizer, 10, None)
    assert schedule is not None
    rates = []
    for _ in range(11):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [round(rate / 1e-3, 6) for rate in rates] == [round(1 - step / 10, 6) for step in range(11)]
    warmed = linear.optimizer_of(model, 1e-3)
    factor = linear.schedule_of(warmed, 10, 2).lr_lambdas[0]  # type: ignore[union-attr]
    assert [factor(step) for step in (0, 1, 2, 6, 10)] == [0.0, 0.5, 1.0, 0.5, 0.0]
    cosine = Data("user", beta1=0.5)
    assert cosine.schedule_of(cosine.optimizer_of(model, 1e-3), 10, None) is None
    assert {tuple(group["betas"]) for group in cosine.optimizer_of(model, 1e-3).param_groups} == {(0.5, 0.99)}


def test_a_workers_batch_and_weight_decay_are_what_the_replay_runs_when_asked() -> None:
    """`--batch` replaces the model's batch in every worker's stream; `--weight-decay` replaces the
    decay of the groups that decay (nanoGPT's matrices) and leaves the others (biases, norms) at 0."""
    load_replay()
    from adam_replay_data import Data

    model_default = Data("user")
    asked = Data("user", batch=3, weight_decay=0.01)
    assert model_default.batch == 32 and asked.batch == 3
    inputs, targets = next(asked.batches(0, 4))
    assert inputs.shape[0] == targets.shape[0] == 3
    model = asked.build()
    decays = sorted({group["weight_decay"] for group in model_default.optimizer_of(model, 1e-3).param_groups})
    assert decays == [0.0, 0.1]
    assert sorted({group["weight_decay"] for group in asked.optimizer_of(model, 1e-3).param_groups}) == [0.0, 0.01]


def test_several_seeds_run_each_as_alone_and_summarise_their_mean(tmp_path: Path) -> None:
    """`--seed 0 1`: each seed's run is the run `--seed` alone gives, to the bit, and the record
    and the output give each variant's mean over the seeds with its standard error. A repeated
    seed, an unknown variant after a known one, or no evaluation, is refused before anything runs."""
    record = tmp_path / "seeds.json"
    common = ["--model", "user", "--variants", "single", "--workers", "1", "--samples", "640", "--evaluations", "2"]
    both = subprocess.run(
        [sys.executable, str(SCRIPT), *common, "--seed", "0", "1", "--json", str(record)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert both.returncode == 0, both.stdout + both.stderr[-3000:]
    written = json.loads(record.read_text())
    runs = {result["seed"]: result["curve"] for result in written["results"]}
    alone = replay(tmp_path, "alone", *common, "--seed", "1")
    assert sorted(runs) == [0, 1] and [loss for _, loss in runs[1]] == alone["single"], (runs, alone)
    finals = [runs[0][-1][1], runs[1][-1][1]]
    summary = written["summary"]["single"]
    assert summary["seeds"] == [0, 1] and summary["mean"] == sum(finals) / 2, summary
    assert math.isclose(summary["standard_error"], abs(finals[0] - finals[1]) / 2), summary
    assert f"mean held-out loss {sum(finals) / 2:.4f}" in both.stdout, both.stdout
    for wrong, said in (
        (["--seed", "3", "3"], "--seed takes distinct seeds of at least 0, not 3 3"),
        (["--variants", "single", "lone:1"], "unknown variant 'lone:1'"),
        (["--evaluations", "0"], "--evaluations must be at least 1, not 0"),
    ):
        done = subprocess.run([sys.executable, str(SCRIPT), *wrong], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and said in done.stderr and "held-out loss" not in done.stdout, done.stderr
