"""The adamw rule's compiled passes (csrc/adamw.c) write the bits of its numpy reference
(rules/adamw_passes.py `numpy_step`): the round's sum, the AdamW step (the last gradient added in
its pass, or not; in place, or not), and the peaks the rule refuses an overflow by; whole runs of
the rule agree bit for bit on either kernel, the compiled one holding no spares where nothing can
overflow."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gemps_proto.schema import ParameterSpec, PayloadKind
from gemps_server import native
from gemps_server.domain.rules import NonFiniteUpdate, create_rule
from gemps_server.domain.rules.adamw import AdamWRule
from gemps_server.domain.rules.adamw_passes import numpy_step
from gemps_server.domain.rules.base import NoiseWindow, StepContext
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


NONE = np.empty(0, np.float32)


@pytest.mark.parametrize("size", [1, 1023, 1025, 70_001])
@pytest.mark.parametrize("decayed", [None, [], [(0, 1)], [(3, 700), (900, 1000), (1200, 70_001)]])
def test_the_compiled_step_writes_numpys_bits_and_peaks(size: int, decayed: list[tuple[int, int]] | None) -> None:
    """The sum alone or with the last gradient added (either sign), out of place and in place."""
    rng = np.random.default_rng(size)
    rule = made("numpy", size, adam_beta1=0.8, adam_beta2=0.95, adam_weight_decay=0.1)
    total, gradient, first, theta = spread(rng, size), spread(rng, size), spread(rng, size), spread(rng, size)
    second = np.abs(spread(rng, size))
    ranges = None if decayed is None else [(low, min(high, size)) for low, high in decayed if low < size]
    c, decay = rule.coefficients(7, 2e-3, 5), np.float32(1 - 2e-3 * 0.1)
    bounds = np.array(ranges or [], np.int64).reshape(-1)
    assert native.compiled is not None
    for last, sign in ((NONE, 0.0), (gradient, 1.0), (gradient, -1.0)):
        summed = total + np.float32(sign) * gradient if last.size else total
        expected = (np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32))
        peaks = numpy_step(summed, (first, second), theta, expected, c, decay, ranges)
        inputs = first.copy(), second.copy(), theta.copy()
        for outputs in ((np.empty_like(first), np.empty_like(first), np.empty_like(first)), inputs):
            step = (total, last, sign < 0, *inputs, *outputs, c, decay, ranges is None, bounds)
            assert native.compiled.adamw_step(*step) == peaks
            for new, reference in zip(outputs, expected, strict=True):
                np.testing.assert_array_equal(bits(new), bits(reference))


def test_a_step_that_overflows_reports_which_peak_is_not_finite() -> None:
    rule = made("numpy", 5)
    gradient = np.array([1e30, 1.0, -2.0, 0.0, 3e38], np.float32)  # squares to inf; a mean of inf
    moments = np.zeros(5, np.float32), np.zeros(5, np.float32)
    theta, c = np.ones(5, np.float32), rule.coefficients(1, 1e-3, 1)
    outputs = (np.empty(5, np.float32), np.empty(5, np.float32), np.empty(5, np.float32))
    peaks = numpy_step(gradient, moments, theta, outputs, c, np.float32(1), None)
    assert native.compiled is not None
    step = (gradient, NONE, False, *moments, theta, *outputs, c, np.float32(1), True, np.empty(0, np.int64))
    for found in (peaks, native.compiled.adamw_step(*step)):
        assert math.isfinite(found[0]) and math.isnan(found[1]), found


@pytest.mark.parametrize("subtract", [False, True])
def test_the_compiled_sum_is_numpys_in_place_or_not_and_finds_an_overflow(subtract: bool) -> None:
    rng = np.random.default_rng(3)
    total, gradient = spread(rng, 70_001), spread(rng, 70_001)
    expected = total - gradient if subtract else total + gradient
    assert native.compiled is not None
    out = np.empty_like(total)
    for target in (out, total.copy()):
        source = total if target is out else target
        peak = native.compiled.adamw_sum(source, gradient, target, subtract)
        np.testing.assert_array_equal(bits(target), bits(expected))
        assert peak == float(np.abs(expected).max())
    total[65_000] = 3e38
    gradient[65_000] = -3e38 if subtract else 3e38
    assert math.isnan(native.compiled.adamw_sum(total, gradient, out, subtract))


def test_the_passes_refuse_buffers_that_do_not_fit_or_share_memory_but_their_own() -> None:
    assert native.compiled is not None
    values = np.ones(8, np.float32)
    rule = made("numpy", 8)
    tail = (rule.coefficients(1, 1e-3, 1), np.float32(1), True, np.empty(0, np.int64))
    with pytest.raises(ValueError, match="apart"):  # out is the gradient
        native.compiled.adamw_sum(values.copy(), values, values, False)
    shifted = np.ones(9, np.float32)
    with pytest.raises(ValueError, match="apart"):  # out overlaps the sum, one value along
        native.compiled.adamw_sum(shifted[:8], values, shifted[1:], False)
    with pytest.raises(ValueError, match="one size"):
        native.compiled.adamw_sum(values, values[:4].copy(), np.empty(8, np.float32), False)
    moments = [np.zeros(8, np.float32), np.zeros(8, np.float32)]
    theta, total = np.ones(8, np.float32), np.ones(8, np.float32)
    head = (total, NONE, False, *moments, theta)
    with pytest.raises(ValueError, match="apart"):  # m' written over v
        native.compiled.adamw_step(*head, moments[1], np.empty(8, np.float32), np.empty(8, np.float32), *tail)
    with pytest.raises(ValueError, match="apart"):  # θ' written over the sum
        native.compiled.adamw_step(*head, *moments, total, *tail)
    with pytest.raises(ValueError, match="sorted"):
        native.compiled.adamw_step(*head, *moments, theta, *tail[:3], np.array([4, 6, 0, 2], np.int64))
    with pytest.raises(ValueError, match="sorted"):
        native.compiled.adamw_step(*head, *moments, theta, *tail[:3], np.array([4, 9], np.int64))
    native.compiled.adamw_step(*head, *moments, theta, *tail)  # in place: each output its own input


def test_rounds_that_cannot_overflow_run_in_place_with_no_spares() -> None:
    size = 4_000
    rules = [made(kernel, size, round_size=4) for kernel in ("numpy", "compiled")]
    rng = np.random.default_rng(2)
    start = rng.standard_normal(size).astype(np.float32)
    thetas = [start.copy(), start.copy()]  # each rule owns its θ (the compiled one writes it in place)
    for version in range(12):
        payload = spread(rng, size)
        peak = float(np.abs(payload).max())
        for index, rule in enumerate(rules):
            context = StepContext("w0", version=version, payload_peak=peak)
            moved, _ = rule.step(thetas[index], payload, context)
            assert (moved is thetas[index]) == (index == 1 or version % 4 != 3)  # the compiled rule: in place
            thetas[index] = moved
        np.testing.assert_array_equal(bits(thetas[0]), bits(thetas[1]))
    assert rules[0].shared_state_bytes == 6 * 4 * size  # the moments, the sum and a spare of each
    assert rules[1].shared_state_bytes == 3 * 4 * size


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
    start = rng.standard_normal(size).astype(np.float32)
    thetas = [start.copy(), start.copy()]  # each rule owns its θ (the compiled one writes it in place)
    refused: list[tuple[int, str]] = []
    for version in range(31):
        kind = PayloadKind.UPDATE if version % 7 == 3 else PayloadKind.GRADIENT
        payload = spread(rng, size) if version != 14 else np.full(size, 1e25, np.float32)  # closes a round
        peak = float(np.abs(payload).max()) if version % 2 else None  # the checks measure it, or not
        context = StepContext("w0", version=version, kind=kind, payload_peak=peak)
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


def held(values: np.ndarray, bound: float) -> np.ndarray:
    """What a pass reads of `values` held within `bound` (csrc/shared.h's held_block): a NaN as -bound."""
    finite: np.ndarray = np.nan_to_num(values, nan=-bound, posinf=bound, neginf=-bound)
    result: np.ndarray = np.clip(finite, -bound, bound).astype(np.float32)
    return result


def written_after_its_check(rng: np.random.Generator, size: int) -> tuple[np.ndarray, float]:
    """A gradient whose peak was checked, then written by its client before the pass read it:
    values past that peak, infinities and NaNs."""
    gradient = spread(rng, size)
    peak = float(np.abs(gradient).max())
    changed = gradient.copy()
    changed[::97], changed[5::101], changed[7::103], changed[11::107] = 3e38, np.inf, -np.inf, np.nan
    return changed, peak


@pytest.mark.parametrize("subtract", [False, True])
def test_the_passes_read_a_gradient_within_its_checked_peak(subtract: bool) -> None:
    """A gradient in its client's shared memory is read where it lies (the rule `holds_payload`):
    values its client wrote after the commit's check are read within the peak checked, as GEM's
    pass reads them, so the sum, the moments and θ stay finite and are those of the held values."""
    rng = np.random.default_rng(7)
    size = 70_001
    gradient, peak = written_after_its_check(rng, size)
    total, first, theta = spread(rng, size), spread(rng, size), spread(rng, size)
    second = np.abs(spread(rng, size))
    assert native.compiled is not None
    out = np.empty_like(total)
    found = native.compiled.adamw_sum(total, gradient, out, subtract, peak)
    expected = total - held(gradient, peak) if subtract else total + held(gradient, peak)
    np.testing.assert_array_equal(bits(out), bits(expected))
    assert found == float(np.abs(expected).max())
    rule = made("numpy", size)
    c, decay, ranges = rule.coefficients(3, 2e-3, 4), np.float32(1 - 2e-4), np.empty(0, np.int64)
    reference = (np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32))
    numpy_step(expected, (first, second), theta, reference, c, decay, None)
    outputs = (np.empty(size, np.float32), np.empty(size, np.float32), np.empty(size, np.float32))
    native.compiled.adamw_step(total, gradient, subtract, first, second, theta, *outputs, c, decay, True, ranges, peak)
    for new, wanted in zip(outputs, reference, strict=True):
        assert np.isfinite(new).all()
        np.testing.assert_array_equal(bits(new), bits(wanted))


