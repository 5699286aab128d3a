/* The server's compiled loops: GEM's update (the default `--gem-kernel`) and the finiteness
 * check of a payload, each one pass over P floats without the GIL.
 *
 * GEM's update, in one compiled pass over the parameters:
 *
 * For worker i and each parameter j, with Delta = scale * update (scale is -eta for a gradient):
 *
 *     m_i    <- mu * m_i + Delta
 *     c       = |theta - s_i|
 *     pi      = clip((kappa * |m_i| - c) / (|Delta| + eps), 0, pi_max)
 *     s_i    <- theta
 *     theta  <- theta + pi * Delta
 *
 * The float32 operations are gem.py's numpy pass, one by one and in the same order, each rounded
 * to float32 (built with -ffp-contract=off: no fused multiply-add), so both kernels move theta,
 * m_i and s_i bit for bit alike. In the same pass it sums what the commit's statistics need
 * over every parameter (exact, where the numpy pass estimates from a sample) and keeps pi at
 * every `stride`-th parameter for the median. The loop runs without the GIL: the server's event
 * loop keeps serving other requests meanwhile.
 *
 * Buffers come through the buffer protocol (any C-contiguous float32 memory), so this builds
 * against Python's headers alone; gem.py checks sizes and dtypes before calling.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

#define BLOCK 1024 /* parameters per block: its scratch stays in L1, its float32 partial sums accurate */

typedef struct {
    double pi_sum, proxy_energy, central_energy, at_zero, at_max;
} Sums;

/* The pass itself. Built for AVX2 and for the x86-64 baseline, picked at load time (ifunc).
 * Each block runs twice: first the update, one parameter at a time in gem.py's order, leaving
 * pi and the energies' terms in L1 scratch; then the block's sums, which the `omp simd`
 * reduction lets the compiler vectorise (sums of the statistics only: theta, m_i and s_i do
 * not depend on their order). Sums in one pass with the update kept it from vectorising. */
__attribute__((target_clones("avx2", "default"))) static void
update(float *restrict t, float *restrict m, float *restrict s, const float *restrict u, Py_ssize_t n, float scale,
       float momentum, float kappa, float pi_max, float epsilon, Py_ssize_t stride, float *restrict sampled,
       Sums *restrict sums)
{
    float pis[BLOCK], proxies[BLOCK], centrals[BLOCK];
    const int amplify = kappa != 1.0f;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        float *restrict bt = t + start, *restrict bm = m + start, *restrict bs = s + start;
        const float *restrict bu = u + start;
        for (Py_ssize_t j = 0; j < length; j++) {
            const float delta = scale * bu[j];
            float velocity = momentum * bm[j];
            velocity = velocity + delta;
            bm[j] = velocity;
            const float current = bt[j];
            const float movement = fabsf(current - bs[j]);
            float pi = fabsf(velocity);
            if (amplify) {
                pi = pi * kappa;
            }
            proxies[j] = pi; /* kappa * |m_i| */
            pi = pi - movement;
            const float denominator = fabsf(delta) + epsilon;
            pi = pi / denominator;
            pi = pi < 0.0f ? 0.0f : pi; /* as numpy's maximum and minimum: NaN stays NaN */
            pi = pi > pi_max ? pi_max : pi;
            bs[j] = current;
            const float step = pi * delta;
            bt[j] = current + step;
            pis[j] = pi;
            centrals[j] = movement + pi * denominator;
        }
        float pi_sum = 0.0f, proxy_sum = 0.0f, central_sum = 0.0f, at_zero = 0.0f, at_max = 0.0f;
#pragma omp simd reduction(+ : pi_sum, proxy_sum, central_sum, at_zero, at_max)
        for (Py_ssize_t j = 0; j < length; j++) {
            pi_sum += pis[j];
            proxy_sum += proxies[j];
            central_sum += centrals[j];
            at_zero += pis[j] <= 0.0f ? 1.0f : 0.0f;
            at_max += pis[j] >= pi_max ? 1.0f : 0.0f;
        }
        for (Py_ssize_t k = ((start + stride - 1) / stride) * stride; k < start + length; k += stride) {
            sampled[k / stride] = pis[k - start];
        }
        sums->pi_sum += pi_sum;
        sums->proxy_energy += proxy_sum;
        sums->central_energy += central_sum;
        sums->at_zero += at_zero;
        sums->at_max += at_max;
    }
}

static PyObject *
gem_update(PyObject *self, PyObject *args)
{
    Py_buffer theta, proxy, last_seen, gradient, samples;
    float scale, momentum, kappa, pi_max, epsilon;
    Py_ssize_t stride;
    if (!PyArg_ParseTuple(args, "w*w*w*y*fffffnw*", &theta, &proxy, &last_seen, &gradient, &scale, &momentum,
                          &kappa, &pi_max, &epsilon, &stride, &samples)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = theta.len / (Py_ssize_t)sizeof(float);
    if (theta.len % (Py_ssize_t)sizeof(float) || proxy.len != theta.len || last_seen.len != theta.len ||
        gradient.len != theta.len || stride < 1 ||
        samples.len < ((n + stride - 1) / stride) * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "gem_update: buffers of different sizes");
        goto done;
    }
    Sums sums = {0.0, 0.0, 0.0, 0.0, 0.0};
    Py_BEGIN_ALLOW_THREADS
    update((float *)theta.buf, (float *)proxy.buf, (float *)last_seen.buf, (const float *)gradient.buf, n, scale,
           momentum, kappa, pi_max, epsilon, stride, (float *)samples.buf, &sums);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("(dnndd)", sums.pi_sum, (Py_ssize_t)sums.at_zero, (Py_ssize_t)sums.at_max,
                           sums.proxy_energy, sums.central_energy);
done:
    PyBuffer_Release(&theta);
    PyBuffer_Release(&proxy);
    PyBuffer_Release(&last_seen);
    PyBuffer_Release(&gradient);
    PyBuffer_Release(&samples);
    return result;
}

/* 1 when every float is finite: x - x is 0 for a finite x and NaN for +-Inf and NaN, and a sum
 * of those is 0 or NaN (never an overflow, whatever the values). */
__attribute__((target_clones("avx2", "default"))) static int
every_finite(const float *restrict values, Py_ssize_t n)
{
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t end = start + BLOCK < n ? start + BLOCK : n;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (Py_ssize_t j = start; j < end; j++) {
            sum += values[j] - values[j];
        }
        if (sum != 0.0f) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
all_finite(PyObject *self, PyObject *args)
{
    Py_buffer values;
    if (!PyArg_ParseTuple(args, "y*", &values)) {
        return NULL;
    }
    const Py_ssize_t n = values.len / (Py_ssize_t)sizeof(float);
    int ok;
    Py_BEGIN_ALLOW_THREADS
    ok = every_finite((const float *)values.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&values);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"all_finite", all_finite, METH_VARARGS, "all_finite(float32 buffer) -> True when no value is NaN or +-Inf."},
    {"gem_update", gem_update, METH_VARARGS,
     "gem_update(theta, proxy, last_seen, update, scale, momentum, kappa, pi_max, epsilon, stride, samples)\n"
     "GEM's update in place; returns (sum of pi, count at 0, count at pi_max, sum of kappa*|m|,\n"
     "sum of |theta - s| + pi*(|Delta| + eps)) and writes pi at every stride-th parameter to samples."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The server's compiled loops.", -1, methods};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModule_Create(&module);
}
