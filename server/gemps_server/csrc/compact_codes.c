/* Compact GEM's whole-vector encodings (rules/gem_compact.py): a new worker's offset from the newest
 * reference, and an idle worker's offset rebased onto the newer reference when the older is reused.
 * Each value against its block's peak (compact_codes.h). */
#include "compact_codes.h"

/* An offset moved from one reference to another: s = R_from + decode(offset), offset' = s - R_to
 * (0 where that is not finite: a theta near float32's largest), codes and peaks in place. */
__attribute__((target_clones("avx2", "default"))) static float
rebase_pass(uint8_t *restrict oc, float *restrict os, const float *restrict r_from, const float *restrict r_to,
            Py_ssize_t n, float *restrict offset)
{
    float largest = 0.0f;
    for (Py_ssize_t start = 0; start < n; start += CODE_BLOCK) {
        const Py_ssize_t length = start + CODE_BLOCK < n ? CODE_BLOCK : n - start, block = start / CODE_BLOCK;
        const float offset_scale = os[block];
        float peak = 0.0f;
        for (Py_ssize_t j = 0; j < length; j++) {
            const float seen = r_from[start + j] + decode_code(oc[start + j]) * offset_scale;
            float moved = seen - r_to[start + j];
            moved = moved - moved == 0.0f ? moved : 0.0f;
            offset[j] = moved;
            const float size = fabsf(moved);
            peak = size > peak ? size : peak;
        }
        encode_block(offset, length, peak, oc + start);
        os[block] = peak;
        largest = peak > largest ? peak : largest;
    }
    return largest;
}

/* codes and peaks of finite float32 values (a new worker's offset); returns the largest peak. */
__attribute__((target_clones("avx2", "default"))) static float
encode_pass(const float *restrict values, uint8_t *restrict codes, float *restrict scales, Py_ssize_t n)
{
    float largest = 0.0f;
    for (Py_ssize_t start = 0; start < n; start += CODE_BLOCK) {
        const Py_ssize_t length = start + CODE_BLOCK < n ? CODE_BLOCK : n - start;
        float peak = 0.0f;
#pragma omp simd reduction(max : peak)
        for (Py_ssize_t j = 0; j < length; j++) {
            const float size = fabsf(values[start + j]);
            peak = size > peak ? size : peak;
        }
        encode_block(values + start, length, peak, codes + start);
        scales[start / CODE_BLOCK] = peak;
        largest = peak > largest ? peak : largest;
    }
    return largest;
}

PyObject *
compact_rebase(PyObject *self, PyObject *args)
{
    Py_buffer oc, os, r_from, r_to;
    if (!PyArg_ParseTuple(args, "w*w*y*y*", &oc, &os, &r_from, &r_to)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = oc.len;
    if (!sizes_fit(n, &oc, &os) || r_from.len != n * (Py_ssize_t)sizeof(float) || r_to.len != r_from.len) {
        PyErr_SetString(PyExc_ValueError, "compact_rebase: buffers of different sizes");
    } else {
        float *scratch = PyMem_RawMalloc(CODE_BLOCK * sizeof(float));
        if (scratch == NULL) {
            PyErr_NoMemory();
        } else {
            float largest;
            MAYBE_RELEASE_GIL(n);
            largest = rebase_pass((uint8_t *)oc.buf, (float *)os.buf, (const float *)r_from.buf,
                                  (const float *)r_to.buf, n, scratch);
            MAYBE_RESTORE_GIL()
            PyMem_RawFree(scratch);
            result = PyFloat_FromDouble((double)largest);
        }
    }
    PyBuffer_Release(&oc);
    PyBuffer_Release(&os);
    PyBuffer_Release(&r_from);
    PyBuffer_Release(&r_to);
    return result;
}

PyObject *
compact_encode(PyObject *self, PyObject *args)
{
    Py_buffer values, codes, scales;
    if (!PyArg_ParseTuple(args, "y*w*w*", &values, &codes, &scales)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = codes.len;
    if (!sizes_fit(n, &codes, &scales) || values.len != n * (Py_ssize_t)sizeof(float)) {
        PyErr_SetString(PyExc_ValueError, "compact_encode: buffers of different sizes");
    } else {
        float largest;
        MAYBE_RELEASE_GIL(n);
        largest = encode_pass((const float *)values.buf, (uint8_t *)codes.buf, (float *)scales.buf, n);
        MAYBE_RESTORE_GIL()
        result = PyFloat_FromDouble((double)largest);
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&scales);
    return result;
}
