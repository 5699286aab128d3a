/* The server's compiled loops: GEM's update (the default `--gem-kernel`), the gradient noise scale's window
 * sums (inside that pass, or alone: noise_window), the finiteness check of
 * a payload (also while copying it), and pi's median; each one pass, without the GIL when long.
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
 * The new theta and m_i are written to separate output buffers and theta, m_i, s_i are only read:
 * the caller keeps the result only when every new value is finite (a commit that would overflow
 * theta is refused with nothing changed), and then s_i <- theta is a swap of buffers, not a copy.
 * The finiteness of the outputs is summed in the same pass (x - x is 0 for a finite x, NaN else).
 *
 * The float32 operations are gem.py's numpy pass, one by one and in the same order, each rounded
 * to float32 (built with -ffp-contract=off: no fused multiply-add), so both kernels move theta,
 * m_i and s_i bit for bit alike. In the same pass it sums what the commit's statistics need
 * over every parameter (exact, where the numpy pass estimates from a sample) and keeps pi at
 * every `stride`-th parameter for the median, and can write the new theta to a mirror (where a
 * reply is read) block by block, while the block is in cache. A long pass runs without the GIL
 * (RELEASE_GIL_FROM): the server's other threads go on meanwhile.
 *
 * Buffers come through the buffer protocol (any C-contiguous float32 memory), so this builds
 * against Python's headers alone; gem.py checks sizes and dtypes before calling.
 */
#include "_native_shared.h"

#define BLOCK 1024 /* parameters per block: its scratch stays in L1, its float32 partial sums accurate */

/* One parameter of GEM's update, in gem.py's order; `T_OUT` and `M_OUT` are where the new theta
 * and m_i go (theta and m_i themselves when in place, which also stores s_i <- theta). */
#define GEM_PARAMETER(T_OUT, M_OUT, STORE_S)                                                             \
    do {                                                                                                 \
        const float delta = scale * bu[j];                                                               \
        float velocity = momentum * bm[j];                                                               \
        velocity = velocity + delta;                                                                     \
        M_OUT[j] = velocity;                                                                             \
        const float current = bt[j];                                                                     \
        const float movement = fabsf(current - bs[j]);                                                   \
        float denominator;                                                                               \
        const float pi = gem_pi(velocity, movement, delta, kappa, amplify, epsilon, pi_max, &proxies[j], \
                                &denominator);                                                           \
        STORE_S;                                                                                         \
        const float step = pi * delta;                                                                   \
        T_OUT[j] = current + step;                                                                       \
        pis[j] = delta != 0.0f ? pi : NAN; /* pi's statistics leave out what this commit does not move */ \
        centrals[j] = movement + pi * denominator;                                                       \
    } while (0)

/* The pass itself, in place: only when the caller has shown that no value can overflow (gem.py's
 * bound, which also stands in for the peaks: they are not measured here). Built for AVX2 and for the x86-64 baseline, picked at load time (ifunc). Each block
 * runs twice: first the update, one parameter at a time in gem.py's order, leaving pi and the
 * energies' terms in L1 scratch; then the block's sums (block_sums). Sums in one pass with the
 * update kept it from vectorising. */
__attribute__((target_clones("avx2", "default"))) static int
update_in_place(float *restrict t, float *restrict m, float *restrict s, const float *restrict u, Py_ssize_t n,
                float scale, float momentum, float kappa, float pi_max, float epsilon, Py_ssize_t stride,
                float *restrict sampled, Sums *restrict sums, float *restrict mirror, float *restrict window, Py_ssize_t wstride, int mode)
{
    float pis[BLOCK], proxies[BLOCK], centrals[BLOCK];
    const int amplify = kappa != 1.0f;
    SampleCursor cursor = {0, 0};
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        float *restrict bt = t + start, *restrict bm = m + start, *restrict bs = s + start;
        const float *restrict bu = u + start;
        for (Py_ssize_t j = 0; j < length; j++) {
            GEM_PARAMETER(bt, bm, bs[j] = current);
        }
        if (mirror != NULL) { /* the new theta, also where a reply reads it, while the block is in cache */
            memcpy(mirror + start, bt, (size_t)length * sizeof(float));
        }
        if (window != NULL) {
            block_noise(bu, window, start, length, wstride, mode, &cursor, sums);
        }
        if (!block_sums(bt, bm, pis, proxies, centrals, start, length, pi_max, stride, sampled, sums, 0)) {
            return 0;
        }
    }
    return 1;
}

