"""What GEM's two forms share (gem.GemRule keeps each worker's state exact, gem_compact.CompactGemRule
in 8-bit codes): GEM's options, how the server runs it (its kernel, what c counts of a worker's own
step: the server's --gem-kernel and --gem-own-step, read by `run_options`), and the statistics a
compiled pass sums. The arithmetic is gem.py's docstring (DESIGN §1)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from gemps_proto.rule_options import RuleOption
from gemps_proto.schema import POSITIVE_FACTOR
from gemps_server.domain.rules import base
from gemps_server.domain.rules.base import ApplyStats, CommitRule, Schedule, constant_schedule
from gemps_server.domain.rules.momentum import MOMENTUM
from gemps_server.domain.rules.overflow import OverflowGuard
from gemps_server.native import compiled

EPSILON = np.float32(1e-16)
#: how GEM's update runs: `auto` (compiled if built, else numpy), `compiled`, `numpy`
GEM_KERNELS = ("auto", "compiled", "numpy")
#: what c = |theta - s_i| counts of worker i's own previous step: `counted` (s_i taken before it
#: is applied: the paper's reference code) or `excluded` (s_i taken after)
GEM_OWN_STEP = ("counted", "excluded")
#: how GEM keeps each worker's m_i and s_i: exact (float32: gem.GemRule) or compact (8-bit codes:
#: gem_compact.CompactGemRule); the server's --gem-state
GEM_STATES = ("exact", "compact")
#: GEM's options besides the proxy's momentum (Appendix B's kappa; pi's clamp)
KAPPA = RuleOption("kappa", 1.0, POSITIVE_FACTOR, "kappa: GEM's proxy amplification")
PI_MAX = RuleOption("pi_max", 5.0, POSITIVE_FACTOR, "clamp on GEM's scaling factor pi")


class GemBase(OverflowGuard, CommitRule):
    """What both forms of GEM's per-worker state share (exact: gem.GemRule; compact:
    gem_compact.CompactGemRule): the options, the kernel, what c counts of a worker's own
    step, and the statistics a compiled pass sums. A form sets up its own buffers in `_allocate`."""

    name = "gem"
    options = (MOMENTUM, KAPPA, PI_MAX)

    def __init__(
        self,
        num_parameters: int,
        *,
        learning_rate: float,
        momentum: float,
        kappa: float,
        pi_max: float,
        schedule: Schedule = constant_schedule,
        kernel: str = "auto",
        own_step: str = "counted",
    ) -> None:
        super().__init__(num_parameters, learning_rate=learning_rate, schedule=schedule)
        self.momentum, self.kappa, self.pi_max = momentum, kappa, pi_max
        if own_step not in GEM_OWN_STEP:
            raise ValueError(f"unknown gem own_step {own_step!r}; valid: {', '.join(GEM_OWN_STEP)}")
        self.own_step = own_step
        if kernel not in GEM_KERNELS:
            raise ValueError(f"unknown gem kernel {kernel!r}; valid: {', '.join(GEM_KERNELS)}")
        if kernel == "compiled" and compiled is None:
            raise ValueError("gem kernel 'compiled' is not built here (no C compiler at install?): use auto or numpy")
        self.kernel = "compiled" if kernel != "numpy" and compiled is not None else "numpy"
        # pi at every sample_stride-th parameter, written by the compiled passes (the commit core's too)
        self.sample_stride = base.sample_stride(num_parameters)
        self.samples = np.empty(-(-num_parameters // self.sample_stride), dtype=np.float32)
        self._allocate(num_parameters)

    @classmethod
    def run_options(cls, settings: Mapping[str, Any]) -> dict[str, Any]:
        """The server's --gem-kernel and --gem-own-step, as the constructor's kernel and own_step."""
        return {"kernel": settings.get("gem_kernel", "auto"), "own_step": settings.get("gem_own_step", "counted")}

    def _allocate(self, num_parameters: int) -> None:
        """The form's own buffers (called once the common ones are set)."""

    def summed_stats(
        self,
        size: int,
        moving: int,
        pi_sum: float,
        at_zero: int,
        at_max: int,
        proxy_energy: float,
        central_energy: float,
    ) -> ApplyStats:
        """ApplyStats from a compiled pass's sums and pi's sample: pi's over the `moving` parameters
        (Delta != 0; the sample holds NaN at the others), the energies' over all `size` of them
        (csrc/gem_rule.c, the compiled commit core's own)."""
        assert compiled is not None
        figures = (moving, pi_sum, at_zero, at_max, proxy_energy, central_energy)
        return ApplyStats(*compiled.gem_stats(self.samples, size, *figures))
