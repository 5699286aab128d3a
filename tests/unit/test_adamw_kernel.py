"""The adamw rule's compiled passes (csrc/adamw.c) write the bits of its numpy reference
(rules/adamw.py `_adamw_numpy`): the round's sum, the AdamW step, and the peaks the rule refuses
an overflow by; whole runs of the rule agree bit for bit on either kernel."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_server import native
from gemps_server.domain.rules import NonFiniteUpdate, create_rule
from gemps_server.domain.rules.adamw import AdamWRule
from gemps_server.domain.rules.base import StepContext
from tests.helpers import training

pytestmark = pytest.mark.skipif(native.compiled is None, reason="test_native.py fails where it was not built")


def bits(values: np.ndarray) -> np.ndarray:
    return values.view(np.uint32)


def made(kernel: str, size: int, **options: float) -> AdamWRule:
    rule = create_rule(training("adamw", learning_rate=3e-3, **options), size)
    assert isinstance(rule, AdamWRule) and rule.kernel == "compiled"  # where built, the default
    rule.kernel = kernel
    return rule


def spread(rng: np.random.Generator, size: int) -> np.ndarray:
    """Values over many magnitudes, as gradients have them (tiny ones square to denormals)."""
    return (rng.standard_normal(size) * 10.0 ** rng.uniform(-20, 3, size)).astype(np.float32)


@pytest.mark.parametrize("size", [1, 1023, 1025, 70_001])
@pytest.mark.parametrize("decayed", [None, [], [(0, 1)], [(3, 700), (900, 1000), (1200, 70_001)]])
def test_the_compiled_step_writes_numpys_bits_and_peaks(size: int, decayed: list[tuple[int, int]] | None) -> None:
    rng = np.random.default_rng(size)
    rule = made("numpy", size, adam_beta1=0.8, adam_beta2=0.95, adam_weight_decay=0.1)
    gradient, first, theta = spread(rng, size), spread(rng, size), rng.standard_normal(size).astype(np.float32)
    second = np.abs(spread(rng, size))
    ranges = [(low, min(high, size)) for low, high in decayed or [] if low < size]
    coefficients = rule.coefficients(7, 2e-3, 5)
    decay = np.float32(1 - 2e-3 * 0.1)
    rule._decayed = None if decayed is None else ranges  # what take_spec leaves (tested in test_adamw_rule.py)
    expected = (np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32))
    peaks = rule._adamw_numpy(gradient, (first, second), theta, expected, coefficients, decay)
    written = tuple(np.empty(size, np.float32) for _ in range(3))
    bounds = np.array(ranges, np.int64).reshape(-1)
    assert native.compiled is not None
    compiled_peaks = native.compiled.adamw_step(
        gradient, first, second, theta, *written, coefficients, decay, decayed is None, bounds
    )
    for new, reference in zip(written, expected, strict=True):
        np.testing.assert_array_equal(bits(new), bits(reference))
    assert compiled_peaks == peaks


def test_a_step_that_overflows_reports_which_peak_is_not_finite() -> None:
    rule = made("numpy", 5)
    gradient = np.array([1e30, 1.0, -2.0, 0.0, 3e38], np.float32)  # squares to inf; a mean of inf
    moments = np.zeros(5, np.float32), np.zeros(5, np.float32)
    theta = np.ones(5, np.float32)
    for kernel in ("numpy", "compiled"):
        outputs = (np.empty(5, np.float32), np.empty(5, np.float32), np.empty(5, np.float32))
        if kernel == "numpy":
            peaks = rule._adamw_numpy(gradient, moments, theta, outputs, rule.coefficients(1, 1e-3, 1), np.float32(1))
        else:
            assert native.compiled is not None
            arguments = (*outputs, rule.coefficients(1, 1e-3, 1), np.float32(1), True, np.empty(0, np.int64))
            peaks = native.compiled.adamw_step(gradient, *moments, theta, *arguments)
        assert math.isfinite(peaks[0]) and math.isnan(peaks[1]), (kernel, peaks)


@pytest.mark.parametrize("subtract", [False, True])
def test_the_compiled_sum_is_numpys_and_finds_an_overflow(subtract: bool) -> None:
    rng = np.random.default_rng(3)
    total, gradient = spread(rng, 70_001), spread(rng, 70_001)
    out = np.empty_like(total)
    assert native.compiled is not None
    peak = native.compiled.adamw_sum(total, gradient, out, subtract)
    expected = total - gradient if subtract else total + gradient
    np.testing.assert_array_equal(bits(out), bits(expected))
    assert peak == float(np.abs(expected).max())
    total[65_000] = 3e38
    gradient[65_000] = -3e38 if subtract else 3e38
    assert math.isnan(native.compiled.adamw_sum(total, gradient, out, subtract))


def test_the_passes_refuse_buffers_that_do_not_fit_or_share_memory() -> None:
    assert native.compiled is not None
    values = np.ones(8, np.float32)
    rule = made("numpy", 8)
    step = (rule.coefficients(1, 1e-3, 1), np.float32(1), True, np.empty(0, np.int64))
    with pytest.raises(ValueError, match="own"):
        native.compiled.adamw_sum(values, values.copy(), values, False)
    with pytest.raises(ValueError, match="one size"):
        native.compiled.adamw_sum(values, values[:4].copy(), np.empty(8, np.float32), False)
    outputs = [np.empty(8, np.float32) for _ in range(3)]
    with pytest.raises(ValueError, match="own"):
        native.compiled.adamw_step(values, values, values, values, outputs[0], outputs[0], outputs[2], *step)
    unsorted = (*step[:3], np.array([4, 6, 0, 2], np.int64))
    with pytest.raises(ValueError, match="sorted"):
        native.compiled.adamw_step(values, values, values, values, *outputs, *unsorted)
    beyond = (*step[:3], np.array([4, 9], np.int64))
    with pytest.raises(ValueError, match="sorted"):
        native.compiled.adamw_step(values, values, values, values, *outputs, *beyond)


@pytest.mark.parametrize("options", [{}, {"gradient_clip": 0.5}, {"adam_decay_vectors": 1}])
def test_whole_runs_agree_bit_for_bit_on_either_kernel(options: dict[str, float]) -> None:
    """Rounds of 3 gradients (and of updates), a partition's slice of the spec, one commit
    refused for overflowing the moments: θ and every vector of the rule's state alike."""
    size = 5_000
    spec = [ParameterSpec("w", (40, 100)), ParameterSpec("b", (100,)), ParameterSpec("u", (30, 100))]
    rules = [made(kernel, size, round_size=3, **options) for kernel in ("numpy", "compiled")]
    for rule in rules:
        rule.take_spec(spec, (500, 5_500))
    rng = np.random.default_rng(11)
    thetas = [rng.standard_normal(size).astype(np.float32)] * 2
    refused: list[tuple[int, str]] = []
    for version in range(31):
        kind = PayloadKind.UPDATE if version % 7 == 3 else PayloadKind.GRADIENT
        payload = spread(rng, size) if version != 14 else np.full(size, 1e25, np.float32)  # closes a round
        context = StepContext("w0", version=version, kind=kind)
        for index, rule in enumerate(rules):
            try:
                thetas[index], _ = rule.step(thetas[index], payload, context)
            except NonFiniteUpdate:
                refused.append((version, rule.kernel))
        np.testing.assert_array_equal(bits(thetas[0]), bits(thetas[1]))
    clipped = "gradient_clip" in options  # a clipped mean cannot overflow
    assert refused == ([] if clipped else [(14, "numpy"), (14, "compiled")])
    states = [rule.global_state() for rule in rules]
    assert states[0]["steps"] == 10
    for key, value in states[0].items():
        np.testing.assert_array_equal(value, states[1][key])