/* The same pass into t_out and m_out, theta, m_i and s_i only read: returns 0 at the first block
 * with a value that is not finite (the caller then drops the outputs: nothing it keeps was
 * written). */
__attribute__((target_clones("avx2", "default"))) static int
update_into(const float *restrict t, const float *restrict m, const float *restrict s, const float *restrict u,
            float *restrict t_out, float *restrict m_out, Py_ssize_t n, float scale, float momentum, float kappa,
            float pi_max, float epsilon, Py_ssize_t stride, float *restrict sampled, Sums *restrict sums,
            float *restrict mirror, float *restrict window, Py_ssize_t wstride, int mode)
{
    float pis[BLOCK], proxies[BLOCK], centrals[BLOCK];
    const int amplify = kappa != 1.0f;
    SampleCursor cursor = {0, 0};
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        const float *restrict bt = t + start, *restrict bm = m + start, *restrict bs = s + start;
        const float *restrict bu = u + start;
        float *restrict nt = t_out + start, *restrict nm = m_out + start;
        for (Py_ssize_t j = 0; j < length; j++) {
            GEM_PARAMETER(nt, nm, (void)0);
        }
        if (mirror != NULL) {
            memcpy(mirror + start, nt, (size_t)length * sizeof(float));
        }
        if (window != NULL) { /* a refused commit's window is dropped whole (noise.py) */
            block_noise(bu, window, start, length, wstride, mode, &cursor, sums);
        }
        if (!block_sums(nt, nm, pis, proxies, centrals, start, length, pi_max, stride, sampled, sums, 1)) {
            return 0;
        }
    }
    return 1;
}

