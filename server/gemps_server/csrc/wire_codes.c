/* The wire's blockwise int8 codes on the server (gemps_proto/block_quantisation.py and
 * reply_differences.py, whose numpy code they equal byte for byte and bit for bit): a coded commit's
 * payload checked and decoded in one pass, and a difference reply's code of theta - copy written
 * with the worker's copy moved, in one pass. The numpy code stays the reference: a payload these
 * refuse is decoded there again for its error's words, a block they cannot code is coded there. */
#include "module.h"

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
            float ratio = rintf(difference[j] / divisor);
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

PyObject *
wire_decode_int8(PyObject *self, PyObject *args)
{
    Py_buffer data, out;
    if (!PyArg_ParseTuple(args, "y*w*", &data, &out)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = out.len / (Py_ssize_t)sizeof(float), blocks = (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
    if (out.len % (Py_ssize_t)sizeof(float) || data.len != 4 * blocks + n) {
        PyErr_SetString(PyExc_ValueError, "wire_decode_int8: the codes' bytes do not hold out's count of values");
    } else {
        float peak;
        MAYBE_RELEASE_GIL(n);
        peak = decode_pass((const unsigned char *)data.buf, (const int8_t *)data.buf + 4 * blocks, (float *)out.buf,
                             n);
        MAYBE_RESTORE_GIL()
        result = PyFloat_FromDouble((double)peak);
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

PyObject *
wire_difference_int8(PyObject *self, PyObject *args)
{
    Py_buffer theta, copy, data;
    if (!PyArg_ParseTuple(args, "y*w*w*", &theta, &copy, &data)) {
        return NULL;
    }
    PyObject *result = NULL;
    const Py_ssize_t n = theta.len / (Py_ssize_t)sizeof(float), blocks = (n + WIRE_BLOCK - 1) / WIRE_BLOCK;
    if (theta.len % (Py_ssize_t)sizeof(float) || copy.len != 2 * n || data.len != 4 * blocks + n) {
        PyErr_SetString(PyExc_ValueError, "wire_difference_int8: theta, its copy and the code of different sizes");
    } else {
        Py_ssize_t coded;
        MAYBE_RELEASE_GIL(n);
        coded = difference_pass((const float *)theta.buf, (uint16_t *)copy.buf, (unsigned char *)data.buf,
                                (int8_t *)data.buf + 4 * blocks, n);
        MAYBE_RESTORE_GIL()
        result = PyLong_FromSsize_t(coded);
    }
    PyBuffer_Release(&theta);
    PyBuffer_Release(&copy);
    PyBuffer_Release(&data);
    return result;
}
