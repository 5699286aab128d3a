/* GEM's arithmetic around its passes, written once: the bound that lets a commit run in place and
 * the statistics from a pass's sums. rules/gem.py (GemRule, CompactGemRule) calls them through
 * gem_bounds() and gem_stats(), the compiled commit core (core.c) directly; the plain Python
 * reference they are held to, bit for bit, is tests/unit/reference_rules.py's. */
#include "module.h"

/* rules/overflow.py: SAFE_MAGNITUDE, half of float32's largest (exact in a double), and ROUNDING */
#define SAFE_MAGNITUDE ((double)FLT_MAX / 2.0)
#define ROUNDING (1.0 + 1.0 / 1048576.0)

/* Bounds on max |theta| and max |m_i| after a commit when no value GEM computes for it can reach
 * SAFE_MAGNITUDE (1: it may run in place), else 0 (NaN too): |Delta| <= |scale| max|u|,
 * |m_i'| <= mu max|m_i| + |Delta|, pi <= pi_max, |theta - s_i| <= max|theta| + max|s_i|,
 * |theta'| <= max|theta| + pi_max |Delta|, each widened by ROUNDING for float32's rounding.
 * Doubles throughout, as Python's floats. */
int
gem_in_place_bounds(const GemBoundsOf *of, double *theta_bound, double *proxy_bound)
{
    const double delta = fabs(of->scale) * of->payload_peak * ROUNDING;
    const double proxy = (fabs(of->momentum) * of->proxy_peak + delta) * ROUNDING;
    const double theta = (of->theta_peak + fabs(of->pi_max) * delta) * ROUNDING;
    double largest = delta;
    const double amplified = proxy * (1.0 > fabs(of->kappa) ? 1.0 : fabs(of->kappa));
    largest = amplified > largest ? amplified : largest;
    largest = of->theta_peak + of->last_seen_peak > largest ? of->theta_peak + of->last_seen_peak : largest;
    largest = theta > largest ? theta : largest;
    *theta_bound = theta;
    *proxy_bound = proxy;
    return largest < SAFE_MAGNITUDE;
}

/* ApplyStats' six figures from a pass's sums and pi's sample (`count` values of `samples`, NaN
 * where Delta = 0; reordered): pi's over the `moving` parameters, the energies' over all `size`
 * of them. 0, or -1 with MemoryError. */
int
gem_figures(float *samples, Py_ssize_t count, Py_ssize_t size, const Sums *sums, double figures[6])
{
    const Py_ssize_t moving = (Py_ssize_t)sums->moving;
    figures[4] = sums->proxy_energy / (double)size;
    figures[5] = sums->central_energy / (double)size;
    if (moving == 0) { /* a commit of zeros: nothing moved, no pi to speak of */
        figures[0] = figures[1] = figures[2] = figures[3] = 0.0;
        return 0;
    }
    float *kept = NULL;
    if (moving != size) { /* the parameters it moves, as numpy's samples[~isnan(samples)] */
        kept = PyMem_Malloc((size_t)(count > 0 ? count : 1) * sizeof(float));
        if (kept == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        Py_ssize_t found = 0;
        for (Py_ssize_t j = 0; j < count; j++) {
            if (samples[j] == samples[j]) {
                kept[found++] = samples[j];
            }
        }
        samples = kept;
        count = found;
    }
    figures[0] = sums->pi_sum / (double)moving;
    figures[1] = count ? median_of(samples, count) : figures[0];
    PyMem_Free(kept);
    figures[2] = (double)(Py_ssize_t)sums->at_zero / (double)moving;
    figures[3] = (double)(Py_ssize_t)sums->at_max / (double)moving;
    return 0;
}

/* gem_bounds(scale, payload_peak, theta_peak, momentum, kappa, pi_max, proxy_peak, last_seen_peak) */
PyObject *
gem_bounds(PyObject *self, PyObject *args)
{
    GemBoundsOf of;
    if (!PyArg_ParseTuple(args, "dddddddd", &of.scale, &of.payload_peak, &of.theta_peak, &of.momentum, &of.kappa,
                          &of.pi_max, &of.proxy_peak, &of.last_seen_peak)) {
        return NULL;
    }
    double theta_bound, proxy_bound;
    if (!gem_in_place_bounds(&of, &theta_bound, &proxy_bound)) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(dd)", theta_bound, proxy_bound);
}

/* gem_stats(samples, size, moving, pi_sum, at_zero, at_max, proxy_energy, central_energy) */
PyObject *
gem_stats(PyObject *self, PyObject *args)
{
    Py_buffer samples;
    Py_ssize_t size;
    Sums sums = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0f, 0.0f, 0.0, 0.0};
    if (!PyArg_ParseTuple(args, "w*ndddddd", &samples, &size, &sums.moving, &sums.pi_sum, &sums.at_zero, &sums.at_max,
                          &sums.proxy_energy, &sums.central_energy)) {
        return NULL;
    }
    double figures[6];
    const int done = size > 0 && samples.len % (Py_ssize_t)sizeof(float) == 0
                         ? gem_figures((float *)samples.buf, samples.len / (Py_ssize_t)sizeof(float), size, &sums,
                                       figures)
                         : (PyErr_SetString(PyExc_ValueError, "gem_stats: float32 samples of at least one parameter"),
                            -1);
    PyBuffer_Release(&samples);
    if (done < 0) {
        return NULL;
    }
    return Py_BuildValue("(dddddd)", figures[0], figures[1], figures[2], figures[3], figures[4], figures[5]);
}
