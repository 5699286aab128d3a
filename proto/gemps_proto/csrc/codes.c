/* The wire codec's compiled passes, the module gemps_proto._codes (gemps_proto/block_quantisation.py
 * and reply_differences.py, whose numpy code they equal byte for byte and bit for bit), shared by
 * the SDK and the server: a commit's int8 payload checked and decoded, a worker's int8 codes written
 * with its residual, a difference reply's code of theta - copy written with the server's copy moved,
 * and a client's copy moved by a reply's codes, each in one pass. The numpy code stays the
 * reference: a payload these refuse is decoded there again for its error's words, a block they
 * cannot code is coded there. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* The GIL is let go around a pass over at least this many values (the server's csrc/shared.h says
 * why a shorter pass keeps it). */
#define RELEASE_GIL_FROM 262144
#define LET_GO_OF_THE_GIL_FOR(n) \
    {                                  \
        PyThreadState *_saved = (n) >= RELEASE_GIL_FROM ? PyEval_SaveThread() : NULL;
#define TAKE_BACK_THE_GIL       \
    if (_saved != NULL) {             \
        PyEval_RestoreThread(_saved); \
    }                                 \
    }
#define WIRE_BLOCK 256 /* block_quantisation.BLOCK: values sharing a scale */
#define INT8_LEVELS 127

/* Read a little-endian float32 at any alignment (the scales lie where the payload's bytes do). */
static inline float
scale_at(const unsigned char *scales, Py_ssize_t block)
{
    float scale;
    memcpy(&scale, scales + 4 * block, sizeof scale);
    return scale;
}

/* The values' max |value| with out[i] = code * scale, or -1 (a scale not finite or negative) or -2
 * (a code of -128) with out partly written. Each scale and code is read once: a payload in memory
 * its sender can still write cannot pass a check with one byte and be used with another. A block's
 * max |code * scale| is its max |code| times its scale, the same rounding. */
__attribute__((target_clones("avx2", "default"))) static float
decode_pass(const unsigned char *scales, const int8_t *restrict codes, float *restrict out, Py_ssize_t n)
{
    float peak = 0.0f;
    for (Py_ssize_t start = 0; start < n; start += WIRE_BLOCK) {
        const Py_ssize_t length = start + WIRE_BLOCK < n ? WIRE_BLOCK : n - start;
        const float scale = scale_at(scales, start / WIRE_BLOCK);
        if (!(isfinite(scale) && scale >= 0.0f)) {
            return -1.0f;
        }
        int largest = 0;
#pragma omp simd reduction(max : largest)
        for (Py_ssize_t j = 0; j < length; j++) {
            const int code = codes[start + j];
            const int size = code < 0 ? -code : code;
            largest = size > largest ? size : largest;
            out[start + j] = (float)code * scale;
        }
        if (largest > INT8_LEVELS) {
            return -2.0f;
        }
        const float block_peak = (float)largest * scale;
        peak = block_peak > peak ? block_peak : peak;
    }
    return peak;
}

/* bfloat16 bits of a float32's bits, rounded to nearest even, a finite value past bfloat16's largest
 * saturating to it (tensor_codec.float32_to_bfloat16's integer steps, which wrap alike). */
static inline uint16_t
bfloat16_of(uint32_t word)
{
    uint32_t rounded = (((word >> 16) & 1u) + 0x7FFFu + word) >> 16;
    return (uint16_t)((rounded & 0x7FFFu) == 0x7F80u ? rounded - 1u : rounded);
}

static inline float
float_of_bfloat16(uint16_t bits)
{
    const uint32_t word = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &word, sizeof value);
    return value;
}

/* reply_differences.difference for int8 codes, in place, from block `first` on: each block's scale
 * (max |theta - copy| / 127) and codes written, and its copy moved to bfloat16(copy + code * scale).
 * Returns n's block count when every block was coded, else the first block whose difference is not
 * finite (theta and the copy near float32's largest), left as it was with every block after it. */
