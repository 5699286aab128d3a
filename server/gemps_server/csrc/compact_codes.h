/* The 8-bit codes of compact GEM's state (rules/block_codes.py, whose numpy code they equal byte
 * for byte): a value relative to its block's scale, rounded to 4 exponent and 3 mantissa bits. */
#ifndef GEMPS_COMPACT_CODES_H
#define GEMPS_COMPACT_CODES_H

#include "module.h"

#define CODE_BLOCK 32 /* block_codes.BLOCK: values sharing a scale */
#define CODE_CHUNK 4096 /* blocks the compiled pass takes at once (a multiple of CODE_BLOCK and of the noise run) */
#define SMALL_BITS 0x38800000u /* bits of 2**-14: below it the code's step is linear */
#define SUBNORMAL_SCALE 131072.0f /* 2**17 */
#define LARGEST_CODE 120u /* block_codes.LARGEST_CODE: 1.0, the scale itself */
#define ROUNDER 8388608.0f /* 2**23: (x + 2**23) - 2**23 is rint(x) for 0 <= x < 2**22, half to even */

/* block_codes.DECODE[code] by arithmetic (a table's gather does not vectorise as well): a magnitude
 * of 8 or more is a float32 whose exponent field is (magnitude >> 3) + 112 and whose top 3 mantissa
 * bits are magnitude & 7; below 8 it is magnitude * 2**-17 (exact: an integer times a power of 2). */
static inline __attribute__((always_inline)) float
decode_code(uint8_t code)
{
    const uint32_t magnitude = code & 127u;
    const uint32_t normal_bits = (magnitude << 20) + (112u << 23);
    float value;
    memcpy(&value, &normal_bits, sizeof value);
    const float linear = (float)(int32_t)magnitude * 0x1p-17f;
    value = magnitude < 8u ? linear : value;
    return code & 128u ? -value : value;
}

static inline __attribute__((always_inline)) uint8_t
encode_code(float x, float reciprocal)
{
    const float ratio = x * reciprocal;
    uint32_t bits;
    memcpy(&bits, &ratio, sizeof bits);
    const uint32_t size_bits = bits & 0x7FFFFFFFu;
    float small = fabsf(ratio) * SUBNORMAL_SCALE;
    small = (small + ROUNDER) - ROUNDER;
    const uint32_t large = ((size_bits + 0x7FFFFu + ((size_bits >> 20) & 1u)) >> 20) - 896u;
    uint32_t magnitude = size_bits < SMALL_BITS ? (uint32_t)(int32_t)small : large;
    magnitude = magnitude > LARGEST_CODE ? LARGEST_CODE : magnitude; /* a value past its scale saturates */
    return (uint8_t)(magnitude | ((bits >> 24) & 0x80u));
}

/* 1 / scale, as block_codes.reciprocal: 1 for a scale of 0 (every value is then 0). */
static inline __attribute__((always_inline)) float
reciprocal_of(float scale)
{
    return 1.0f / (scale > 0.0f ? scale : 1.0f);
}

/* codes of `length` finite values against `scale` (their peak, for the whole-vector encodings). */
static inline __attribute__((always_inline)) void
encode_block(const float *restrict values, Py_ssize_t length, float scale, uint8_t *restrict codes)
{
    const float reciprocal = reciprocal_of(scale);
    for (Py_ssize_t j = 0; j < length; j++) {
        codes[j] = encode_code(values[j], reciprocal);
    }
}

/* Sizes of one vector's codes and their blocks' scales match n values. */
static inline int
sizes_fit(Py_ssize_t n, const Py_buffer *codes, const Py_buffer *scales)
{
    return codes->len == n && scales->len == (n + CODE_BLOCK - 1) / CODE_BLOCK * (Py_ssize_t)sizeof(float);
}

#endif
