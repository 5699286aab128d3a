/* GEM on compact per-worker state (`--gem-state compact`, rules/gem_compact.py), one pass a block.
 *
 * Worker i's m_i and s_i are not kept as float32: m_i as 8-bit codes against a scale per block
 * (rules/block_codes.py), and s_i as such codes of its offset from a reference theta R that the
 * rule shares between workers (s_i = R_g + offset_i, R_g the reference of the worker's generation).
 * Per parameter, as rules/gem_compact.py's numpy pass and in its order, each operation rounded to
 * float32 (no fused multiply-add):
 *
 *     Delta   = scale * u
 *     m       = mu * decode(m_i) + Delta
 *     c       = |theta - (R_read + decode(offset_i))|
 *     pi      = clip((kappa*|m| - c) / (|Delta| + eps), 0, pi_max)        (gem_pi, as the exact kernel)
 *     theta'  = theta + pi * Delta
 *     offset' = (theta, or theta' when the own step is excluded) - R_write
 *     m_i, offset_i <- encode(m), encode(offset')
 *
 * The pass goes a chunk of CODE_CHUNK values at a time (one build's function each), and a chunk a
 * block of CODE_BLOCK at a time. A block's new scales are set before its values are, so it encodes
 * as it goes (one pass, no scratch): m_i's is a bound on |m|, |mu| * its old scale + |scale| *
 * max |u| (at most 1/(1 - mu) of the largest |Delta| lately: the codes' relative precision does not depend on the scale, only
 * how far below it they reach); the offset's is max |theta - R_write| (the own step excluded: plus
 * pi_max * max |Delta|), both from a first look at the block's u, theta and R_write.
 *
 * `write` 0 is a dry run that only checks that every new value is finite (the rule runs one first
 * when its bounds cannot rule out an overflow, so a refused commit changes nothing); `write` 1
 * moves theta and the codes in place. The statistics, the reply's mirror and the noise window are
 * those of the exact kernel (shared.h).
 */
#include "compact_codes.h"

typedef struct {
    float offset_peak; /* the largest offset scale over the blocks written */
} CompactPeaks;

typedef struct {
    float scale, momentum, kappa, pi_max, epsilon;
    int amplify, excluded;
} Hyper;

/* A chunk's statistics summed by position in a block (lane k of every block into [k]): the blocks'
 * loops add vectors, and the horizontal sums are left to the chunk's end (done per block of 32 they
 * cost more than the block's arithmetic). */
typedef struct {
    float pi[CODE_BLOCK], proxy[CODE_BLOCK], central[CODE_BLOCK], at_zero[CODE_BLOCK], at_max[CODE_BLOCK];
    float moving[CODE_BLOCK], theta_peak[CODE_BLOCK];
} LaneSums;

/* A block's new scales, as gem_compact.py's numpy pass: m_i's bound and the offset's. */
static inline __attribute__((always_inline)) void
next_scales(const float *restrict bt, const float *restrict bw, const float *restrict bu, Py_ssize_t length,
            const Hyper *restrict h, float proxy_scale, float *restrict proxy_next, float *restrict offset_next)
{
    float update_peak = 0.0f, offset_peak = 0.0f;
#pragma omp simd reduction(max : update_peak, offset_peak)
    for (Py_ssize_t j = 0; j < length; j++) {
        const float update_size = fabsf(bu[j]), offset_size = fabsf(bt[j] - bw[j]);
        update_peak = update_size > update_peak ? update_size : update_peak;
        offset_peak = offset_size > offset_peak ? offset_size : offset_peak;
    }
    const float delta_peak = fabsf(h->scale) * update_peak;
    *proxy_next = fabsf(h->momentum) * proxy_scale + delta_peak;
    *offset_next = h->excluded ? offset_peak + h->pi_max * delta_peak : offset_peak;
}

/* One parameter, in the numpy pass's order (the terms each variant below uses). */
#define COMPACT_PARAMETER                                                                                        \
    const float delta = scale * bu[j];                                                                           \
    float m = decode_code(bpc[j]) * proxy_scale;                                                                 \
    m = momentum * m;                                                                                            \
    m = m + delta;                                                                                               \
    const float seen = br[j] + decode_code(boc[j]) * offset_scale;                                               \
    const float current = bt[j];                                                                                 \
    const float movement = fabsf(current - seen);                                                                \
    float proxy_term, denominator;                                                                               \
    const float pi = gem_pi(m, movement, delta, kappa, amplify, epsilon, pi_max, &proxy_term, &denominator);     \
    const float step = pi * delta;                                                                               \
    const float moved = current + step;                                                                          \
    const float moved_offset = (excluded ? moved : current) - bw[j];

