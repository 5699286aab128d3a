"""GEM with compact per-worker state (`--gem-state compact`): about 2.25 bytes per worker per parameter
where the exact rule (gem.py) keeps 8.

GEM reads two things of worker i's state per parameter: |m_i| (its proxy's velocity, whose sign
the next commit's m_i <- mu*m_i + Delta needs too) and c = |theta - s_i|, how far theta moved
since i's last commit. Here:
- m_i is kept as 8-bit codes relative to each block's peak (block_codes.py: sign, 4 exponent and
  3 mantissa bits, 2**-4 relative error at most over 17 binades);
- s_i is kept as the same codes of its offset from a reference theta R that every worker shares:
  s_i = R_g + offset_i. A float32 s_i is not needed: what GEM needs is theta - s_i, and the
  offset from a recent copy of theta is as small as the movement c itself, so the codes' relative
  error becomes a small error of c.
- References: every REFRESH_PER_WORKER x (registered workers) applied commits (a round trip of
  every worker, twice), theta is copied into a new reference, generation g + 1, and the older of
  two is reused for it: a worker whose offset still points at the one being reused (it made no
  commit over the last period) is rebased onto the newer one first (offset re-encoded). A worker's
  own commit re-encodes its offset against the newest reference. Two references in all: 8 bytes
  per parameter shared by the workers, whatever their number.
Everything else is gem.py's: the same hyperparameters, pi from the same float32 operations
(gem_pi in csrc/shared.h), the same statistics; what is rounded is only m_i and s_i, each once
per commit. The error this adds to pi, and why it stays bounded: DESIGN §1a.

The state is deterministic (no random rounding; the numpy pass here and csrc/compact_gem.c give the
same bytes), so replicas that apply the same commits hold the same bits: `worker_state` and
`global_state` carry the codes, peaks, references and generation numbers to a backup. A
checkpoint carries none of it: workers register again after a restart.

No commit makes theta or the state non-finite: the compiled pass runs in place when bounds (kept
per worker and per reference from the codes' peaks, and theta's) rule out an overflow, else after
a dry run over the same values; the numpy pass computes out of place and keeps the result only
when it is finite.
"""

from __future__ import annotations

import math

import numpy as np

from gemps_server.domain.rules import block_codes
from gemps_server.domain.rules.base import (
    ApplyStats,
    NoiseWindow,
    NonFiniteUpdate,
    StepContext,
)
from gemps_server.domain.rules.gem_base import EPSILON, GemBase
from gemps_server.domain.rules.overflow import ROUNDING, SAFE_MAGNITUDE
from gemps_server.native import all_finite, compiled, copy_max_abs, max_abs

#: applied commits between two references, per registered worker
REFRESH_PER_WORKER = 2
#: what `worker_state` returns per worker
WORKER_STATE = ("proxy_codes", "proxy_scales", "offset_codes", "offset_scales", "generation")
_GENERATION, _SINCE_REFRESH, _REFERENCES = "generation", "since_refresh", ("reference_0", "reference_1")


class _CompactWorker:
    """m_i's codes and their blocks' peaks, s_i's offset from reference `generation` (same form)."""

    __slots__ = ("generation", "offset_codes", "offset_scales", "proxy_codes", "proxy_scales")

    def __init__(self, size: int, generation: int) -> None:
        # np.zeros: calloc'd pages stay unmapped until the first commit writes them.
        self.proxy_codes = np.zeros(size, np.uint8)
        self.proxy_scales = np.zeros(block_codes.blocks(size), np.float32)
        self.offset_codes = np.zeros(size, np.uint8)
        self.offset_scales = np.zeros(block_codes.blocks(size), np.float32)
        self.generation = generation

    @property
    def proxy_peak(self) -> float:
        """max |m_i| (a code decodes to at most its block's peak)."""
        return float(self.proxy_scales.max(initial=0.0))

    @property
    def offset_peak(self) -> float:
        return float(self.offset_scales.max(initial=0.0))


