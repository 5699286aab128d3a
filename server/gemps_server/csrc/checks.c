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

/* The largest of values[0..n) (n >= 1): after select_kth(values, ., k), the k-th's predecessor. */
static float
largest_of(const float *values, Py_ssize_t n)
{
    float largest = values[0];
    for (Py_ssize_t j = 1; j < n; j++) {
        largest = values[j] > largest ? values[j] : largest;
    }
    return largest;
}

/* The bracket: a spread sample of BRACKET_SAMPLE values, whose ranks BRACKET_SPREAD either side of
 * the k-th's place bound a range that holds the k-th value of all but rarely (the sample is
 * evenly spread, not random: where it is not representative the whole selection runs instead). */
#define BRACKET_SAMPLE 256
#define BRACKET_SPREAD 16
#define BRACKET_MOST 8192 /* rules/base.py's STATS_SAMPLE_SIZE: larger arrays take the selection */

/* The k-th smallest of data[0..n) (0-based) into *found and, with `lower`, the (k-1)-th (k >= 1),
 * as Floyd and Rivest select: one branch-free pass counts the values below a bracket of the
 * sample's and copies those inside it aside, and the selection runs on those few (about an
 * eighth). 1 when found; 0 when the bracket missed them (or n is out of its range), data as it was.
 * Hoare's selection over all n took 28-38 us of a 100K commit's 0.35 ms on 8 workers' pi (issue 80). */
static int
bracketed_kth(const float *data, Py_ssize_t n, Py_ssize_t k, float *found, float *lower)
{
    if (n > BRACKET_MOST || n < 4 * BRACKET_SAMPLE) {
        return 0;
    }
    float sample[BRACKET_SAMPLE];
    for (Py_ssize_t j = 0; j < BRACKET_SAMPLE; j++) {
        sample[j] = data[j * n / BRACKET_SAMPLE];
    }
    const Py_ssize_t place = k * BRACKET_SAMPLE / n;
    const Py_ssize_t top = place + BRACKET_SPREAD < BRACKET_SAMPLE ? place + BRACKET_SPREAD : BRACKET_SAMPLE - 1;
    const Py_ssize_t bottom = place > BRACKET_SPREAD ? place - BRACKET_SPREAD : 0;
    const float high = select_kth(sample, BRACKET_SAMPLE, top);
    const float low = select_kth(sample, top, bottom); /* sample[0..top) holds the values up to `high` */
    float inside[BRACKET_MOST];
    Py_ssize_t below = 0, kept = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        const float value = data[j];
        below += value < low;
        inside[kept] = value;
        kept += (value >= low) & (value <= high);
    }
    if (k < below + (lower != NULL) || k >= below + kept) {
        return 0;
    }
    const Py_ssize_t at = k - below;
    if (low == high) { /* every value inside is the one sought: pi clamped at 0 or pi_max, mostly */
        *found = low;
        if (lower != NULL) {
            *lower = low;
        }
        return 1;
    }
    *found = select_kth(inside, kept, at);
    if (lower != NULL) { /* the largest of the `at` values select_kth left below it */
        *lower = largest_of(inside, at);
    }
    return 1;
}

/* The median of data[0..n) (the mean of the two middle values for an even count), NaN-free;
 * may reorder the values. */
double
median_of(float *data, Py_ssize_t n)
{
    float upper, lower;
    if (bracketed_kth(data, n, n / 2, &upper, n % 2 ? NULL : &lower)) {
        return n % 2 ? (double)upper : ((double)lower + (double)upper) / 2.0;
    }
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
        upper = select_kth(data, n, n / 2);
        if (n % 2) {
            middle = upper;
        } else { /* the lower middle: the largest of the n/2 values select_kth left below it */
            middle = ((double)largest_of(data, n / 2) + (double)upper) / 2.0;
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
