/* What the server's compiled loops share (gem_exact.c: GEM's exact kernel; checks.c: the checks;
 * compact_gem.c: GEM on compact per-worker state): the GIL's release, the sums a pass
 * returns, the noise scale's window, pi from its terms, and a block's statistics. */
#ifndef GEMPS_NATIVE_SHARED_H
#define GEMPS_NATIVE_SHARED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <string.h>
#include <stdint.h>

/* The GIL is released around a pass over at least this many floats (1 MiB), and kept around a
 * shorter one: handing it over and taking it back costs more than a short pass (another thread
 * may take it meanwhile, and the caller then waits for it: measured, pi's median of 8,192 samples
 * took a quarter of the data plane's loop at 100K parameters while it released the GIL). */
#define RELEASE_GIL_FROM 262144
#define MAYBE_RELEASE_GIL(n) PyThreadState *_saved = (n) >= RELEASE_GIL_FROM ? PyEval_SaveThread() : NULL
#define MAYBE_RESTORE_GIL() \
    if (_saved != NULL) {   \
        PyEval_RestoreThread(_saved); \
    }

typedef struct {
    /* pi's sums count only the parameters this commit moves (Delta != 0; their pi is NaN in the
     * scratch): elsewhere pi reads 0 or pi_max and says nothing of the commit (a top-k payload's
     * zeros, a local-steps update's untouched parameters); `moving` counts them */
    double pi_sum, proxy_energy, central_energy, at_zero, at_max, moving;
    float theta_peak, proxy_peak; /* max |theta| and max |m_i| after the update (update_into only) */
    double payload_square, window_square; /* the noise scale's |g|^2 and |window sum|^2 (block_noise) */
} Sums;

/* The gradient noise scale's window (domain/noise.py): the running sum w of a window of commits'
 * payloads u over a sample of the parameters, every `wstride`-th run of NOISE_RUN consecutive ones
 * (wstride 1: all of them; w holds NOISE_RUN values per sampled run, window_size()). The first
 * commit of a window writes w = u (w is not read), the middle ones w += u, the last one only reads
 * w + u for its squared norm (w is not written). The sample keeps w in cache and its reads short
 * (noise.py's NOISE_SAMPLE_SIZE); runs rather than single values read whole cache lines of u, and
 * vectorise: all of θ cost a quarter more server CPU per commit at 1M parameters, single values
 * 16,384 of them 2-5% (docs/PERFORMANCE.md). */
enum { WINDOW_START = 0, WINDOW_ADD = 1, WINDOW_LAST = 2 };
#define BLOCK 1024 /* parameters per block: its scratch stays in L1, its float32 partial sums accurate */
#define NOISE_RUN 16 /* a multiple of BLOCK's divisors: blocks start on a run */

/* A block of the payload as the pass reads it: `u` itself, or (bound >= 0: memory its sender can
 * still write, a client's shared memory) each value read once into `held`, within the bound the
 * caller checked before the pass (max |payload|; a NaN written since reads as -bound). Whatever
 * the sender writes meanwhile, the pass sees values the bound covers, so the in-place pass's
 * overflow bound holds, and GEM's update and the noise sums read the same values (gem_exact.c;
 * adamw.c's passes and checks.c's noise window alike). */
static inline __attribute__((always_inline)) const float *
held_block(const float *u, Py_ssize_t length, float bound, float *restrict held)
{
    if (bound < 0.0f) {
        return u;
    }
    for (Py_ssize_t j = 0; j < length; j++) {
        float value = u[j];
        value = value > -bound ? value : -bound; /* ternaries: max and min, a NaN to -bound */
        held[j] = value < bound ? value : bound;
    }
    return held;
}

/* The window's length for n parameters: n, or NOISE_RUN per sampled run (the last may be short). */
static Py_ssize_t
window_size(Py_ssize_t n, Py_ssize_t wstride)
{
    return wstride == 1 ? n : ((n + NOISE_RUN - 1) / NOISE_RUN + wstride - 1) / wstride * NOISE_RUN;
}

/* |u|^2 and |w'|^2 of `length` consecutive values added to the sums, w written as `mode` says. */
static inline __attribute__((always_inline)) void
noise_run(const float *restrict u, float *restrict w, Py_ssize_t length, int mode, float *restrict payload_sum,
          float *restrict window_sum)
{
    float payload = 0.0f, window = 0.0f;
    if (mode == WINDOW_START) {
#pragma omp simd reduction(+ : payload)
        for (Py_ssize_t j = 0; j < length; j++) {
            w[j] = u[j];
            payload += u[j] * u[j];
        }
        window = payload;
    } else if (mode == WINDOW_ADD) {
#pragma omp simd reduction(+ : payload, window)
        for (Py_ssize_t j = 0; j < length; j++) {
            const float value = u[j], sum = w[j] + value;
            w[j] = sum;
            payload += value * value;
            window += sum * sum;
        }
    } else {
#pragma omp simd reduction(+ : payload, window)
        for (Py_ssize_t j = 0; j < length; j++) {
            const float value = u[j], sum = w[j] + value;
            payload += value * value;
            window += sum * sum;
        }
    }
    *payload_sum += payload;
    *window_sum += window;
}

