"""The experiment suites by name: which runs each builds, with which settings."""

from __future__ import annotations

import dataclasses

import pytest

import gemps_server.domain.rules  # noqa: F401  (the rules' options, as a server announces them)
from gemps_server.domain.rules import with_rule_defaults
from gemps_worker.experiment.analysis import base_name
from gemps_worker.experiment.suite import (
    AGN_CHOSEN,
    COMPARISON_WORKERS,
    DOWNPOUR_ETA,
    DYNSGD_CHOSEN,
    EASGD_CHOSEN,
    GEM_ETA,
    SUITES,
    SWEEP_WORKERS,
    AgnSetting,
    ChosenSettings,
    DynSgdSetting,
    EasgdSetting,
    agn_comparison,
    agn_sweep,
    full_suite,
    quick_suite,
)

# -- the AGN suites -----------------------------------------------------------------------------


def test_agn_sweep_has_the_intended_settings() -> None:
    runs = {c.name: c for c in agn_sweep(epochs=3)}
    n = SWEEP_WORKERS
    assert n == 20 and all(c.workers == n and c.epochs == 3 and c.seed == 0 for c in runs.values())
    assert len(runs) == 12 + 8 + 12 + 4
    for steps in (5, 10, 15):
        for rate in (0.05, 0.2, 0.5):
            c = runs[f"sweep-agn-l{steps}-lr{rate:g}-n20"]
            assert (c.training.rule, c.mode, c.agn_steps) == ("downpour", "agn", steps)
            assert (c.local_optimizer, c.local_learning_rate) == ("sgd", rate)
    adam = runs["sweep-agn-adam-l10-lr0.001-n20"]
    assert (adam.mode, adam.agn_steps, adam.local_optimizer, adam.local_learning_rate) == (
        "agn",
        10,
        "adam",
        0.001,
    )
    for steps in (3, 10):
        c = runs[f"sweep-dynsgd-l{steps}-lr0.2-n20"]
        assert (c.training.rule, c.mode, c.dynsgd_steps) == ("adaptive-staleness", "dynsgd", steps)
        assert c.local_learning_rate == 0.2
    for name, period, alpha in (
        ("sweep-easgd-t10-a0.045-lr0.05-n20", 10, 0.9 / 20),
        ("sweep-easgd-t4-a0.045-lr0.2-n20", 4, 0.9 / 20),
        ("sweep-easgd-t10-a0.2-lr0.05-n20", 10, 0.2),
    ):
        c = runs[name]
        assert (c.training.rule, c.mode, c.easgd_period) == ("downpour", "easgd", period)
        assert c.easgd_alpha == pytest.approx(alpha)
    for rule in ("downpour", "gem"):
        assert runs[f"sweep-{rule}-eta0.1-n20"].training.learning_rate == 0.1
        assert runs[f"sweep-{rule}-eta0.05-n20"].training.rule == rule
    assert all(c.training.learning_rate == 0.05 for name, c in runs.items() if "-eta" not in name)


def test_agn_comparison_has_every_method_at_every_count() -> None:
    runs = {c.name: c for c in agn_comparison(epochs=4)}
    assert COMPARISON_WORKERS == (10, 20, 30) and len(runs) == 18
    for n in COMPARISON_WORKERS:
        agn, dynsgd, easgd = runs[f"cmp-agn-n{n}"], runs[f"cmp-dynsgd-n{n}"], runs[f"cmp-easgd-n{n}"]
        assert (agn.training.rule, agn.mode, agn.agn_steps) == ("downpour", "agn", AGN_CHOSEN.steps)
        assert (agn.local_optimizer, agn.local_learning_rate) == ("sgd", AGN_CHOSEN.learning_rate)
        assert runs[f"cmp-agn-lr0.2-n{n}"].local_learning_rate == 0.2
        assert (dynsgd.training.rule, dynsgd.mode, dynsgd.dynsgd_steps) == (
            "adaptive-staleness",
            "dynsgd",
            DYNSGD_CHOSEN.steps,
        )
        assert (easgd.training.rule, easgd.mode, easgd.easgd_period) == (
            "downpour",
            "easgd",
            EASGD_CHOSEN.period,
        )
        assert easgd.easgd_alpha == pytest.approx(EASGD_CHOSEN.alpha_for(n))
        downpour, gem = runs[f"cmp-downpour-n{n}"], runs[f"cmp-gem-n{n}"]
        assert (downpour.training.rule, downpour.mode) == ("downpour", "gradient")
        assert (gem.training.rule, gem.mode) == ("gem", "gradient")
        assert (downpour.training.learning_rate, gem.training.learning_rate) == (DOWNPOUR_ETA, GEM_ETA)
        assert all(runs[k].workers == n and runs[k].epochs == 4 for k in runs if k.endswith(f"-n{n}"))