__attribute__((target_clones("avx2", "default"))) static Py_ssize_t
difference_pass(const float *restrict theta, uint16_t *restrict copy, unsigned char *scales, int8_t *restrict codes,
                Py_ssize_t n)
{
    float held[WIRE_BLOCK], difference[WIRE_BLOCK];
    for (Py_ssize_t start = 0; start < n; start += WIRE_BLOCK) {
        const Py_ssize_t length = start + WIRE_BLOCK < n ? WIRE_BLOCK : n - start;
        float peak = 0.0f;
#pragma omp simd reduction(max : peak)
        for (Py_ssize_t j = 0; j < length; j++) {
            held[j] = float_of_bfloat16(copy[start + j]);
            difference[j] = theta[start + j] - held[j];
            const float size = fabsf(difference[j]);
            peak = size > peak ? size : peak;
        }
        if (!isfinite(peak)) {
            return start / WIRE_BLOCK;
        }
        const float scale = peak / (float)INT8_LEVELS;
        const float divisor = scale > 0.0f ? scale : 1.0f; /* a block of zeros: zeros / 1 */
        memcpy(scales + 4 * (start / WIRE_BLOCK), &scale, sizeof scale);
#pragma omp simd
        for (Py_ssize_t j = 0; j < length; j++) {
            /* + 0: -0 becomes 0, as the int8 code it is, so a compiler that takes the ratio for
             * (float)code (it is that, but for a zero's sign) gives the numpy code's step */
            float ratio = rintf(difference[j] / divisor) + 0.0f;
            ratio = ratio < -INT8_LEVELS ? -INT8_LEVELS : ratio > INT8_LEVELS ? INT8_LEVELS : ratio;
            const int8_t code = (int8_t)ratio;
            codes[start + j] = code;
            const float moved = held[j] + (float)code * scale;
            uint32_t word;
            memcpy(&word, &moved, sizeof word);
            copy[start + j] = bfloat16_of(word);
        }
    }
    return (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
}

static PyObject *
decode_int8(PyObject *self, PyObject *args)
{
    Py_buffer data, out;
    if (!PyArg_ParseTuple(args, "y*w*", &data, &out)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = out.len / (Py_ssize_t)sizeof(float), blocks = (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
    if (out.len % (Py_ssize_t)sizeof(float) || data.len != 4 * blocks + n) {
        PyErr_SetString(PyExc_ValueError, "decode_int8: the codes' bytes do not hold out's count of values");
    } else {
        float peak;
        LET_GO_OF_THE_GIL_FOR(n)
        peak = decode_pass((const unsigned char *)data.buf, (const int8_t *)data.buf + 4 * blocks, (float *)out.buf,
                           n);
        TAKE_BACK_THE_GIL
        result = PyFloat_FromDouble((double)peak);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *
difference_int8(PyObject *self, PyObject *args)
{
    Py_buffer theta, copy, data;
    if (!PyArg_ParseTuple(args, "y*w*w*", &theta, &copy, &data)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = theta.len / (Py_ssize_t)sizeof(float), blocks = (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
    if (theta.len % (Py_ssize_t)sizeof(float) || copy.len != 2 * n || data.len != 4 * blocks + n) {
        PyErr_SetString(PyExc_ValueError, "difference_int8: theta, its copy and the code of different sizes");
    } else {
        Py_ssize_t coded;
        LET_GO_OF_THE_GIL_FOR(n)
        coded = difference_pass((const float *)theta.buf, (uint16_t *)copy.buf, (unsigned char *)data.buf,
                                (int8_t *)data.buf + 4 * blocks, n);
        TAKE_BACK_THE_GIL
        result = PyLong_FromSsize_t(coded);
    }
    PyBuffer_Release(&theta);
    PyBuffer_Release(&copy);
    PyBuffer_Release(&data);
    return result;
}

/* block_quantisation.int8_subtracting: each block's scale (max |value| / 127) and codes written, and
 * its values left holding what the codes lose (value - code * scale). Returns n's block count, or
 * the first block whose values are not all finite, left as it was with every block after it. */
__attribute__((target_clones("avx2", "default"))) static Py_ssize_t
subtracting_pass(float *restrict values, unsigned char *scales, int8_t *restrict codes, Py_ssize_t n)
{
    for (Py_ssize_t start = 0; start < n; start += WIRE_BLOCK) {
        const Py_ssize_t length = start + WIRE_BLOCK < n ? WIRE_BLOCK : n - start;
        float peak = 0.0f;
        int finite = 1;
#pragma omp simd reduction(max : peak) reduction(& : finite)
        for (Py_ssize_t j = 0; j < length; j++) {
            const float value = values[start + j];
            finite &= value - value == 0.0f;
            const float size = fabsf(value);
            peak = size > peak ? size : peak;
        }
        if (!finite) {
            return start / WIRE_BLOCK;
        }
        const float scale = peak / (float)INT8_LEVELS;
        const float divisor = scale > 0.0f ? scale : 1.0f;
        memcpy(scales + 4 * (start / WIRE_BLOCK), &scale, sizeof scale);
#pragma omp simd
        for (Py_ssize_t j = 0; j < length; j++) {
            float ratio = rintf(values[start + j] / divisor) + 0.0f; /* -0 as 0: difference_pass says why */
            ratio = ratio < -INT8_LEVELS ? -INT8_LEVELS : ratio > INT8_LEVELS ? INT8_LEVELS : ratio;
            const int8_t code = (int8_t)ratio;
            codes[start + j] = code;
            values[start + j] = values[start + j] - (float)code * scale;
        }
    }
    return (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
}

/* reply_differences.advance: a copy (bfloat16 bits) moved by a reply's checked codes (a code a
 * value, int8's or int4's unpacked) and their blocks' scales, copy <- bfloat16(copy + code * scale),
 * and the moved copy's float32 values written to out. */
__attribute__((target_clones("avx2", "default"))) static void
advance_pass(uint16_t *restrict copy, const unsigned char *scales, const int8_t *restrict codes, float *restrict out,
             Py_ssize_t n)
{
    for (Py_ssize_t start = 0; start < n; start += WIRE_BLOCK) {
        const Py_ssize_t length = start + WIRE_BLOCK < n ? WIRE_BLOCK : n - start;
        const float scale = scale_at(scales, start / WIRE_BLOCK);
#pragma omp simd
        for (Py_ssize_t j = 0; j < length; j++) {
            const float moved = float_of_bfloat16(copy[start + j]) + (float)codes[start + j] * scale;
            uint32_t word;
            memcpy(&word, &moved, sizeof word);
            const uint16_t bits = bfloat16_of(word);
            copy[start + j] = bits;
            out[start + j] = float_of_bfloat16(bits);
        }
    }
}

static PyObject *
subtracting_int8(PyObject *self, PyObject *args)
{
    Py_buffer values, data;
    if (!PyArg_ParseTuple(args, "w*w*", &values, &data)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = values.len / (Py_ssize_t)sizeof(float), blocks = (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
    if (values.len % (Py_ssize_t)sizeof(float) || data.len != 4 * blocks + n) {
        PyErr_SetString(PyExc_ValueError, "subtracting_int8: the codes' bytes do not hold the values' count");
    } else {
        Py_ssize_t coded;
        LET_GO_OF_THE_GIL_FOR(n)
        coded = subtracting_pass((float *)values.buf, (unsigned char *)data.buf, (int8_t *)data.buf + 4 * blocks, n);
        TAKE_BACK_THE_GIL
        result = PyLong_FromSsize_t(coded);
    }
    PyBuffer_Release(&values);
    PyBuffer_Release(&data);
    return result;
}

static PyObject *
advance(PyObject *self, PyObject *args)
{
    Py_buffer copy, scales, codes, out;
    if (!PyArg_ParseTuple(args, "w*y*y*w*", &copy, &scales, &codes, &out)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = codes.len, blocks = (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
    if (copy.len != 2 * n || scales.len < 4 * blocks || out.len != 4 * n) {
        PyErr_SetString(PyExc_ValueError, "advance: the copy, the scales, the codes and out of different sizes");
    } else {
        LET_GO_OF_THE_GIL_FOR(n)
        advance_pass((uint16_t *)copy.buf, (const unsigned char *)scales.buf, (const int8_t *)codes.buf,
                     (float *)out.buf, n);
        TAKE_BACK_THE_GIL
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&copy);
    PyBuffer_Release(&scales);
    PyBuffer_Release(&codes);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_int8", decode_int8, METH_VARARGS,
     "decode_int8(DTYPE_INT8_BLOCK bytes, float32 out) -> max |value| with out the values (block_quantisation's\n"
     "decode); -1.0 for a scale not finite or negative, -2.0 for a code of -128 (out then partly written)."},
    {"difference_int8", difference_int8, METH_VARARGS,
     "difference_int8(float32 theta, uint16 copy, DTYPE_INT8_BLOCK bytes) -> blocks coded: reply_differences'\n"
     "difference in place (the code written, the copy moved), up to the first block whose difference is not finite."},
    {"subtracting_int8", subtracting_int8, METH_VARARGS,
     "subtracting_int8(float32 values, DTYPE_INT8_BLOCK bytes) -> blocks coded: block_quantisation.int8_subtracting\n"
     "(the codes written, the values left holding what they lose), up to the first block with a value not finite."},
    {"advance", advance, METH_VARARGS,
     "advance(uint16 copy, float32 scales, int8 codes, float32 out): reply_differences.advance's arithmetic, the copy\n"
     "moved in place by checked codes (a code a value) and out its new values."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_codes", "The wire codec's compiled passes.", -1, methods};

PyMODINIT_FUNC
PyInit__codes(void)
{
    return PyModule_Create(&module);
}