#define HYPER_LOCALS                                                                                             \
    const float scale = h->scale, momentum = h->momentum, kappa = h->kappa, pi_max = h->pi_max,                  \
                epsilon = h->epsilon;                                                                            \
    const int amplify = h->amplify, excluded = h->excluded;

/* One block's update: its new scales (over its old ones in `ps` and `os`), then theta and the codes
 * against them, pi kept for the median's sample and the statistics added to `lanes`; the new scales
 * are returned for the chunk's peaks. Inlined into each build, and called with `count` CODE_BLOCK
 * for every full block so that the compiler unrolls its loops. */
static inline __attribute__((always_inline)) void
update_block(float *restrict bt, uint8_t *restrict bpc, float *restrict ps, uint8_t *restrict boc,
             float *restrict os, const float *restrict br, const float *restrict bw, const float *restrict bu,
             Py_ssize_t first, Py_ssize_t count, const Hyper *restrict h, float *restrict pis,
             LaneSums *restrict lanes, float *restrict proxy_new, float *restrict offset_new)
{
    HYPER_LOCALS
    const Py_ssize_t block = first / CODE_BLOCK;
    const float proxy_scale = ps[block], offset_scale = os[block];
    float proxy_next, offset_next;
    next_scales(bt + first, bw + first, bu + first, count, h, proxy_scale, &proxy_next, &offset_next);
    const float proxy_reciprocal = reciprocal_of(proxy_next), offset_reciprocal = reciprocal_of(offset_next);
#pragma omp simd
    for (Py_ssize_t k = 0; k < count; k++) {
        const Py_ssize_t j = first + k;
        COMPACT_PARAMETER
        bt[j] = moved;
        bpc[j] = encode_code(m, proxy_reciprocal);
        boc[j] = encode_code(moved_offset, offset_reciprocal);
        const int moves = delta != 0.0f; /* pi's statistics leave out what the commit does not move */
        pis[j] = moves ? pi : NAN;
        const float theta_size = fabsf(moved);
        lanes->theta_peak[k] = theta_size > lanes->theta_peak[k] ? theta_size : lanes->theta_peak[k];
        lanes->pi[k] += moves ? pi : 0.0f;
        lanes->moving[k] += moves ? 1.0f : 0.0f;
        lanes->proxy[k] += proxy_term;
        lanes->central[k] += movement + pi * denominator;
        lanes->at_zero[k] += moves && pi <= 0.0f ? 1.0f : 0.0f;
        lanes->at_max[k] += moves && pi >= pi_max ? 1.0f : 0.0f;
    }
    ps[block] = proxy_next;
    os[block] = offset_next;
    *proxy_new = proxy_next;
    *offset_new = offset_next;
}

/* A chunk's update in place, block by block (update_block); its statistics and max |theta'| added to
 * `sums`, and its largest new scales into *proxy_peak and *offset_peak. */