class CompactGemRule(GemBase):
    state_form = "compact"

    def _allocate(self, num_parameters: int) -> None:
        self._workers: dict[str, _CompactWorker] = {}
        # References by generation % 2, with a bound on max |R| each; the second is made at the first refresh.
        self._references: list[np.ndarray | None] = [None, None]
        self._reference_peaks = [0.0, 0.0]
        self._generation = 0  # the newest reference's
        self._since_refresh = 0  # commits applied since it was taken

    @classmethod
    def worker_state_bytes(cls, num_parameters: int) -> int:
        """Bytes one registered worker's state takes: a code per parameter for m_i and s_i, and their peaks."""
        return 2 * num_parameters + 2 * 4 * block_codes.blocks(num_parameters)

    @property
    def shared_state_bytes(self) -> int:
        """Bytes of the references the workers share (two copies of theta once the first period ended)."""
        return sum(reference.nbytes for reference in self._references if reference is not None)

    @property
    def writes_out(self) -> bool:
        return self.kernel == "compiled"

    @property
    def folds_noise(self) -> bool:
        return self.kernel == "compiled"

    # -- workers --------------------------------------------------------------------------------

    def add_worker(self, worker_id: str, theta: np.ndarray) -> None:
        index = self._generation % 2
        if self._references[index] is None:  # the first worker: the first reference is theta
            self._take_reference(index, theta)
        worker = _CompactWorker(theta.size, self._generation)
        reference = self._references[index]
        assert reference is not None
        with np.errstate(over="ignore", invalid="ignore"):
            offset = np.subtract(theta, reference, dtype=np.float32)
        if not all_finite(offset):  # theta near float32's largest, far from the reference
            offset = np.where(np.isfinite(offset), offset, np.float32(0))
        self._encode(offset, worker.offset_codes, worker.offset_scales)
        self._workers[worker_id] = worker

    def remove_worker(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def worker_state(self, worker_id: str) -> dict[str, np.ndarray]:
        worker = self._workers[worker_id]
        return {
            "proxy_codes": worker.proxy_codes.copy(),
            "proxy_scales": worker.proxy_scales.copy(),
            "offset_codes": worker.offset_codes.copy(),
            "offset_scales": worker.offset_scales.copy(),
            "generation": np.array(worker.generation, np.int64),
        }

    def load_worker_state(self, worker_id: str, state: dict[str, np.ndarray]) -> None:
        if set(state) != set(WORKER_STATE) or worker_id not in self._workers:
            raise ValueError(
                f"compact GEM's state of a registered worker is {', '.join(WORKER_STATE)}, got {sorted(state)}"
            )
        size, blocks = self.num_parameters, block_codes.blocks(self.num_parameters)
        codes, scales = (state["proxy_codes"], state["offset_codes"]), (state["proxy_scales"], state["offset_scales"])
        if any(c.dtype != np.uint8 or c.shape != (size,) or not block_codes.valid_codes(c) for c in codes):
            raise ValueError(
                f"compact GEM's codes must be uint8 of shape [{size}], magnitudes at most {block_codes.LARGEST_CODE}"
            )
        if any(s.dtype != np.float32 or s.shape != (blocks,) or not _finite_non_negative(s) for s in scales):
            raise ValueError(f"compact GEM's peaks must be finite, non-negative float32 of shape [{blocks}]")
        generation = np.asarray(state["generation"]).reshape(-1)
        if generation.size != 1 or int(generation[0]) not in self._live_generations():
            raise ValueError(f"a compact GEM worker's generation must be one of {self._live_generations()}")
        worker = self._workers[worker_id]
        worker.proxy_codes, worker.offset_codes = (np.array(c, np.uint8, copy=True) for c in codes)
        worker.proxy_scales, worker.offset_scales = (np.array(s, np.float32, copy=True) for s in scales)
        worker.generation = int(generation[0])

    def global_state(self, workers: bool = True) -> dict[str, np.ndarray]:
        """The references and generation numbers: the workers' state points into them, so a
        checkpoint (`workers` False) keeps none of it."""
        if not workers or self._references[self._generation % 2] is None:
            return {}
        state = {
            _GENERATION: np.array(self._generation, np.int64),
            _SINCE_REFRESH: np.array(self._since_refresh, np.int64),
        }
        for name, reference in zip(_REFERENCES, self._references, strict=True):
            if reference is not None:
                state[name] = reference.copy()
        return state

    def load_global_state(self, state: dict[str, np.ndarray]) -> None:
        if not state:
            return
        references = {name: state[name] for name in _REFERENCES if name in state}
        if not set(state) <= {_GENERATION, _SINCE_REFRESH, *_REFERENCES} or not {_GENERATION, _SINCE_REFRESH} <= set(
            state
        ):
            raise ValueError(
                f"compact GEM's global state is {_GENERATION}, {_SINCE_REFRESH} and its references, got {sorted(state)}"
            )
        counters = [np.asarray(state[name]).reshape(-1) for name in (_GENERATION, _SINCE_REFRESH)]
        if any(c.size != 1 or int(c[0]) < 0 for c in counters):
            raise ValueError("compact GEM's generation and commit count must be non-negative integers")
        generation, since = (int(c[0]) for c in counters)
        if _REFERENCES[generation % 2] not in references:
            raise ValueError("compact GEM's global state lacks its newest reference")
        for reference in references.values():
            if (
                reference.dtype != np.float32
                or reference.shape != (self.num_parameters,)
                or not math.isfinite(max_abs(reference))
            ):
                raise ValueError(f"compact GEM's references must be finite float32 of shape [{self.num_parameters}]")
        self._generation, self._since_refresh = generation, since
        for index, name in enumerate(_REFERENCES):
            self._references[index] = None
            if name in references:
                self._take_reference(index, references[name])

    # -- a commit ---------------------------------------------------------------------------------

    def step_scaled(
        self,
        theta: np.ndarray,
        update: np.ndarray,
        scale: float,
        context: StepContext,
    ) -> tuple[np.ndarray, ApplyStats]:
        worker_id, update_peak, out, window = context.worker_id, context.payload_peak, context.out, context.window
        worker = self._workers[worker_id]
        if theta.size == 0:
            return theta, ApplyStats.constant(0.0)
        read, write = worker.generation % 2, self._generation % 2
        if self.kernel == "compiled":
            stats = self._apply_compiled(theta, worker, update, scale, update_peak, out, window, read, write)
        else:
            stats = self._apply_numpy(theta, worker, update, scale, read, write)
        worker.generation = self._generation
        self._since_refresh += 1
        if self._since_refresh >= REFRESH_PER_WORKER * max(1, len(self._workers)):
            self._refresh(theta)
        return theta, stats

    def _apply_compiled(
        self,
        theta: np.ndarray,
        worker: _CompactWorker,
        update: np.ndarray,
        scale: float,
        update_peak: float | None,
        out: np.ndarray | None,
        window: NoiseWindow | None,
        read: int,
        write: int,
    ) -> ApplyStats:
        assert compiled is not None
        theta_peak = self.peak_of(theta)
        delta = self.update_peak(update, scale, update_peak)
        moved = theta_peak + abs(self.pi_max) * delta
        largest = max(
            (abs(self.momentum) * worker.proxy_peak + delta) * max(1.0, abs(self.kappa)),
            theta_peak + self._reference_peaks[read] + worker.offset_peak,
            moved + self._reference_peaks[write],
        )
        payload = np.ascontiguousarray(update, np.float32)
        arguments = (
            theta, worker.proxy_codes, worker.proxy_scales, worker.offset_codes, worker.offset_scales,
            self._references[read], self._references[write], payload,
            *(float(np.float32(v)) for v in (scale, self.momentum, self.kappa, self.pi_max, EPSILON)),
            int(self.own_step == "excluded"),
        )  # fmt: skip
        if (
            not largest * ROUNDING < SAFE_MAGNITUDE
            and not compiled.compact_gem_update(*arguments, 0, self.sample_stride, self.samples)[0]
        ):
            raise NonFiniteUpdate(
                "the update would make the central variable or the worker's GEM state overflow (or NaN)"
            )
        total, stride, mode = (None, 1, 0) if window is None else (window.total, window.stride, window.mode)
        written = compiled.compact_gem_update(*arguments, 1, self.sample_stride, self.samples, out, total, stride, mode)
        (finite, pi_sum, at_zero, at_max, proxy_energy, central_energy, new_peak, _, _, payload_square,
         window_square, moving) = written  # fmt: skip
        assert finite, "compact GEM wrote a value that is not finite after its check"
        if window is not None:
            window.payload_square, window.window_square = payload_square, window_square
        self.remember_peak(theta, new_peak)
        return self.summed_stats(theta.size, moving, pi_sum, at_zero, at_max, proxy_energy, central_energy)

    def _apply_numpy(
        self, theta: np.ndarray, worker: _CompactWorker, update: np.ndarray, scale: float, read: int, write: int
    ) -> ApplyStats:
        """The compiled pass's operations over all of theta at once, out of place: the reference the
        compiled kernel is checked against (bit for bit), and the kernel where none was built."""
        read_reference, write_reference = self._references[read], self._references[write]
        assert read_reference is not None and write_reference is not None
        f32 = np.float32
        with np.errstate(over="ignore", invalid="ignore"):
            delta = np.multiply(update, f32(scale), dtype=np.float32)
            velocity = block_codes.decode(worker.proxy_codes, worker.proxy_scales)
            velocity *= f32(self.momentum)
            velocity += delta
            seen = read_reference + block_codes.decode(worker.offset_codes, worker.offset_scales)
            movement = np.abs(theta - seen)
            proxy = np.abs(velocity)
            if self.kappa != 1.0:
                proxy *= f32(self.kappa)
            denominator = np.abs(delta) + EPSILON
            pi = (proxy - movement) / denominator
            np.maximum(pi, f32(0.0), out=pi)
            np.minimum(pi, f32(self.pi_max), out=pi)
            moved = theta + pi * delta
            offset = (moved if self.own_step == "excluded" else theta) - write_reference
            central = movement + pi * denominator
        if not all(math.isfinite(max_abs(v)) for v in (moved, velocity, offset)):
            raise NonFiniteUpdate(
                "the update would make the central variable or the worker's GEM state overflow (or NaN)"
            )
        # The new scales, as csrc/compact_gem.c's next_scales: a bound on |m|, and max |theta - R_write|.
        delta_peak = f32(abs(f32(scale))) * block_codes.peaks(update)
        worker.proxy_scales = f32(abs(f32(self.momentum))) * worker.proxy_scales + delta_peak
        offset_scales = block_codes.peaks(theta - write_reference)
        if self.own_step == "excluded":
            offset_scales = offset_scales + f32(self.pi_max) * delta_peak
        worker.offset_scales = offset_scales
        block_codes.encode_against(velocity, worker.proxy_scales, worker.proxy_codes)
        block_codes.encode_against(offset, worker.offset_scales, worker.offset_codes)
        np.copyto(theta, moved)
        return ApplyStats.of(
            pi, self.pi_max, float(proxy.mean(dtype=np.float64)), float(central.mean(dtype=np.float64)), delta
        )

    # -- references -------------------------------------------------------------------------------

    def _refresh(self, theta: np.ndarray) -> None:
        """A new reference from theta, in the older one's place: its workers rebased onto the newer first."""
        older = (self._generation + 1) % 2
        newer = self._references[self._generation % 2]
        assert newer is not None
        if self._references[older] is not None:
            previous = self._generation - 1
            for worker in self._workers.values():
                if worker.generation == previous:
                    self._rebase(worker, self._references[older], newer)
                    worker.generation = self._generation
        self._take_reference(older, theta)
        self._generation += 1
        self._since_refresh = 0

    def _take_reference(self, index: int, theta: np.ndarray) -> None:
        target = self._references[index]
        if target is None or target.shape != theta.shape:
            target = self._references[index] = np.empty(theta.shape, np.float32)
        self._reference_peaks[index] = copy_max_abs(theta, target)

    def _rebase(self, worker: _CompactWorker, source: np.ndarray | None, target: np.ndarray) -> None:
        assert source is not None
        if self.kernel == "compiled":
            assert compiled is not None
            compiled.compact_rebase(worker.offset_codes, worker.offset_scales, source, target)
            return
        with np.errstate(over="ignore", invalid="ignore"):
            offset = (source + block_codes.decode(worker.offset_codes, worker.offset_scales)) - target
        block_codes.encode(
            np.where(np.isfinite(offset), offset, np.float32(0)), worker.offset_codes, worker.offset_scales
        )

    def _encode(self, values: np.ndarray, codes: np.ndarray, scales: np.ndarray) -> None:
        if self.kernel == "compiled":
            assert compiled is not None
            compiled.compact_encode(np.ascontiguousarray(values, np.float32), codes, scales)
        else:
            block_codes.encode(values, codes, scales)

    def _live_generations(self) -> tuple[int, ...]:
        return (
            (self._generation,)
            if self._references[(self._generation + 1) % 2] is None
            else (self._generation, self._generation - 1)
        )


def compact_builds(choose: str | None = None) -> tuple[str, list[str]]:
    """(the build of the compiled pass in use, the builds this CPU runs: avx512, avx2, baseline);
    `choose` one of them to use it (they write the same bytes: for measuring and testing each).
    ValueError where the compiled kernel was not built or the CPU does not run `choose`."""
    if compiled is None:
        raise ValueError("the compiled kernel was not built here (no C compiler at install?)")
    in_use, runnable = compiled.compact_kernel(choose)
    return str(in_use), [str(build) for build in runnable]


def _finite_non_negative(values: np.ndarray) -> bool:
    return bool(np.all(np.isfinite(values)) and np.all(values >= 0))
