/* The server's compiled checks: a payload's finiteness and peak (also while copying it), pi's
 * median, and the gradient noise scale's window sums alone (for the rules without a compiled
 * pass); each one pass, without the GIL when long (RELEASE_GIL_FROM). */
#include "module.h"

/* A block of u as block_noise reads it: u itself, or (bound >= 0) the runs it samples, each value
 * read once within the bound (held_block) into `held` at its place in the block; no other value. */
static const float *
held_runs(const float *u, Py_ssize_t start, Py_ssize_t length, Py_ssize_t wstride, float bound,
          const SampleCursor *cursor, float *restrict held)
{
    if (bound < 0.0f || wstride == 1) {
        return held_block(u, length, bound, held);
    }
    for (Py_ssize_t at = cursor->at; at < start + length; at += wstride * NOISE_RUN) {
        const Py_ssize_t stop = at + NOISE_RUN < start + length ? at + NOISE_RUN : start + length;
        held_block(u + (at - start), stop - at, bound, held + (at - start));
    }
    return held;
}

/* The noise window alone (block_noise over every block): for the rules without a compiled pass.
 * bound >= 0: the payload lies in memory its sender can still write, and the values sampled are
 * read once each, within the bound (held_block), as the rule's pass read them. */
__attribute__((target_clones("avx2", "default"))) static void
noise_pass(const float *u, float *restrict w, Py_ssize_t n, Py_ssize_t wstride, int mode, float bound,
           Sums *restrict sums)
{
    SampleCursor cursor = {0, 0};
    float held[BLOCK];
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        if (wstride > 1 && cursor.at >= start + length) {
            continue; /* no sampled run in this block: block_noise would read none of it */
        }
        const float *bu = held_runs(u + start, start, length, wstride, bound, &cursor, held);
        block_noise(bu, w, start, length, wstride, mode, &cursor, sums);
    }
}

PyObject *
noise_window(PyObject *self, PyObject *args)
{
    Py_buffer update, window;
    Py_ssize_t wstride;
    int mode;
    float bound = -1.0f; /* >= 0: hold the payload's values within it (held_block) */
    if (!PyArg_ParseTuple(args, "y*w*ni|f", &update, &window, &wstride, &mode, &bound)) {
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
        noise_pass((const float *)update.buf, (float *)window.buf, n, wstride, mode, bound, &sums);
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

/* peak_of for the compiled commit core (core.c). */
float
peak_of_values(const float *values, Py_ssize_t n)
{
    return peak_of(values, n);
}

PyObject *
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

PyObject *
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

/* The median of data[0..n) (the mean of the two middle values for an even count), NaN-free;
 * reorders the values. */
double
median_of(float *data, Py_ssize_t n)
{
    double middle = 0.0;
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
    return middle;
}

PyObject *
median_in_place(PyObject *self, PyObject *args)
{
    Py_buffer values;
    if (!PyArg_ParseTuple(args, "w*", &values)) {
        return NULL;
    }
    /* at most a sample of 8,192: the GIL kept (see RELEASE_GIL_FROM) */
    const double middle = median_of((float *)values.buf, values.len / (Py_ssize_t)sizeof(float));
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

PyObject *
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