#define UPDATE_CHUNK(SUFFIX, TARGET)                                                                               \
    TARGET static void update_chunk_##SUFFIX(                                                                      \
        float *restrict bt, uint8_t *restrict bpc, float *restrict ps, uint8_t *restrict boc, float *restrict os,  \
        const float *restrict br, const float *restrict bw, const float *restrict bu, Py_ssize_t length,           \
        const Hyper *restrict h, float *restrict pis, Sums *restrict sums, float *restrict proxy_peak,             \
        float *restrict offset_peak)                                                                               \
    {                                                                                                              \
        LaneSums lanes;                                                                                            \
        memset(&lanes, 0, sizeof lanes);                                                                           \
        float proxy_high = 0.0f, offset_high = 0.0f, proxy_next, offset_next;                                      \
        for (Py_ssize_t first = 0; first < length; first += CODE_BLOCK) {                                          \
            if (first + CODE_BLOCK <= length) {                                                                    \
                update_block(bt, bpc, ps, boc, os, br, bw, bu, first, CODE_BLOCK, h, pis, &lanes, &proxy_next,     \
                             &offset_next);                                                                        \
            } else {                                                                                               \
                update_block(bt, bpc, ps, boc, os, br, bw, bu, first, length - first, h, pis, &lanes, &proxy_next, \
                             &offset_next);                                                                        \
            }                                                                                                      \
            proxy_high = proxy_next > proxy_high ? proxy_next : proxy_high;                                        \
            offset_high = offset_next > offset_high ? offset_next : offset_high;                                   \
        }                                                                                                          \
        float pi_sum = 0.0f, proxy_sum = 0.0f, central_sum = 0.0f, at_zero = 0.0f, at_max = 0.0f, moving = 0.0f;   \
        float theta_peak = 0.0f;                                                                                   \
        for (Py_ssize_t k = 0; k < CODE_BLOCK; k++) {                                                              \
            pi_sum += lanes.pi[k];                                                                                 \
            proxy_sum += lanes.proxy[k];                                                                           \
            central_sum += lanes.central[k];                                                                       \
            at_zero += lanes.at_zero[k];                                                                           \
            at_max += lanes.at_max[k];                                                                             \
            moving += lanes.moving[k];                                                                             \
            theta_peak = lanes.theta_peak[k] > theta_peak ? lanes.theta_peak[k] : theta_peak;                      \
        }                                                                                                          \
        sums->pi_sum += pi_sum;                                                                                    \
        sums->proxy_energy += proxy_sum;                                                                           \
        sums->central_energy += central_sum;                                                                       \
        sums->at_zero += at_zero;                                                                                  \
        sums->at_max += at_max;                                                                                    \
        sums->moving += moving;                                                                                    \
        sums->theta_peak = theta_peak > sums->theta_peak ? theta_peak : sums->theta_peak;                          \
        *proxy_peak = proxy_high;                                                                                  \
        *offset_peak = offset_high;                                                                                \
    }

/* The same values, only checked: 1 when every new theta, m_i and offset of the chunk is finite. */
#define CHECK_CHUNK(SUFFIX, TARGET)                                                                                \
    TARGET static int check_chunk_##SUFFIX(const float *restrict bt, const uint8_t *restrict bpc,                  \
                                           const float *restrict ps, const uint8_t *restrict boc,                  \
                                           const float *restrict os, const float *restrict br,                     \
                                           const float *restrict bw, const float *restrict bu, Py_ssize_t length,  \
                                           const Hyper *restrict h)                                                \
    {                                                                                                              \
        HYPER_LOCALS                                                                                               \
        float bad = 0.0f;                                                                                          \
        for (Py_ssize_t first = 0; first < length; first += CODE_BLOCK) {                                          \
            const Py_ssize_t last = first + CODE_BLOCK < length ? first + CODE_BLOCK : length;                     \
            const float proxy_scale = ps[first / CODE_BLOCK], offset_scale = os[first / CODE_BLOCK];               \
            _Pragma("omp simd reduction(+ : bad)")                                                                 \
            for (Py_ssize_t j = first; j < last; j++) {                                                            \
                COMPACT_PARAMETER                                                                                  \
                bad += (moved - moved) + (m - m) + (moved_offset - moved_offset); /* 0 while all are finite */     \
            }                                                                                                      \
        }                                                                                                          \
        return bad == 0.0f;                                                                                        \
    }

/* Each built for AVX-512 (512-bit vectors: this pass is bound by its arithmetic, and gcc's own choice
 * of 256-bit ones for AVX-512 machines costs it a fifth), AVX2 and the x86-64 baseline, one picked
 * when the module loads. Their own functions, dispatched once a block: inlined into the pass, gcc
 * did not vectorise them. All round every operation alike: the same bytes whichever runs. */
