/* The adamw rule's passes (domain/rules/adamw.py): a gradient added to the round's sum, and the
 * AdamW step that closes a round (with the round's last gradient added on the way), each one pass
 * over the parameters that also finds the peaks the rule checks for overflow. numpy took 4 passes
 * for the first and about 15, with 6 temporaries of P values, for the second (docs/PERFORMANCE.md).
 * Each value is computed with numpy's float32 operations in numpy's order (-ffp-contract=off: no
 * fused multiply-add), so both write the same bits (tests/unit/test_adamw_kernel.py). A pass may
 * write in place (an output the very buffer of its own input: the rule's bounds showed that no
 * value can overflow). */
#include "module.h"

/* A pass's peaks: max |x| of each output, and the sum of x - x, which only a value that is not
 * finite makes other than 0 (checks.c's peak_of does the same). */
typedef struct {
    float peak[3], nonfinite[3];
} Peaks;

static double
peak_or_nan(const Peaks *peaks, int which)
{
    return peaks->nonfinite[which] != 0.0f ? (double)NAN : (double)peaks->peak[which];
}

/* [a, a + n) and [b, b + n) share a byte */
static int
overlap(const Py_buffer *a, const Py_buffer *b)
{
    const char *x = (const char *)a->buf, *y = (const char *)b->buf;
    return a->len && b->len && x < y + b->len && y < x + a->len;
}

/* No output shares a byte with another output or an input, but for output i and input own[i]
 * (-1: none), which may be one buffer (the pass reads each value before it writes it). */
static int
apart(Py_buffer *const *outputs, const int *own, int outs, Py_buffer *const *inputs, int ins)
{
    for (int i = 0; i < outs; i++) {
        for (int j = 0; j < ins; j++) {
            const int same = j == own[i] && outputs[i]->buf == inputs[j]->buf && outputs[i]->len == inputs[j]->len;
            if (!same && overlap(outputs[i], inputs[j])) {
                return 0;
            }
        }
        for (int j = i + 1; j < outs; j++) {
            if (overlap(outputs[i], outputs[j])) {
                return 0;
            }
        }
    }
    return 1;
}

/* out = total + g (or total - g: an update enters as the pseudo-gradient -Delta; a + (-1 * b) is
 * a - b to the bit in IEEE arithmetic), and its peak; out may be total. bound >= 0: g may still be
 * written by its sender (a client's shared memory), each value read once within it (held_block). */
__attribute__((target_clones("avx2", "default"))) static void
sum_pass(const float *total, const float *g, float *out, Py_ssize_t n, int subtract, float bound, Peaks *peaks)
{
    const float sign = subtract ? -1.0f : 1.0f;
    float peak = 0.0f, nonfinite = 0.0f, held[BLOCK];
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        const float *restrict read = held_block(g + start, length, bound, held), *sums = total + start;
        float *written = out + start, block_peak = 0.0f;
#pragma omp simd reduction(+ : nonfinite) reduction(max : block_peak)
        for (Py_ssize_t j = 0; j < length; j++) {
            const float value = sums[j] + sign * read[j];
            written[j] = value;
            nonfinite += value - value;
            const float size = fabsf(value);
            block_peak = size > block_peak ? size : block_peak;
        }
        peak = fmaxf(peak, block_peak);
    }
    peaks->peak[0] = peak;
    peaks->nonfinite[0] = nonfinite;
}

PyObject *
adamw_sum(PyObject *self, PyObject *args)
{
    Py_buffer total, gradient, out;
    int subtract;
    float bound = -1.0f; /* >= 0: the gradient held within it */
    if (!PyArg_ParseTuple(args, "y*y*w*p|f", &total, &gradient, &out, &subtract, &bound)) {
        return NULL;
    }
    PyObject *result = NULL;
    Py_buffer *const inputs[2] = {&total, &gradient}, *const outputs[1] = {&out};
    const int own[1] = {0};
    if (total.len != gradient.len || total.len != out.len || total.len % (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "adamw_sum: float32 buffers of one size");
    } else if (!apart(outputs, own, 1, inputs, 2)) {
        PyErr_SetString(PyExc_ValueError, "adamw_sum: the output is the sum's own buffer or apart from both");
    } else {
        Peaks peaks = {{0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f}};
        const Py_ssize_t n = total.len / (Py_ssize_t)sizeof(float);
        MAYBE_RELEASE_GIL(n);
        sum_pass((const float *)total.buf, (const float *)gradient.buf, (float *)out.buf, n, subtract, bound,
                 &peaks);
        MAYBE_RESTORE_GIL()
        result = PyFloat_FromDouble(peak_or_nan(&peaks, 0));
    }
    PyBuffer_Release(&total);
    PyBuffer_Release(&gradient);
    PyBuffer_Release(&out);
    return result;
}

