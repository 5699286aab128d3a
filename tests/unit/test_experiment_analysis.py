"""The experiment's analysis and report: seeds, mean ± sd, bytes moved, old results (suites: elsewhere)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from gemps_proto.schema import TrainingConfig
from gemps_worker.experiment import paper_figures
from gemps_worker.experiment.analysis import (
    Summary,
    aggregate,
    aggregates,
    base_name,
    bytes_moved,
    group_by_config,
    seeded_name,
    summarize,
)
from gemps_worker.experiment.pool import data_seed
from gemps_worker.experiment.report import (
    aggregate_table,
    describe_setting,
    draw_figures,
    proxy_checks,
    summary_table,
    sweep_table,
    write_aggregates,
    write_results_markdown,
)
from gemps_worker.experiment.single_run import HeldOut, RunConfig, RunResult
from gemps_worker.experiment.suite import (
    agn_comparison,
    agn_sweep,
    quick_suite,
    with_seeds,
)

DIGITS_CNN_PARAMETERS = 38_282


def summary(name: str, **values: float) -> Summary:
    defaults: dict[str, float] = {
        "held_out_accuracy": 0.9,
        "held_out_loss": 0.3,
        "final_training_loss": 0.2,
        "final_train_loss_full": 0.25,
        "final_train_accuracy_full": 0.92,
        "mean_staleness": 3.0,
        "wall_seconds": 10.0,
        "bytes_moved": 100.0,
    }
    defaults.update(values)
    seed = int(name.rsplit("-s", 1)[1]) if base_name(name) != name else 0
    workers = int(base_name(name).split("-n")[1].split("-")[0])
    return Summary(
        name=name,
        rule="gem",
        workers=workers,
        learning_rate=0.05,
        kappa=1.0,
        mode="gradient",
        commits=100,
        worker_steps=10,
        median_pi=1.0,
        mean_pi=1.0,
        fraction_pi_zero=0.0,
        fraction_pi_max=0.0,
        diverged_workers=0,
        seed=seed,
        **defaults,
    )


# -- seeds: names and grouping ------------------------------------------------------------------


def test_seed_zero_keeps_the_name_and_others_get_a_suffix() -> None:
    assert seeded_name("gem-n10", 0) == "gem-n10"
    assert seeded_name("gem-n10", 2) == "gem-n10-s2"
    assert base_name("gem-n10-s2") == "gem-n10"
    assert base_name("gem-n10-s12") == "gem-n10"
    assert base_name("gem-n10") == "gem-n10"
    assert base_name("sweep-easgd-t10-a0.045-n20") == "sweep-easgd-t10-a0.045-n20"
    assert base_name("gem-n30-kappa2-s1") == "gem-n30-kappa2"


def test_with_seeds_repeats_every_config_seed_major() -> None:
    suite = quick_suite()
    seeded = with_seeds(suite, 3)
    assert len(seeded) == 3 * len(suite)
    assert [c.name for c in seeded[: len(suite)]] == [c.name for c in suite]  # seed 0: the plain names first
    assert [c.seed for c in seeded[: len(suite)]] == [0] * len(suite)
    assert seeded[len(suite)].name == f"{suite[0].name}-s1" and seeded[len(suite)].seed == 1
    assert seeded[-1].name == f"{suite[-1].name}-s2" and seeded[-1].seed == 2
    assert with_seeds(suite, 1) == suite
    with pytest.raises(ValueError):
        with_seeds(suite, 0)


def test_data_seeds_of_runs_do_not_overlap() -> None:
    assert data_seed(0, 7) == 7  # as before seeds existed
    assert data_seed(2, 7) == 200_007


def test_group_by_config_gathers_the_seeds_of_each_configuration() -> None:
    found = [summary(n) for n in ("gem-n10", "downpour-n10", "gem-n10-s1", "gem-n10-s2")]
    groups = group_by_config(found)
    assert list(groups) == ["gem-n10", "downpour-n10"]
    assert [s.name for s in groups["gem-n10"]] == ["gem-n10", "gem-n10-s1", "gem-n10-s2"]
    assert [a.name for a in aggregates(found)] == ["gem-n10"]  # downpour has one run only


# -- mean ± sd ----------------------------------------------------------------------------------


def test_aggregate_gives_mean_and_sample_sd() -> None:
    group = [
        summary("gem-n10", held_out_accuracy=0.90, wall_seconds=10.0),
        summary("gem-n10-s1", held_out_accuracy=0.92, wall_seconds=20.0),
        summary("gem-n10-s2", held_out_accuracy=0.94, wall_seconds=30.0),
    ]
    a = aggregate("gem-n10", group)
    assert a.runs == 3 and a.seeds == (0, 1, 2) and a.workers == 10
    assert a.mean["held_out_accuracy"] == pytest.approx(0.92)
    assert a.sd["held_out_accuracy"] == pytest.approx(0.02)  # ddof = 1: sqrt((0.02² + 0 + 0.02²) / 2)
    assert a.mean["wall_seconds"] == pytest.approx(20.0)
    assert a.sd["wall_seconds"] == pytest.approx(10.0)
    assert a.sd["final_training_loss"] == pytest.approx(0.0)
    assert a.held_out_accuracy == a.mean["held_out_accuracy"]
    assert "92.00 ± 2.00%" in aggregate_table([a])
    assert "20 ± 10 |" in aggregate_table([a])


def test_aggregates_are_written_as_json(tmp_path: Path) -> None:
    found = aggregates([summary("gem-n10", wall_seconds=1.0), summary("gem-n10-s1", wall_seconds=3.0)])
    write_aggregates(found, tmp_path)
    written = json.loads((tmp_path / "summary_by_config.json").read_text())
    assert written[0]["name"] == "gem-n10" and written[0]["runs"] == 2
    assert written[0]["mean"]["wall_seconds"] == 2.0
    assert written[0]["sd"]["wall_seconds"] == pytest.approx(math.sqrt(2.0))


def test_proxy_checks_are_judged_on_means_when_seeds_exist() -> None:
    # Per run: seed 1's GEM loss is 3x its proxy's (not met); on the means 0.3 / 0.2 = 1.5x (met).
    found = [
        summary("momentum-n1", final_training_loss=0.3),
        summary("gem-n10", final_training_loss=0.15),
        summary("momentum-n1-s1", final_training_loss=0.1),
        summary("gem-n10-s1", final_training_loss=0.3),
    ]
    checks = proxy_checks(found)
    assert len(checks) == 3
    assert checks[0].claim.startswith("mean over seeds (2 runs, proxy 2): gem-n10:") and checks[0].passed
    assert "loss ratio 1.12" in checks[0].detail  # 0.225 / 0.2
    assert checks[1].claim.startswith("single run (seed 0, proxy momentum-n1): gem-n10:") and checks[1].passed
    assert checks[2].claim.startswith("single run (seed 1, proxy momentum-n1-s1): gem-n10-s1:")
    assert not checks[2].passed


def test_proxy_checks_without_seeds_are_unlabelled() -> None:
    checks = proxy_checks([summary("momentum-n1"), summary("gem-n10"), summary("gem-n20")])
    assert [c.claim.split(":")[0] for c in checks] == ["gem-n10", "gem-n20"]
    assert proxy_checks([summary("gem-n10")]) == []


# -- communication ------------------------------------------------------------------------------


def test_bytes_moved_counts_payload_and_reply_and_easgd_pulls() -> None:
    assert bytes_moved(1000, 250_000, "gradient") == pytest.approx(2000.0)  # 1000 x 2 x 4 x 250k / 1e6
    assert bytes_moved(1000, 250_000, "agn") == pytest.approx(2000.0)
    assert bytes_moved(1000, 250_000, "dynsgd") == pytest.approx(2000.0)
    assert bytes_moved(1000, 250_000, "easgd") == pytest.approx(3000.0)
    assert math.isnan(bytes_moved(1000, 0, "gradient"))
    # int8 codes: 250,000 bytes and 977 scales of 4 up, 1,000,000 down, per commit
    assert bytes_moved(1000, 250_000, "gradient", "int8") == pytest.approx(1000 * (250_000 + 3_908 + 1_000_000) / 1e6)
    # difference replies in int8 too: the codes both ways, but each worker's first reply is bfloat16 θ
    both = bytes_moved(1000, 250_000, "gradient", "int8", "int8", workers=10)
    assert both == pytest.approx((2 * 1000 * (250_000 + 3_908) + 10 * (500_000 - 253_908)) / 1e6)


# -- results from before the new fields ---------------------------------------------------------


def old_result_payload() -> dict[str, object]:
    """A result.json as written before seeds, the local optimizer, the full-train loss and P (and
    before the rule's options and the worker mode left the training config)."""
    training = {"rule": "gem", "learning_rate": 0.05, "momentum": 0.9, "kappa": 1.0, "pi_max": 5.0}
    training |= {"worker_mode": "gradient", "batch_size": 64, "lr_schedule": "constant"}
    config = {
        "name": "gem-n2",
        "workers": 2,
        "training": training,
        "epochs": 1,
        "model": "digits-cnn",
        "dataset": "digits",
        "agn_steps": 4,
        "easgd_alpha": 0.5,
        "easgd_period": 4,
    }
    records = [
        {
            "worker": w,
            "step": step,
            "version": 2 * (step - 1) + w + 1,
            "loss": 1.0 / step,
            "staleness": 1,
            "scaling_mean": 1.0,
            "time": 0.0,
            "scaling_median": 1.0,
            "scaling_at_zero": 0.0,
            "scaling_at_max": 0.0,
        }
        for step in (1, 2, 3)
        for w in (0, 1)
    ]
    return {
        "config": config,
        "records": records,
        "held_out": [{"time": 1.0, "version": 3, "loss": 1.5, "accuracy": 0.5}],
        "final_version": 6,
        "final_loss": 1.2,
        "final_accuracy": 0.6,
        "outcomes": {"0": "done", "1": "done"},
        "wall_seconds": 5.0,
        "extra": {},
    }


def test_an_old_result_json_loads_with_defaults(tmp_path: Path) -> None:
    path = tmp_path / "result.json"
    path.write_text(json.dumps(old_result_payload()))
    result = RunResult.load(path)
    c = result.config
    assert (c.seed, c.dynsgd_steps, c.local_optimizer, c.local_learning_rate) == (0, 10, "sgd", 0.0)
    assert math.isnan(result.final_train_loss_full) and math.isnan(result.final_train_accuracy_full)
    assert result.num_parameters == DIGITS_CNN_PARAMETERS  # counted from the model, as it was not saved
    s = summarize(result)
    assert s.commits == 6 and s.seed == 0
    assert math.isnan(s.final_train_loss_full)
    assert s.bytes_moved == pytest.approx(6 * 2 * 4 * DIGITS_CNN_PARAMETERS / 1e6)
    table = summary_table([s])
    assert "| gem-n2 | 2 |" in table and "| nan |" in table
    # And the new fields round-trip.
    result.final_train_loss_full = 0.5
    result.save(path)
    assert RunResult.load(path).final_train_loss_full == 0.5


def test_an_older_flat_result_config_loads(tmp_path: Path) -> None:
    payload = old_result_payload()
    config = dict(payload["config"])  # type: ignore[call-overload]
    training = config.pop("training")
    config.update({k: v for k, v in training.items() if k != "worker_mode"})
    config["mode"] = "gradient"
    payload["config"] = config
    path = tmp_path / "result.json"
    path.write_text(json.dumps(payload))
    loaded = RunResult.load(path).config
    assert loaded.training.rule == "gem" and loaded.seed == 0 and loaded.dynsgd_steps == 10


@pytest.mark.parametrize(
    ("rule", "options"), [("gem", {"momentum": 0.9, "kappa": 2.0, "pi_max": 5.0}), ("downpour", {})]
)
def test_a_result_from_before_rule_options_loads_its_rules_options_and_mode(
    tmp_path: Path, rule: str, options: dict[str, float]
) -> None:
    """momentum, kappa, pi_max and worker_mode were training fields of every run: the rule's
    options are those its rule took (a downpour run's were ignored), the mode is the run's."""
    payload = old_result_payload()
    training = payload["config"]["training"]  # type: ignore[index]
    training |= {"rule": rule, "kappa": 2.0, "worker_mode": "agn"}
    path = tmp_path / "result.json"
    path.write_text(json.dumps(payload))
    loaded = RunResult.load(path).config
    assert (loaded.training.rule, loaded.training.rule_options, loaded.mode) == (rule, options, "agn")
    assert loaded.kappa == options.get("kappa", 1.0)


def test_describe_setting() -> None:
    sweep = {c.name: c for c in agn_sweep()}
    assert describe_setting(sweep["sweep-agn-adam-l10-lr0.001-n20"]) == "lambda=10, local adam lr 0.001"
    assert describe_setting(sweep["sweep-easgd-t10-a0.045-lr0.05-n20"]) == "tau=10, alpha=0.045, local sgd lr 0.05"
    assert describe_setting(RunConfig("gem-n1", 1)) == "gem, eta=0.05"


# -- the report with and without seeds and comparison runs --------------------------------------


def fake_result(config: RunConfig, accuracy: float, seconds: float) -> RunResult:
    held_out = [HeldOut(seconds * i / 4, 10 * i * config.workers, 1.0 / (i + 1), accuracy * i / 4) for i in range(5)]
    records = [
        {
            "worker": w,
            "step": step,
            "version": config.workers * (step - 1) + w + 1,
            "loss": 1.0 / step,
            "staleness": 1,
            "scaling_mean": 1.0,
            "scaling_median": 1.0,
            "scaling_at_zero": 0.0,
            "scaling_at_max": 0.0,
        }
        for step in range(1, 41)
        for w in range(config.workers)
    ]
    return RunResult(
        config,
        records,
        held_out,
        40 * config.workers,
        0.3,
        accuracy,
        {str(w): "done" for w in range(config.workers)},
        seconds,
        final_train_loss_full=0.2,
        final_train_accuracy_full=accuracy,
        num_parameters=1000,
    )


def test_report_with_seeds_comparison_and_sweep(tmp_path: Path) -> None:
    suite = [c for c in agn_comparison(epochs=1) if c.workers == 10]
    suite = with_seeds(suite, 2) + [replace(c, workers=2) for c in agn_sweep(epochs=1)[:2]]
    results = [fake_result(c, 0.8 + 0.01 * c.seed, 10.0 + c.seed) for c in suite]
    summaries = [summarize(r) for r in results]
    drawn = draw_figures(results, tmp_path)
    assert [p.name for p in drawn] == ["fig_compare_n10.png"]
    assert drawn[0].read_bytes()[:4] == b"\x89PNG"
    markdown = tmp_path / "RESULTS.md"
    settings = {c.name: describe_setting(c) for c in suite}
    write_results_markdown(markdown, summaries, proxy_checks(summaries), drawn, "gemps experiment", "", settings)
    text = markdown.read_text()
    assert "## Mean ± sd over seeds" in text
    assert "| cmp-gem-n10 | 10 | 2 | 80.50 ± 0.71% |" in text
    assert "## Settings sweep" in text
    assert "| sweep-agn-l5-lr0.05-n20 | agn lambda=5, local sgd lr 0.05 | 2 | 1 | 80.00% |" in text
    assert "fig_compare_n10.png" in text
    assert sweep_table(summaries[:1], {}) == ""  # no sweep runs: no table


def test_report_without_new_runs_keeps_its_shape(tmp_path: Path) -> None:
    results = [fake_result(c, 0.9, 5.0) for c in quick_suite()]
    summaries = [summarize(r) for r in results]
    markdown = tmp_path / "RESULTS.md"
    write_results_markdown(markdown, summaries, proxy_checks(summaries), [], "gemps experiment", "")
    text = markdown.read_text()
    assert "Mean ± sd" not in text and "Settings sweep" not in text
    assert "| gem-n4 | 4 |" in text and "momentum proxy" in text


def test_mean_band_interpolates_seeds_onto_one_grid() -> None:
    a = (np.array([0.0, 10.0]), np.array([0.0, 100.0]))
    b = (np.array([0.0, 5.0, 20.0]), np.array([0.0, 50.0, 60.0]))
    grid, mean, low, high = paper_figures.mean_band([a, b])
    assert grid[0] == 0.0 and grid[-1] == 10.0  # the shorter curve's end
    assert mean[-1] == pytest.approx((100.0 + 53.333333) / 2, rel=1e-4)
    assert low[-1] == pytest.approx(53.333333, rel=1e-4) and high[-1] == 100.0
    empty = paper_figures.mean_band([])
    assert all(len(x) == 0 for x in empty)


def test_time_and_steps_to_the_target_accuracy() -> None:
    """The first held-out evaluation at or past 95%: its time, and its version in mini-batches
    per worker (agn: agn_steps mini-batches per commit, commits shared by the workers)."""
    config = RunConfig("agn-n4", 4, TrainingConfig(rule="downpour"), agn_steps=5, mode="agn")
    result = fake_result(config, accuracy=1.0, seconds=8.0)  # accuracy i/4 at time 2i, version 40i
    summary = summarize(result)
    assert summary.seconds_to_target == 8.0  # 0.95 first reached at i = 4 (1.0)
    assert summary.steps_to_target == 160 * 5 / 4
    never = summarize(fake_result(config, accuracy=0.9, seconds=8.0))
    assert math.isnan(never.seconds_to_target) and math.isnan(never.steps_to_target)
    both = aggregate("agn-n4", [summary, never])
    assert both.mean["seconds_to_target"] == 8.0 and both.mean["seconds_to_target_runs"] == 1


def test_the_cli_runs_a_suite_on_another_dataset_and_model(capsys: pytest.CaptureFixture[str]) -> None:
    from gemps_cli.main import main

    assert main(["experiment", "--suite", "agn", "--dataset", "mnist", "--model", "mnist-cnn", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 18 and all("dataset=mnist model=mnist-cnn" in line for line in lines)
    assert main(["experiment", "--suite", "quick", "--dataset", "mnist", "--list"]) == 2  # which model?
    assert "needs --model" in capsys.readouterr().err