#define VARIANTS(MAKE)                                                                                             \
    MAKE(avx512, __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"), noinline))) \
    MAKE(avx2, __attribute__((target("avx2"), noinline)))                                                         \
    MAKE(baseline, __attribute__((noinline)))
VARIANTS(UPDATE_CHUNK)
VARIANTS(CHECK_CHUNK)

typedef void (*UpdateChunk)(float *restrict, uint8_t *restrict, float *restrict, uint8_t *restrict, float *restrict,
                            const float *restrict, const float *restrict, const float *restrict, Py_ssize_t,
                            const Hyper *restrict, float *restrict, Sums *restrict, float *restrict,
                            float *restrict);
typedef int (*CheckChunk)(const float *restrict, const uint8_t *restrict, const float *restrict,
                          const uint8_t *restrict, const float *restrict, const float *restrict, const float *restrict,
                          const float *restrict, Py_ssize_t, const Hyper *restrict);
static int
runs_avx512(void)
{
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

static int
runs_avx2(void)
{
    return __builtin_cpu_supports("avx2");
}

static int
runs_baseline(void)
{
    return 1;
}

static const struct {
    const char *name;
    UpdateChunk update;
    CheckChunk check;
    int (*runs)(void); /* whether this CPU has what it was built for */
} VARIANT_TABLE[] = {
    {"avx512", update_chunk_avx512, check_chunk_avx512, runs_avx512},
    {"avx2", update_chunk_avx2, check_chunk_avx2, runs_avx2},
    {"baseline", update_chunk_baseline, check_chunk_baseline, runs_baseline},
};
#define VARIANT_COUNT (sizeof VARIANT_TABLE / sizeof VARIANT_TABLE[0])
static size_t variant = VARIANT_COUNT - 1;

void
compact_codes_init(void)
{
    __builtin_cpu_init();
    for (variant = 0; !VARIANT_TABLE[variant].runs(); variant++) {
    }
}

PyObject *
compact_kernel(PyObject *self, PyObject *args)
{
    const char *name = NULL;
    if (!PyArg_ParseTuple(args, "|z", &name)) {
        return NULL;
    }
    if (name != NULL) {
        size_t found = 0;
        while (found < VARIANT_COUNT && strcmp(VARIANT_TABLE[found].name, name) != 0) {
            found++;
        }
        if (found == VARIANT_COUNT || !VARIANT_TABLE[found].runs()) {
            PyErr_Format(PyExc_ValueError, "compact_kernel: %s is not one this CPU runs", name);
            return NULL;
        }
        variant = found;
    }
    PyObject *names = PyList_New(0);
    for (size_t index = 0; names != NULL && index < VARIANT_COUNT; index++) {
        if (VARIANT_TABLE[index].runs()) {
            PyObject *each = PyUnicode_FromString(VARIANT_TABLE[index].name);
            if (each == NULL || PyList_Append(names, each) < 0) {
                Py_XDECREF(each);
                Py_CLEAR(names);
                break;
            }
            Py_DECREF(each);
        }
    }
    return names == NULL ? NULL : Py_BuildValue("(sN)", VARIANT_TABLE[variant].name, names);
}

__attribute__((target_clones("avx2", "default"))) static int
compact_pass(float *restrict t, uint8_t *restrict pc, float *restrict ps, uint8_t *restrict oc, float *restrict os,
             const float *restrict r_read, const float *restrict r_write, const float *restrict u, Py_ssize_t n,
             const Hyper *restrict h, int write, Py_ssize_t stride, float *restrict sampled, Sums *restrict sums,
             CompactPeaks *restrict peaks, float *restrict mirror, float *restrict window, Py_ssize_t wstride, int mode,
             float *restrict pis)
{
    SampleCursor cursor = {0, 0};
    for (Py_ssize_t start = 0; start < n; start += CODE_CHUNK) {
        const Py_ssize_t length = start + CODE_CHUNK < n ? CODE_CHUNK : n - start, block = start / CODE_BLOCK;
        float *restrict bt = t + start;
        const float *restrict bu = u + start, *restrict br = r_read + start, *restrict bw = r_write + start;
        if (!write) { /* a dry run: is every new value finite? (nothing written) */
            if (!VARIANT_TABLE[variant].check(bt, pc + start, ps + block, oc + start, os + block, br, bw, bu, length,
                                              h)) {
                return 0;
            }
            continue;
        }
        float proxy_peak, offset_peak;
        VARIANT_TABLE[variant].update(bt, pc + start, ps + block, oc + start, os + block, br, bw, bu, length, h,
                                      pis, sums, &proxy_peak, &offset_peak);
        sums->proxy_peak = proxy_peak > sums->proxy_peak ? proxy_peak : sums->proxy_peak;
        peaks->offset_peak = offset_peak > peaks->offset_peak ? offset_peak : peaks->offset_peak;
        for (Py_ssize_t k = ((start + stride - 1) / stride) * stride; k < start + length; k += stride) {
            sampled[k / stride] = pis[k - start];
        }
        if (mirror != NULL) {
            memcpy(mirror + start, bt, (size_t)length * sizeof(float));
        }
        if (window != NULL) {
            block_noise(bu, window, start, length, wstride, mode, &cursor, sums);
        }
    }
    return 1;
}

PyObject *
compact_gem_update(PyObject *self, PyObject *args)
{
    Py_buffer theta, pc, ps, oc, os, r_read, r_write, update, samples, mirror, window;
    PyObject *mirror_object = Py_None, *window_object = Py_None;
    float scale, momentum, kappa, pi_max, epsilon;
    int excluded, write, mode = WINDOW_START;
    Py_ssize_t stride, wstride = 1;
    if (!PyArg_ParseTuple(args, "w*w*w*w*w*y*y*y*fffffiinw*|OOni", &theta, &pc, &ps, &oc, &os, &r_read, &r_write,
                          &update, &scale, &momentum, &kappa, &pi_max, &epsilon, &excluded, &write, &stride,
                          &samples, &mirror_object, &window_object, &wstride, &mode)) {
        return NULL;
    }
    PyObject *result = NULL;
    int have_mirror = 0, have_window = 0;
    if (mirror_object != Py_None) {
        if (PyObject_GetBuffer(mirror_object, &mirror, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        have_mirror = 1;
    }
    if (window_object != Py_None) {
        if (PyObject_GetBuffer(window_object, &window, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            goto done;
        }
        have_window = 1;
    }
    const Py_ssize_t n = theta.len / (Py_ssize_t)sizeof(float);
    if (theta.len % (Py_ssize_t)sizeof(float) || !sizes_fit(n, &pc, &ps) || !sizes_fit(n, &oc, &os) ||
        r_read.len != theta.len || r_write.len != theta.len || update.len != theta.len || stride < 1 ||
        (have_mirror && mirror.len != theta.len) || wstride < 1 || mode < WINDOW_START || mode > WINDOW_LAST ||
        (have_window && window.len != window_size(n, wstride) * (Py_ssize_t)sizeof(float)) ||
        samples.len < ((n + stride - 1) / stride) * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "compact_gem_update: buffers of different sizes");
        goto done;
    }
    const void *written[] = {theta.buf, pc.buf, ps.buf, oc.buf, os.buf, have_mirror ? mirror.buf : NULL,
                             have_window ? window.buf : NULL};
    const void *read_only[] = {r_read.buf, r_write.buf, update.buf};
    for (int a = 0; a < 7; a++) {
        for (int b = 0; b < 7; b++) {
            if (a != b && written[a] != NULL && written[a] == written[b]) {
                PyErr_SetString(PyExc_ValueError, "compact_gem_update: the buffers it writes must be their own");
                goto done;
            }
        }
        for (int b = 0; b < 3; b++) {
            if (written[a] != NULL && written[a] == read_only[b]) {
                PyErr_SetString(PyExc_ValueError, "compact_gem_update: the buffers it writes must be their own");
                goto done;
            }
        }
    }
    float *scratch = PyMem_RawMalloc(CODE_CHUNK * sizeof(float)); /* pi of a chunk, for the median's sample */
    if (scratch == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Sums sums = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0f, 0.0f, 0.0, 0.0};
    CompactPeaks peaks = {0.0f};
    int finite;
    MAYBE_RELEASE_GIL(n);
    const Hyper hyper = {scale, momentum, kappa, pi_max, epsilon, kappa != 1.0f, excluded};
    finite = compact_pass((float *)theta.buf, (uint8_t *)pc.buf, (float *)ps.buf, (uint8_t *)oc.buf, (float *)os.buf,
                          (const float *)r_read.buf, (const float *)r_write.buf, (const float *)update.buf, n, &hyper,
                          write, stride, (float *)samples.buf, &sums, &peaks, have_mirror ? (float *)mirror.buf : NULL,
                          have_window ? (float *)window.buf : NULL, wstride, mode, scratch);
    MAYBE_RESTORE_GIL()
    PyMem_RawFree(scratch);
    result = Py_BuildValue("(idnndddddddn)", finite, sums.pi_sum, (Py_ssize_t)sums.at_zero, (Py_ssize_t)sums.at_max,
                           sums.proxy_energy, sums.central_energy, (double)sums.theta_peak, (double)sums.proxy_peak,
                           (double)peaks.offset_peak, sums.payload_square, sums.window_square, (Py_ssize_t)sums.moving);
done:
    if (have_mirror) {
        PyBuffer_Release(&mirror);
    }
    if (have_window) {
        PyBuffer_Release(&window);
    }
    PyBuffer_Release(&theta);
    PyBuffer_Release(&pc);
    PyBuffer_Release(&ps);
    PyBuffer_Release(&oc);
    PyBuffer_Release(&os);
    PyBuffer_Release(&r_read);
    PyBuffer_Release(&r_write);
    PyBuffer_Release(&update);
    PyBuffer_Release(&samples);
    return result;
}