/* The step's float32 coefficients, as the rule computes them (rules/adamw.py: coefficients). */
typedef struct {
    float divisor, beta1, rest1, beta2, rest2, bias2_root, epsilon, step_size;
} Coefficients;

/* The round's sum (with the last gradient added: total + sign * g; g NULL: total alone) and the
 * step's inputs and outputs. */
typedef struct {
    const float *total, *g, *m, *v, *theta;
    float *m_out, *v_out, *theta_out;
    float sign, bound; /* bound >= 0: g held within it (held_block) */
} Step;

/* One AdamW step over [start, end), theta multiplied by `decay` (1: not decayed):
 *   mean = (total + sign*g) / divisor;  m' = m*b1 + (1-b1)*mean;  v' = v*b2 + ((1-b2)*mean)*mean;
 *   theta' = theta*decay - (step_size*m') / (sqrt(v') / bias2_root + eps)
 * (numpy's order, rules/adamw.py _adamw_numpy), each output's peak into `peaks`. */
__attribute__((target_clones("avx2", "default"))) static void
step_pass(const Step *s, Py_ssize_t start, Py_ssize_t end, float decay, const Coefficients *c, Peaks *peaks)
{
    const float divisor = c->divisor, beta1 = c->beta1, rest1 = c->rest1, beta2 = c->beta2, rest2 = c->rest2;
    const float bias2_root = c->bias2_root, epsilon = c->epsilon, step_size = c->step_size, sign = s->sign;
    float zeros[BLOCK], held[BLOCK];
    if (s->g == NULL) { /* no gradient to add: t + (-0) is t, bit for bit (and +0 would make -0 of it +0) */
        for (Py_ssize_t j = 0; j < BLOCK; j++) {
            zeros[j] = -0.0f;
        }
    }
    for (Py_ssize_t block = start; block < end; block += BLOCK) {
        const Py_ssize_t length = block + BLOCK < end ? BLOCK : end - block;
        const float *restrict g = s->g == NULL ? zeros : held_block(s->g + block, length, s->bound, held);
        const float *total = s->total + block, *m = s->m + block, *v = s->v + block, *theta = s->theta + block;
        float *m_out = s->m_out + block, *v_out = s->v_out + block, *theta_out = s->theta_out + block;
        float peak_m = 0.0f, peak_v = 0.0f, peak_t = 0.0f, bad_m = 0.0f, bad_v = 0.0f, bad_t = 0.0f;
#pragma omp simd reduction(+ : bad_m, bad_v, bad_t) reduction(max : peak_m, peak_v, peak_t)
        for (Py_ssize_t j = 0; j < length; j++) {
            const float sum = total[j] + sign * g[j];
            const float mean = sum / divisor;
            const float first = m[j] * beta1 + rest1 * mean;
            const float second = v[j] * beta2 + (rest2 * mean) * mean;
            const float denominator = sqrtf(second) / bias2_root + epsilon;
            const float updated = theta[j] * decay - (step_size * first) / denominator;
            m_out[j] = first;
            v_out[j] = second;
            theta_out[j] = updated;
            bad_m += first - first;
            bad_v += second - second;
            bad_t += updated - updated;
            const float size_m = fabsf(first), size_v = fabsf(second), size_t_ = fabsf(updated);
            peak_m = size_m > peak_m ? size_m : peak_m;
            peak_v = size_v > peak_v ? size_v : peak_v;
            peak_t = size_t_ > peak_t ? size_t_ : peak_t;
        }
        peaks->peak[0] = fmaxf(peaks->peak[0], peak_m);
        peaks->peak[1] = fmaxf(peaks->peak[1], peak_v);
        peaks->peak[2] = fmaxf(peaks->peak[2], peak_t);
        peaks->nonfinite[0] += bad_m;
        peaks->nonfinite[1] += bad_v;
        peaks->nonfinite[2] += bad_t;
    }
}