def test_the_rule_holds_a_shared_gradient_and_measures_its_noise_so() -> None:
    """The compiled adamw rule reads a payload in its client's memory where it lies: the commit
    core copies it no more (CommitRule.holds_payload), the round's sum and step read it within the
    peak the checks measured, and the noise scale's window measures the same held values."""
    size = 5_000
    rule = made("compiled", size, round_size=2)
    assert rule.holds_payload and not made("numpy", size).holds_payload
    rng = np.random.default_rng(11)
    theta = rng.standard_normal(size).astype(np.float32)
    reference = made("numpy", size, round_size=2)
    reference_theta = theta.copy()
    stride = 1
    for version in range(4):
        gradient, peak = written_after_its_check(rng, size)
        window = native.noise_window_size(size, stride)
        measured = NoiseWindow(np.zeros(window, np.float32), stride, native.WINDOW_START, lambda _: None)
        context = StepContext("w0", version=version, payload_peak=peak, window=measured)
        theta, _ = rule.step(theta, gradient, context)
        honest = held(gradient, peak)  # what a client that left its memory alone would have sent
        reference_theta, _ = reference.step(
            reference_theta, honest, StepContext("w0", version=version, payload_peak=peak)
        )
        np.testing.assert_array_equal(bits(theta), bits(reference_theta))
        assert measured.payload_square == pytest.approx(float(np.dot(honest, honest)), rel=1e-5)