/* Where the pass is in the sample: the next sampled run's first parameter and its place in w. */
typedef struct {
    Py_ssize_t at, slot;
} SampleCursor;

/* One block's |u|^2 and |w'|^2 over the sampled parameters in [start, start + length) (w' the window
 * sum after this commit): in GEM's pass right after the block's update, while u is in cache. The
 * cursor walks the sample across blocks in order (no division per block). */
static inline __attribute__((always_inline)) void
block_noise(const float *restrict bu, float *restrict w, Py_ssize_t start, Py_ssize_t length, Py_ssize_t wstride,
            int mode, SampleCursor *restrict cursor, Sums *restrict sums)
{
    float payload = 0.0f, window = 0.0f;
    const Py_ssize_t end = start + length;
    if (wstride == 1) {
        noise_run(bu, w + start, length, mode, &payload, &window);
    } else {
        for (; cursor->at < end; cursor->at += wstride * NOISE_RUN, cursor->slot += NOISE_RUN) {
            const Py_ssize_t stop = cursor->at + NOISE_RUN < end ? cursor->at + NOISE_RUN : end;
            noise_run(bu + (cursor->at - start), w + cursor->slot, stop - cursor->at, mode, &payload, &window);
        }
    }
    sums->payload_square += payload;
    sums->window_square += window;
}

/* A block's sums, once its update is done (pis, proxies, centrals in L1 scratch; bto, bmo its new
 * theta and m_i). `checked` (a constant where it is inlined): also whether every new value is
 * finite (0 if not) and their peaks; in place the caller's bound already guarantees both. The
 * `omp simd` reduction lets the compiler vectorise them (sums of the statistics only: theta, m_i
 * and s_i do not depend on their order). */
static inline __attribute__((always_inline)) int
block_sums(const float *restrict bto, const float *restrict bmo, const float *restrict pis,
           const float *restrict proxies, const float *restrict centrals, Py_ssize_t start, Py_ssize_t length,
           float pi_max, Py_ssize_t stride, float *restrict sampled, Sums *restrict sums, const int checked)
{
    float pi_sum = 0.0f, proxy_sum = 0.0f, central_sum = 0.0f, at_zero = 0.0f, at_max = 0.0f, moving = 0.0f, bad = 0.0f;
    float theta_peak = 0.0f, proxy_peak = 0.0f;
    if (checked) {
#pragma omp simd reduction(+ : bad) reduction(max : theta_peak, proxy_peak)
        for (Py_ssize_t j = 0; j < length; j++) {
            bad += (bto[j] - bto[j]) + (bmo[j] - bmo[j]); /* 0 while every new value is finite */
            const float theta_size = fabsf(bto[j]), proxy_size = fabsf(bmo[j]); /* a ternary vectorises, fmaxf not */
            theta_peak = theta_size > theta_peak ? theta_size : theta_peak;
            proxy_peak = proxy_size > proxy_peak ? proxy_size : proxy_peak;
        }
        if (bad != 0.0f) {
            return 0;
        }
    }
#pragma omp simd reduction(+ : pi_sum, proxy_sum, central_sum, at_zero, at_max, moving)
    for (Py_ssize_t j = 0; j < length; j++) {
        const int moved = pis[j] == pis[j]; /* NaN: Delta = 0 there (NaN compares false below too) */
        pi_sum += moved ? pis[j] : 0.0f;
        moving += moved ? 1.0f : 0.0f;
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
    sums->moving += moving;
    sums->theta_peak = theta_peak > sums->theta_peak ? theta_peak : sums->theta_peak;
    sums->proxy_peak = proxy_peak > sums->proxy_peak ? proxy_peak : sums->proxy_peak;
    return 1;
}

/* GEM's pi for one parameter from m_i's new value (`velocity`), c = |theta - s_i| (`movement`) and
 * Delta, each operation rounded to float32 in gem.py's order (the numpy kernels' too); also the
 * energies' terms kappa*|m_i| and |Delta| + eps. */
static inline __attribute__((always_inline)) float
gem_pi(float velocity, float movement, float delta, float kappa, int amplify, float epsilon, float pi_max,
       float *restrict proxy_term, float *restrict denominator_term)
{
    float pi = fabsf(velocity);
    if (amplify) {
        pi = pi * kappa;
    }
    *proxy_term = pi;
    pi = pi - movement;
    const float denominator = fabsf(delta) + epsilon;
    pi = pi / denominator;
    pi = pi < 0.0f ? 0.0f : pi; /* as numpy's maximum and minimum: NaN stays NaN */
    pi = pi > pi_max ? pi_max : pi;
    *denominator_term = denominator;
    return pi;
}

#endif