/* The ranges decayed: sorted, disjoint pairs (low, high) of int64 within [0, n]. */
static int
valid_ranges(const Py_buffer *ranges, Py_ssize_t n)
{
    if (ranges->len % (Py_ssize_t)(2 * sizeof(int64_t))) {
        return 0;
    }
    const int64_t *bounds = (const int64_t *)ranges->buf;
    int64_t previous = 0;
    for (Py_ssize_t i = 0; i < ranges->len / (Py_ssize_t)sizeof(int64_t); i++) {
        if (bounds[i] < previous || bounds[i] > n) {
            return 0;
        }
        previous = bounds[i];
    }
    return 1;
}

/* The step over [0, n): theta decayed everywhere (decay_all), or only inside the ranges (between
 * them x * 1 is x, bit for bit). */
static void
step_ranges(const Step *s, Py_ssize_t n, float decay, int decay_all, const int64_t *bounds, Py_ssize_t pairs,
            const Coefficients *c, Peaks *peaks)
{
    if (decay_all) {
        step_pass(s, 0, n, decay, c, peaks);
        return;
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < pairs; i++) {
        step_pass(s, at, bounds[2 * i], 1.0f, c, peaks);
        step_pass(s, bounds[2 * i], bounds[2 * i + 1], decay, c, peaks);
        at = bounds[2 * i + 1];
    }
    step_pass(s, at, n, 1.0f, c, peaks);
}

PyObject *
adamw_step(PyObject *self, PyObject *args)
{
    Py_buffer total, g, m, v, theta, m_out, v_out, theta_out, ranges;
    Coefficients c;
    float decay;
    int subtract, decay_all;
    Step s;
    s.bound = -1.0f;
    if (!PyArg_ParseTuple(args, "y*y*py*y*y*w*w*w*(ffffffff)fpy*|f", &total, &g, &subtract, &m, &v, &theta,
                          &m_out, &v_out, &theta_out, &c.divisor, &c.beta1, &c.rest1, &c.beta2, &c.rest2,
                          &c.bias2_root, &c.epsilon, &c.step_size, &decay, &decay_all, &ranges, &s.bound)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t len = total.len, n = len / (Py_ssize_t)sizeof(float);
    Py_buffer *const inputs[5] = {&total, &g, &m, &v, &theta}, *const outputs[3] = {&m_out, &v_out, &theta_out};
    const int own[3] = {2, 3, 4}; /* m' may be m, v' v, theta' theta */
    if ((g.len && g.len != len) || m.len != len || v.len != len || theta.len != len || m_out.len != len || v_out.len != len ||
        theta_out.len != len || len % (Py_ssize_t)sizeof(float) || !valid_ranges(&ranges, n)) {
        PyErr_SetString(PyExc_ValueError,
                        "adamw_step: float32 buffers of one size (the gradient may be empty: none), and the ranges "
                        "decayed as sorted int64 pairs");
    } else if (!apart(outputs, own, 3, inputs, 5)) {
        PyErr_SetString(PyExc_ValueError,
                        "adamw_step: each output its input's own buffer (m, v, theta) or apart from every other");
    } else {
        Peaks peaks = {{0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f}};
        s.total = (const float *)total.buf, s.g = g.len ? (const float *)g.buf : NULL;
        s.sign = subtract ? -1.0f : 1.0f;
        s.m = (const float *)m.buf, s.v = (const float *)v.buf, s.theta = (const float *)theta.buf;
        s.m_out = (float *)m_out.buf, s.v_out = (float *)v_out.buf, s.theta_out = (float *)theta_out.buf;
        const Py_ssize_t pairs = ranges.len / (Py_ssize_t)(2 * sizeof(int64_t));
        MAYBE_RELEASE_GIL(n);
        step_ranges(&s, n, decay, decay_all, (const int64_t *)ranges.buf, pairs, &c, &peaks);
        MAYBE_RESTORE_GIL()
        result = Py_BuildValue("(ddd)", peak_or_nan(&peaks, 0), peak_or_nan(&peaks, 1), peak_or_nan(&peaks, 2));
    }
    Py_buffer *const all[9] = {&total, &g, &m, &v, &theta, &m_out, &v_out, &theta_out, &ranges};
    for (int i = 0; i < 9; i++) {
        PyBuffer_Release(all[i]);
    }
    return result;
}
