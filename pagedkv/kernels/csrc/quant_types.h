/*
 * GGUF's quantized block types, byte for byte as a GGUF file stores them (ggml's
 * ggml-common.h): each row of a quantized [N, K] weight is K / elements consecutive blocks, and
 * a block is a plain struct. Scales are IEEE half floats held as their bits (uint16_t), read
 * with half_to_float. quant_gemm.c holds each type's pair of functions (dequantize one block,
 * and the product that dequantizes on the fly).
 *
 * The type codes are ggml's (GGMLQuantizationType), so Python passes the GGUF type as it is.
 */
#ifndef PAGEDKV_QUANT_TYPES_H
#define PAGEDKV_QUANT_TYPES_H

#include <stdint.h>
#include <string.h>

typedef enum {
    QUANT_Q4_0 = 2,
    QUANT_Q4_1 = 3,
    QUANT_Q5_0 = 6,
    QUANT_Q5_1 = 7,
    QUANT_Q8_0 = 8,
    QUANT_Q4_K = 12,
    QUANT_Q5_K = 13,
    QUANT_Q6_K = 14,
    QUANT_Q8_K = 15, /* activations only: quant_dot.c's blocks for the K types */
} QuantType;

#define QK_SMALL 32 /* elements per block of the legacy types (Q4_0 ... Q8_0) */
#define QK_K 256    /* elements per super-block of the K types */

/* w = d * (q - 8), q the nibbles: elements 0..15 the low ones of qs[0..15], 16..31 the high */
typedef struct {
    uint16_t d;
    uint8_t qs[QK_SMALL / 2];
} BlockQ4_0;

/* w = d * q + m, nibbles as Q4_0 */
typedef struct {
    uint16_t d, m;
    uint8_t qs[QK_SMALL / 2];
} BlockQ4_1;

/* w = d * (q - 16), q = nibble | bit i of qh (little-endian 32 bits) << 4 */
typedef struct {
    uint16_t d;
    uint8_t qh[4];
    uint8_t qs[QK_SMALL / 2];
} BlockQ5_0;

/* w = d * q + m, q as Q5_0 */
typedef struct {
    uint16_t d, m;
    uint8_t qh[4];
    uint8_t qs[QK_SMALL / 2];
} BlockQ5_1;

/* w = d * q, q signed bytes */
typedef struct {
    uint16_t d;
    int8_t qs[QK_SMALL];
} BlockQ8_0;

/* 8 sub-blocks of 32: w = d * sc[s] * q - dmin * m[s], sc and m 6-bit (packed in `scales`, see
 * quant_gemm.c's dequantize_k_quants); sub-blocks 2j and 2j + 1 are the low and high nibbles of
 * qs[32 j .. 32 j + 31] */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qs[QK_K / 2];
} BlockQ4_K;

/* Q4_K with a fifth bit: element i of sub-block s adds bit s of qh[i] << 4 */
typedef struct {
    uint16_t d, dmin;
    uint8_t scales[12];
    uint8_t qh[QK_K / 8];
    uint8_t qs[QK_K / 2];
} BlockQ5_K;

/* 16 sub-blocks of 16: w = d * scales[e / 16] * (q - 32), q 6-bit: for element e of half h
 * (128 each, r = e % 128) the nibble r / 64 of ql[64 h + r % 64] and the bit pair r / 32 of
 * qh[32 h + r % 32] above it */
typedef struct {
    uint8_t ql[QK_K / 2];
    uint8_t qh[QK_K / 4];
    int8_t scales[QK_K / 16];
    uint16_t d;
} BlockQ6_K;

_Static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block");
_Static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block");
_Static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block");
_Static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block");
_Static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block");
_Static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block");
_Static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block");
_Static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block");

/* every half float's value by its bits, half_to_float's (quant_gemm.c fills it when the library
 * loads): a block's scale is one load */
extern float quant_half_values[1 << 16];

/* an IEEE half's bits to float32, exactly (subnormals, infinities and NaNs included): F16C's
 * one instruction where the target has it, else by the bits */
#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in float32 */
        const float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    const uint32_t bits = sign | (exponent == 0x1F ? 0x7F800000u : (exponent + 112) << 23) | mantissa << 13;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
#endif

#endif
