/* The extension module gemps_server._native: the server's compiled loops, one method table for
 * the files of this folder (gem_exact.c, gem_rule.c, checks.c, core*.c, compact_gem.c, compact_codes.c,
 * adamw.c). */
#include "module.h"

static PyMethodDef methods[] = {
    {"all_finite", all_finite, METH_VARARGS, "all_finite(float32 buffer) -> True when no value is NaN or +-Inf."},
    {"max_abs", max_abs, METH_VARARGS,
     "max_abs(float32 buffer) -> the largest |value| (0.0 when empty), NaN when a value is NaN or +-Inf."},
    {"copy_max_abs", copy_max_abs, METH_VARARGS,
     "copy_max_abs(float32 source, float32 target) -> copies source to target and returns max_abs(source)."},
    {"median_in_place", median_in_place, METH_VARARGS,
     "median_in_place(float32 buffer) -> the median (the mean of the two middle values for an even count);\n"
     "reorders the buffer. NaN-free values only (the caller's: pi is clipped)."},
    {"noise_window", noise_window, METH_VARARGS,
     "noise_window(float32 update, float32 window, stride, mode) -> (|u|^2, |window sum after it|^2) over u, the\n"
     "update's every stride-th run of 16 values (stride 1: all); the window sum (16 values per run) is written as\n"
     "mode says: 0 starts it (= u), 1 adds u, 2 (a window's last commit) leaves it."},
    {"gem_update", gem_update, METH_VARARGS,
     "gem_update(theta, proxy, last_seen, update, theta_out, proxy_out, scale, momentum, kappa, pi_max, epsilon,\n"
     "stride, samples, mirror=None, window=None, window_stride=1, mode=0, bound=-1)\n"
     "GEM's update: in place when theta_out is None, else into theta_out and proxy_out (the inputs only read;\n"
     "outputs partial when not finite). Returns (1 if every new value is finite else 0, sum of pi, count at 0,\n"
     "count at pi_max, sum of kappa*|m|, sum of |theta - s| + pi*(|Delta| + eps), max |new theta|, max |new m|,\n"
     "|update|^2, |window sum|^2: noise_window's, in the same pass, when a window is given, else 0, 0, count of\n"
     "Delta != 0) and writes pi at every stride-th parameter to samples (NaN where Delta = 0: pi's sums and counts\n"
     "leave those out); the new theta also to mirror (a buffer of its own). bound >= 0: the update is in memory\n"
     "its sender may still write, each value read once and held within [-bound, bound]."},
    {"compact_gem_update", compact_gem_update, METH_VARARGS,
     "compact_gem_update(theta, proxy_codes, proxy_scales, offset_codes, offset_scales, reference_read,\n"
     "reference_write, update, scale, momentum, kappa, pi_max, epsilon, excluded, write, stride, samples, mirror=None,\n"
     "window=None, window_stride=1, mode=0)\n"
     "GEM on compact state (compact_gem.c), in place; write=0 only checks. Returns gem_update's tuple with max\n"
     "|new offset| after max |new m|."},
    {"compact_rebase", compact_rebase, METH_VARARGS,
     "compact_rebase(offset_codes, offset_scales, reference_from, reference_to) -> max |offset|: the offset\n"
     "re-encoded against another reference, in place."},
    {"compact_kernel", compact_kernel, METH_VARARGS,
     "compact_kernel(name=None) -> (the variant compact_gem_update runs, the variants this CPU runs): avx512,\n"
     "avx2 or baseline, the best supported by default; a name given chooses it (they write the same bytes)."},
    {"compact_encode", compact_encode, METH_VARARGS,
     "compact_encode(float32 values, uint8 codes, float32 scales) -> the largest block peak: block_codes.encode."},
    {"gem_bounds", gem_bounds, METH_VARARGS,
     "gem_bounds(scale, payload_peak, theta_peak, momentum, kappa, pi_max, proxy_peak, last_seen_peak) ->\n"
     "(bound on max |new theta|, bound on max |new m_i|) when GEM's commit may run in place (no value it computes\n"
     "can reach half of float32's largest), else None (NaN too)."},
    {"gem_stats", gem_stats, METH_VARARGS,
     "gem_stats(samples, size, moving, pi_sum, at_zero, at_max, proxy_energy, central_energy) -> ApplyStats'\n"
     "six figures from a GEM pass's sums and pi's sample (NaN where Delta = 0; reordered)."},
    {"adamw_sum", adamw_sum, METH_VARARGS,
     "adamw_sum(total, gradient, out, subtract) -> max |out| (NaN when a value is not): out = total + gradient, or\n"
     "total - gradient with subtract (float32 buffers of one size; out is total itself or apart from both)."},
    {"adamw_step", adamw_step, METH_VARARGS,
     "adamw_step(total, gradient, subtract, m, v, theta, m_out, v_out, theta_out, (divisor, beta1, 1 - beta1,\n"
     "beta2, 1 - beta2, sqrt(1 - beta2^t), epsilon, step size), decay, decay_all, ranges) -> (max |m'|, max |v'|,\n"
     "max |theta'|), each NaN when a value is not finite: one AdamW step on (total +- gradient) / divisor (an empty\n"
     "gradient: total / divisor) in numpy's float32 order (rules/adamw.py), theta times decay over every parameter\n"
     "(decay_all) or the sorted int64 pairs (low, high) of `ranges`; each output m, v or theta itself (in place) or\n"
     "apart from every buffer."},
    {"core_setup", core_setup, METH_VARARGS,
     "core_setup(ApplyStats, Receipt, PayloadKind.GRADIENT): the types and values core_commit makes and passes."},
    {"core_commit", (PyCFunction)(void (*)(void))core_commit, METH_FASTCALL,
     "core_commit(core, commit, reply, out) -> (outcome, reply's result) when the compiled commit core applied\n"
     "the commit (GEM's exact state, in place), else None with nothing changed (domain/core.py runs it)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The server's compiled loops.", -1, methods};

PyMODINIT_FUNC
PyInit__native(void)
{
    compact_codes_init();
    return PyModule_Create(&module);
}
