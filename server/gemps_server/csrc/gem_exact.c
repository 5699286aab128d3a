/* GEM's exact update (the default `--gem-kernel`), in one compiled pass over the parameters:
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
#include "module.h"

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
update_in_place(float *restrict t, float *restrict m, float *restrict s, const float *u, Py_ssize_t n,
                float scale, float momentum, float kappa, float pi_max, float epsilon, Py_ssize_t stride,
                float *restrict sampled, Sums *restrict sums, float *restrict mirror, float *restrict window, Py_ssize_t wstride, int mode,
                float bound)
{
    float pis[BLOCK], proxies[BLOCK], centrals[BLOCK], held[BLOCK];
    const int amplify = kappa != 1.0f;
    SampleCursor cursor = {0, 0};
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        float *restrict bt = t + start, *restrict bm = m + start, *restrict bs = s + start;
        const float *restrict bu = held_block(u + start, length, bound, held);
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

/* The in-place pass for the compiled commit core (core.c), which has checked the bound itself. */
int
gem_in_place(float *t, float *m, float *s, const float *u, Py_ssize_t n, float scale, float momentum, float kappa,
             float pi_max, float epsilon, Py_ssize_t stride, float *sampled, Sums *sums, float *mirror, float *window,
             Py_ssize_t wstride, int mode, float bound)
{
    return update_in_place(t, m, s, u, n, scale, momentum, kappa, pi_max, epsilon, stride, sampled, sums, mirror,
                           window, wstride, mode, bound);
}

/* The same pass into t_out and m_out, theta, m_i and s_i only read: returns 0 at the first block
 * with a value that is not finite (the caller then drops the outputs: nothing it keeps was
 * written). */
__attribute__((target_clones("avx2", "default"))) static int
update_into(const float *restrict t, const float *restrict m, const float *restrict s, const float *u,
            float *restrict t_out, float *restrict m_out, Py_ssize_t n, float scale, float momentum, float kappa,
            float pi_max, float epsilon, Py_ssize_t stride, float *restrict sampled, Sums *restrict sums,
            float *restrict mirror, float *restrict window, Py_ssize_t wstride, int mode, float bound)
{
    float pis[BLOCK], proxies[BLOCK], centrals[BLOCK], held[BLOCK];
    const int amplify = kappa != 1.0f;
    SampleCursor cursor = {0, 0};
    for (Py_ssize_t start = 0; start < n; start += BLOCK) {
        const Py_ssize_t length = start + BLOCK < n ? BLOCK : n - start;
        const float *restrict bt = t + start, *restrict bm = m + start, *restrict bs = s + start;
        const float *restrict bu = held_block(u + start, length, bound, held);
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

PyObject *
gem_update(PyObject *self, PyObject *args)
{
    Py_buffer theta, proxy, last_seen, gradient, theta_out, proxy_out, samples, mirror, window;
    PyObject *theta_out_object, *proxy_out_object, *mirror_object = Py_None, *window_object = Py_None;
    float scale, momentum, kappa, pi_max, epsilon;
    Py_ssize_t stride, wstride = 1;
    int mode = WINDOW_START;
    float bound = -1.0f;
    if (!PyArg_ParseTuple(args, "w*w*w*y*OOfffffnw*|OOnif", &theta, &proxy, &last_seen, &gradient, &theta_out_object,
                          &proxy_out_object, &scale, &momentum, &kappa, &pi_max, &epsilon, &stride, &samples,
                          &mirror_object, &window_object, &wstride, &mode, &bound)) {
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
    /* The mirror may be the update itself when the update is held (a client's shared memory holds
     * its payload and receives θ): each block of the update is read into `held` before that
     * block of the mirror is written. Any other overlap would write the update before it is read. */
    const int mirror_is_held_update = have_mirror && mirror.buf == gradient.buf && bound >= 0.0f;
    const char *mirror_end = have_mirror ? (const char *)mirror.buf + mirror.len : NULL;
    const char *update_end = (const char *)gradient.buf + gradient.len;
    const int mirror_meets_update = have_mirror && (const char *)mirror.buf < update_end &&
                                    (const char *)gradient.buf < mirror_end;
    if (have_mirror && (mirror.buf == theta.buf || mirror.buf == proxy.buf || mirror.buf == last_seen.buf ||
                        (mirror_meets_update && !mirror_is_held_update) ||
                        (have_outputs && (mirror.buf == theta_out.buf || mirror.buf == proxy_out.buf)))) {
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
                             momentum, kappa, pi_max, epsilon, stride, (float *)samples.buf, &sums, mirrored, windowed, wstride, mode,
                             bound);
    } else {
        finite = update_in_place((float *)theta.buf, (float *)proxy.buf, (float *)last_seen.buf,
                                 (const float *)gradient.buf, n, scale, momentum, kappa, pi_max, epsilon, stride,
                                 (float *)samples.buf, &sums, mirrored, windowed, wstride, mode, bound);
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