static PyObject *
gem_update(PyObject *self, PyObject *args)
{
    Py_buffer theta, proxy, last_seen, gradient, theta_out, proxy_out, samples, mirror, window;
    PyObject *theta_out_object, *proxy_out_object, *mirror_object = Py_None, *window_object = Py_None;
    float scale, momentum, kappa, pi_max, epsilon;
    Py_ssize_t stride, wstride = 1;
    int mode = WINDOW_START;
    if (!PyArg_ParseTuple(args, "w*w*w*y*OOfffffnw*|OOni", &theta, &proxy, &last_seen, &gradient, &theta_out_object,
                          &proxy_out_object, &scale, &momentum, &kappa, &pi_max, &epsilon, &stride, &samples,
                          &mirror_object, &window_object, &wstride, &mode)) {
        return NULL;
    }
    PyObject *result = NULL;
    const int in_place = theta_out_object == Py_None;
    int have_outputs = 0, have_mirror = 0, have_window = 0;
    if (window_object != Py_None) {
        if (PyObject_GetBuffer(window_object, &window, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        have_window = 1;
    }
    if (mirror_object != Py_None) {
        if (PyObject_GetBuffer(mirror_object, &mirror, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        have_mirror = 1;
    }
    if (!in_place) {
        if (PyObject_GetBuffer(theta_out_object, &theta_out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        if (PyObject_GetBuffer(proxy_out_object, &proxy_out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&theta_out);
            goto done;
        }
        have_outputs = 1;
    }
    const Py_ssize_t n = theta.len / (Py_ssize_t)sizeof(float);
    if (theta.len % (Py_ssize_t)sizeof(float) || proxy.len != theta.len || last_seen.len != theta.len ||
        gradient.len != theta.len || stride < 1 ||
        (have_outputs && (theta_out.len != theta.len || proxy_out.len != theta.len)) ||
        (have_mirror && mirror.len != theta.len) || wstride < 1 || mode < WINDOW_START || mode > WINDOW_LAST ||
        (have_window && window.len != window_size(n, wstride) * (Py_ssize_t)sizeof(float)) ||
        samples.len < ((n + stride - 1) / stride) * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "gem_update: buffers of different sizes");
        goto done;
    }
    if (have_outputs && (theta_out.buf == theta.buf || theta_out.buf == proxy.buf || proxy_out.buf == proxy.buf ||
                         proxy_out.buf == theta.buf || theta_out.buf == proxy_out.buf)) {
        PyErr_SetString(PyExc_ValueError, "gem_update: the outputs must be buffers of their own");
        goto done;
    }
    if (have_mirror && (mirror.buf == theta.buf || mirror.buf == proxy.buf || mirror.buf == last_seen.buf ||
                        mirror.buf == gradient.buf || (have_outputs && (mirror.buf == theta_out.buf ||
                                                                        mirror.buf == proxy_out.buf)))) {
        PyErr_SetString(PyExc_ValueError, "gem_update: the mirror must be a buffer of its own");
        goto done;
    }
    if (have_window && (window.buf == theta.buf || window.buf == proxy.buf || window.buf == last_seen.buf ||
                        window.buf == gradient.buf || (have_mirror && window.buf == mirror.buf) ||
                        (have_outputs && (window.buf == theta_out.buf || window.buf == proxy_out.buf)))) {
        PyErr_SetString(PyExc_ValueError, "gem_update: the window must be a buffer of its own");
        goto done;
    }
    Sums sums = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0f, 0.0f, 0.0, 0.0};
    float *mirrored = have_mirror ? (float *)mirror.buf : NULL;
    float *windowed = have_window ? (float *)window.buf : NULL;
    int finite;
    MAYBE_RELEASE_GIL(n);
    if (have_outputs) {
        finite = update_into((const float *)theta.buf, (const float *)proxy.buf, (const float *)last_seen.buf,
                             (const float *)gradient.buf, (float *)theta_out.buf, (float *)proxy_out.buf, n, scale,
                             momentum, kappa, pi_max, epsilon, stride, (float *)samples.buf, &sums, mirrored, windowed, wstride, mode);
    } else {
        finite = update_in_place((float *)theta.buf, (float *)proxy.buf, (float *)last_seen.buf,
                                 (const float *)gradient.buf, n, scale, momentum, kappa, pi_max, epsilon, stride,
                                 (float *)samples.buf, &sums, mirrored, windowed, wstride, mode);
    }
    MAYBE_RESTORE_GIL()
    result = Py_BuildValue("(idnnddddddn)", finite, sums.pi_sum, (Py_ssize_t)sums.at_zero, (Py_ssize_t)sums.at_max,
                           sums.proxy_energy, sums.central_energy, (double)sums.theta_peak,
                           (double)sums.proxy_peak, sums.payload_square, sums.window_square, (Py_ssize_t)sums.moving);
done:
    if (have_window) {
        PyBuffer_Release(&window);
    }
    if (have_outputs) {
        PyBuffer_Release(&theta_out);
        PyBuffer_Release(&proxy_out);
    }
    if (have_mirror) {
        PyBuffer_Release(&mirror);
    }
    PyBuffer_Release(&theta);
    PyBuffer_Release(&proxy);
    PyBuffer_Release(&last_seen);
    PyBuffer_Release(&gradient);
    PyBuffer_Release(&samples);
    return result;
}

/* The noise window alone (block_noise over every block): for the rules without a compiled pass. */
__attribute__((target_clones("avx2", "default"))) static void
noise_pass(const float *restrict u, float *restrict w, Py_ssize_t n, Py_ssize_t wstride, int mode, Sums *restrict sums)
{
    SampleCursor cursor = {0, 0};
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        block_noise(u + start, w, start, length, wstride, mode, &cursor, sums);
    }
}

static PyObject *
noise_window(PyObject *self, PyObject *args)
{
    Py_buffer update, window;
    Py_ssize_t wstride;
    int mode;
    if (!PyArg_ParseTuple(args, "y*w*ni", &update, &window, &wstride, &mode)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = update.len / (Py_ssize_t)sizeof(float);
    if (update.len % (Py_ssize_t)sizeof(float) || wstride < 1 ||
        window.len != window_size(n, wstride) * (Py_ssize_t)sizeof(float) || update.buf == window.buf ||
        mode < WINDOW_START || mode > WINDOW_LAST) {
        PyErr_SetString(PyExc_ValueError,
                        "noise_window: float32 buffers, the window of the sample's size, and a mode 0..2");
    } else {
        Sums sums = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0f, 0.0f, 0.0, 0.0};
        MAYBE_RELEASE_GIL(window_size(n, wstride));
        noise_pass((const float *)update.buf, (float *)window.buf, n, wstride, mode, &sums);
        MAYBE_RESTORE_GIL()
        result = Py_BuildValue("(dd)", sums.payload_square, sums.window_square);
    }
    PyBuffer_Release(&update);
    PyBuffer_Release(&window);
    return result;
}

/* max |x| over the values, or NaN/Inf when one is NaN or +-Inf (a NaN is kept by the sum of
 * x - x, which a maximum would skip). One pass: the payload's finiteness check and its peak. */
__attribute__((target_clones("avx2", "default"))) static float
peak_of(const float *restrict values, Py_ssize_t n)
{
    float peak = 0.0f;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t end = start + BLOCK < n ? start + BLOCK : n;
        float sum = 0.0f, block_peak = 0.0f;
#pragma omp simd reduction(+ : sum) reduction(max : block_peak)
        for (Py_ssize_t j = start; j < end; j++) {
            sum += values[j] - values[j];
            const float size = fabsf(values[j]);
            block_peak = size > block_peak ? size : block_peak; /* a ternary vectorises, fmaxf not */
        }
        if (sum != 0.0f) {
            return sum; /* NaN */
        }
        peak = fmaxf(peak, block_peak);
    }
    return peak;
}

static PyObject *
max_abs(PyObject *self, PyObject *args)
{
    Py_buffer values;
    if (!PyArg_ParseTuple(args, "y*", &values)) {
        return NULL;
    }
    const Py_ssize_t n = values.len / (Py_ssize_t)sizeof(float);
    float peak;
    MAYBE_RELEASE_GIL(n);
    peak = peak_of((const float *)values.buf, n);
    MAYBE_RESTORE_GIL()
    PyBuffer_Release(&values);
    return PyFloat_FromDouble((double)peak);
}

/* peak_of() of `src` while it is copied to `dst`: one pass (a payload taken out of memory its
 * sender can still write, then checked where the sender cannot reach it). */
__attribute__((target_clones("avx2", "default"))) static float
copy_peak_of(const float *restrict src, float *restrict dst, Py_ssize_t n)
{
    float peak = 0.0f, sum = 0.0f;
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t end = start + BLOCK < n ? start + BLOCK : n;
        float block_peak = 0.0f;
#pragma omp simd reduction(+ : sum) reduction(max : block_peak)
        for (Py_ssize_t j = start; j < end; j++) {
            const float value = src[j];
            dst[j] = value;
            sum += value - value;
            const float size = fabsf(value);
            block_peak = size > block_peak ? size : block_peak;
        }
        peak = fmaxf(peak, block_peak);
    }
    return sum != 0.0f ? sum : peak; /* NaN when a value is not finite */
}

static PyObject *
copy_max_abs(PyObject *self, PyObject *args)
{
    Py_buffer source, target;
    if (!PyArg_ParseTuple(args, "y*w*", &source, &target)) {
        return NULL;
    }
    PyObject *result = NULL;
    if (source.len != target.len || source.len % (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "copy_max_abs: buffers of different sizes, or not of float32");
    } else {
        float peak;
        const Py_ssize_t n = source.len / (Py_ssize_t)sizeof(float);
        MAYBE_RELEASE_GIL(n);
        peak = copy_peak_of((const float *)source.buf, (float *)target.buf, n);
        MAYBE_RESTORE_GIL()
        result = PyFloat_FromDouble((double)peak);
    }
    PyBuffer_Release(&source);
    PyBuffer_Release(&target);
    return result;
}

/* The k-th smallest of values[0..n) (0-based), by Hoare's selection in place: O(n). */
static float
select_kth(float *values, Py_ssize_t n, Py_ssize_t k)
{
    Py_ssize_t low = 0, high = n - 1;
    while (low < high) {
        const float pivot = values[low + (high - low) / 2];
        Py_ssize_t i = low, j = high;
        while (i <= j) {
            while (values[i] < pivot) {
                i++;
            }
            while (values[j] > pivot) {
                j--;
            }
            if (i <= j) {
                const float swap = values[i];
                values[i] = values[j];
                values[j] = swap;
                i++;
                j--;
            }
        }
        if (k <= j) {
            high = j;
        } else if (k >= i) {
            low = i;
        } else {
            return values[k];
        }
    }
    return values[k];
}

static PyObject *
median_in_place(PyObject *self, PyObject *args)
{
    Py_buffer values;
    if (!PyArg_ParseTuple(args, "w*", &values)) {
        return NULL;
    }
    const Py_ssize_t n = values.len / (Py_ssize_t)sizeof(float);
    double middle = 0.0;
    float *data = (float *)values.buf; /* at most a sample of 8,192: the GIL kept (see RELEASE_GIL_FROM) */
    /* pi is mostly clamped with several workers (at 0 or pi_max): when one extreme holds more
     * than half the values it is the median (both middle values, for an even count), and one
     * pass finds it; the selection below costs several times that. */
    float low = n > 0 ? data[0] : 0.0f, high = low;
    Py_ssize_t lows = 0, highs = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const float value = data[j];
        if (value < low) {
            low = value;
            lows = 0;
        }
        if (value > high) {
            high = value;
            highs = 0;
        }
        lows += value == low;
        highs += value == high;
    }
    if (lows > n / 2) {
        middle = low;
    } else if (highs > n / 2) {
        middle = high;
    } else if (n > 0) {
        const float upper = select_kth(data, n, n / 2);
        if (n % 2) {
            middle = upper;
        } else { /* the lower middle: the largest of the n/2 values select_kth left below it */
            float lower = data[0];
            for (Py_ssize_t j = 1; j < n / 2; j++) {
                lower = data[j] > lower ? data[j] : lower;
            }
            middle = ((double)lower + (double)upper) / 2.0;
        }
    }
    PyBuffer_Release(&values);
    return PyFloat_FromDouble(middle);
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
    MAYBE_RELEASE_GIL(n);
    ok = every_finite((const float *)values.buf, n);
    MAYBE_RESTORE_GIL()
    PyBuffer_Release(&values);
    return PyBool_FromLong(ok);
}

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
     "stride, samples, mirror=None, window=None, window_stride=1, mode=0)\n"
     "GEM's update: in place when theta_out is None, else into theta_out and proxy_out (the inputs only read;\n"
     "outputs partial when not finite). Returns (1 if every new value is finite else 0, sum of pi, count at 0,\n"
     "count at pi_max, sum of kappa*|m|, sum of |theta - s| + pi*(|Delta| + eps), max |new theta|, max |new m|,\n"
     "|update|^2, |window sum|^2: noise_window's, in the same pass, when a window is given, else 0, 0, count of\n"
     "Delta != 0) and writes pi at every stride-th parameter to samples (NaN where Delta = 0: pi's sums and counts\n"
     "leave those out); the new theta also to mirror (a buffer of its own)."},
    {"compact_gem_update", compact_gem_update, METH_VARARGS,
     "compact_gem_update(theta, proxy_codes, proxy_scales, offset_codes, offset_scales, reference_read,\n"
     "reference_write, update, scale, momentum, kappa, pi_max, epsilon, excluded, write, stride, samples, mirror=None,\n"
     "window=None, window_stride=1, mode=0)\n"
     "GEM on compact state (_compact_gem.c), in place; write=0 only checks. Returns gem_update's tuple with max\n"
     "|new offset| after max |new m|."},
    {"compact_rebase", compact_rebase, METH_VARARGS,
     "compact_rebase(offset_codes, offset_scales, reference_from, reference_to) -> max |offset|: the offset\n"
     "re-encoded against another reference, in place."},
    {"compact_kernel", compact_kernel, METH_VARARGS,
     "compact_kernel(name=None) -> (the variant compact_gem_update runs, the variants this CPU runs): avx512,\n"
     "avx2 or baseline, the best supported by default; a name given chooses it (they write the same bytes)."},
    {"compact_encode", compact_encode, METH_VARARGS,
     "compact_encode(float32 values, uint8 codes, float32 scales) -> the largest block peak: block_codes.encode."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_native", "The server's compiled loops.", -1, methods};

PyMODINIT_FUNC
PyInit__native(void)
{
    compact_codes_init();
    return PyModule_Create(&module);
}