def test_agn_comparison_takes_other_settings() -> None:
    chosen = ChosenSettings(AgnSetting(5, "adam", 0.001), DynSgdSetting(3), EasgdSetting(30, alpha=0.05))
    runs = {c.name: c for c in agn_comparison(settings=chosen)}
    assert (runs["cmp-agn-n20"].agn_steps, runs["cmp-agn-n20"].local_optimizer) == (5, "adam")
    assert runs["cmp-dynsgd-n30"].dynsgd_steps == 3
    assert (runs["cmp-easgd-n10"].easgd_period, runs["cmp-easgd-n10"].easgd_alpha) == (30, 0.05)


def test_suites_by_name() -> None:
    assert set(SUITES) == {"full", "quick", "agn-sweep", "agn", "gem-state", "compression", "local-steps", "links"}
    links = {c.name: (c.compression, c.reply_compression, c.dynsgd_steps) for c in SUITES["links"](10)}
    assert links["gem-n10-topk-int4"][:2] == ("topk", "int4") and links["gem-n10-local8-half"][2] == 8
    codes = {c.name: (c.compression, c.reply_compression) for c in SUITES["compression"](10)}
    variants = [("", "none", "none"), ("-int8", "int8", "none"), ("-int4", "int4", "none")]
    variants += [("-int8-both", "int8", "int8"), ("-int4-both", "int4", "int4")]
    variants += [("-topk", "topk", "none"), ("-topk-int4", "topk", "int4")]
    expected = {f"gem-n{n}{suffix}": (up, down) for n in (10, 30) for suffix, up, down in variants}
    lm_variants = (variants[0], variants[3], variants[4], variants[6])
    expected |= {f"lm-gem-n8{suffix}": (up, down) for suffix, up, down in lm_variants}
    expected |= {"gem-n100": ("none", "none"), "gem-n100-int8-both": ("int8", "int8")}
    expected |= {"gem-n100-topk-int4": ("topk", "int4")}
    assert codes == expected
    local = {c.name: c for c in SUITES["local-steps"](10)}
    assert local["gem-n30"].mode == "gradient" and local["gem-n30"].compression == "none"
    eight = local["gem-n30-local8-half"]  # 8 local steps, the update halved, int8 codes both ways
    assert (eight.training.rule, eight.mode, eight.dynsgd_steps) == ("gem", "dynsgd", 8)
    assert (eight.outer_learning_rate, eight.compression, eight.reply_compression) == (0.5, "int8", "int8")
    assert local["gem-n10-local4-agn"].outer_learning_rate == 1 / 4
    diloco = local["gem-n30-local4-diloco"]  # DiLoCo's outer Nesterov as the baseline, 0.7 over 30 updates
    assert (diloco.training.rule, diloco.training.rule_options["momentum"], diloco.dynsgd_steps) == ("nesterov", 0.9, 4)
    assert diloco.outer_learning_rate == pytest.approx(0.7 / 30)
    assert SUITES["quick"](10) == quick_suite()
    pairs = {c.name: c for c in SUITES["gem-state"](10)}
    for name in ("gem-n30", "lm-gem-n8"):  # each configuration with the exact state and the compact one
        exact, compact = pairs[name], pairs[f"{name}-compact"]
        assert (exact.gem_state, compact.gem_state) == ("exact", "compact")
        assert dataclasses.replace(compact, name=name, gem_state="exact") == exact
    assert SUITES["full"](3) == full_suite(3)
    dynsgd = {c.name: c for c in quick_suite()}["dynsgd-n4"]
    assert (dynsgd.mode, dynsgd.dynsgd_steps, dynsgd.epochs) == ("dynsgd", 4, 2)
    names = [c.name for s in SUITES.values() for c in s(10)]
    assert all(base_name(n) == n for n in names)  # no suite name looks like a seed's


def test_the_local_steps_that_hold_accuracy_are_measured_on_equal_samples() -> None:
    """Issue 59's settings: local SGD at the proxy's pace eta/(1 - mu), or local Adam; the language
    model's local-steps run covers the mini-batches of its gradient run, in H times fewer commits."""
    local = {c.name: c for c in SUITES["local-steps"](10)}
    for n in (10, 30):
        proxy, adam = local[f"gem-n{n}-local8-proxy"], local[f"gem-n{n}-local8-adam"]
        eta, mu = proxy.training.learning_rate, with_rule_defaults(proxy.training).rule_options["momentum"]
        assert proxy.local_learning_rate == pytest.approx(eta / (1 - mu)) == pytest.approx(0.5)  # the proxy's pace
        assert (proxy.local_optimizer, proxy.dynsgd_steps, proxy.outer_learning_rate) == ("sgd", 8, 0.5)
        assert (adam.local_optimizer, adam.local_learning_rate, adam.outer_learning_rate) == ("adam", 0.003, 0.35)
        assert {proxy.compression, proxy.reply_compression, adam.compression, adam.reply_compression} == {"int8"}
    gradient, steps = local["lm-gem-n8"], local["lm-gem-n8-local8-adam"]
    assert (gradient.model, steps.model, gradient.mode, steps.mode) == ("char-gpt", "char-gpt", "gradient", "dynsgd")
    assert gradient.max_steps == steps.max_steps * steps.dynsgd_steps == 200
    assert gradient.training == steps.training and gradient.epochs == steps.epochs
    assert "gem-n10-local8-adam" in {c.name for c in SUITES["links"](10)}
