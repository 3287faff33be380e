/*
 * The integer arithmetic of quant_dot.c: 32 weight quants at a time as bytes (bytes32), and the
 * dot product of 32 such bytes with 32 int8 activation quants into 8 int32 lanes, lane i the sum
 * of the four products of bytes 4i .. 4i + 3. Every instruction set computes the same lanes (the
 * sums are exact integers), so the float steps after them, written once with GCC's vector
 * extensions on 8-lane vectors, see the same values on every build:
 *
 *   AVX512-VNNI (with VL) or AVX-VNNI  vpdpbusd: unsigned bytes times signed bytes, four to a lane
 *   AVX2                        vpmaddubsw into 16-bit pairs, then vpmaddwd by ones into lanes; a
 *                               pair never saturates (unsigned bytes are at most 128 here, the
 *                               activation quants at most 127 in size: 2 * 128 * 127 < 2^15)
 *   anything else               the same sums in plain C
 *
 * Signed weights (Q8_0) are multiplied as llama.cpp does: their magnitudes as the unsigned operand
 * and the activations with each weight's sign (vpsignb), so -128 too is exact.
 *
 * The unpackers turn one block's (or K sub-block's) quants into bytes32 in element order: unsigned
 * quants (0..15, 0..31, 0..63) for the 4-, 5- and 6-bit types, whose offsets (8, 16, 32) and
 * minimums quant_dot.c applies through the activation blocks' sums.
 */
#ifndef PAGEDKV_QUANT_DOT_SIMD_H
#define PAGEDKV_QUANT_DOT_SIMD_H

#include <stdint.h>
#include <string.h>

#include "quant_types.h"

typedef int32_t lanes8 __attribute__((vector_size(32)));
typedef float floats8 __attribute__((vector_size(32)));

#if defined(__AVX2__)
#include <immintrin.h>

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QUANT_DOT_ISA "avx512-vnni"
#elif defined(__AVXVNNI__)
#define QUANT_DOT_ISA "avx-vnni"
#else
#define QUANT_DOT_ISA "avx2"
#endif

typedef __m256i bytes32;
static inline bytes32 load32(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

/* acc + lane sums of u (unsigned bytes) times s (signed bytes) */
static inline lanes8 dot_us(lanes8 acc, bytes32 u, bytes32 s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return (lanes8)_mm256_dpbusd_epi32((__m256i)acc, u, s);
#elif defined(__AVXVNNI__)
    return (lanes8)_mm256_dpbusd_avx_epi32((__m256i)acc, u, s);
#else
    return acc + (lanes8)_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* acc + lane sums of w times s, both signed */
static inline lanes8 dot_ss(lanes8 acc, bytes32 w, bytes32 s) {
    return dot_us(acc, _mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
}

/* 16 bytes of packed nibbles: the low ones, then the high ones (Q4_0 ... Q5_1's order) */
static inline bytes32 nibbles32(const uint8_t *qs) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), _mm256_set1_epi8(15));
}

/* 16 where bit i of the little-endian 32 bits at qh is set, else 0 */
static inline bytes32 fifths32(const uint8_t *qh) {
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    return _mm256_maskz_set1_epi8((__mmask32)bits, 16);
#else
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
                                               _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                                 0x0101010101010101, 0));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
}

/* (byte >> shift) & mask of each of 32 bytes at p (shift < 8: a 16-bit lane shift moves no bit
 * of one byte into the other's kept bits) */
static inline bytes32 field32(const uint8_t *p, int shift, int mask) {
    return _mm256_and_si256(_mm256_srli_epi16(load32(p), shift), _mm256_set1_epi8((char)mask));
}
static inline bytes32 or32(bytes32 a, bytes32 b) { return _mm256_or_si256(a, b); }
static inline bytes32 shl4_32(bytes32 a) { return _mm256_slli_epi16(a, 4); } /* bytes below 16 */

#else /* portable C */
#define QUANT_DOT_ISA "portable"

typedef struct {
    uint8_t b[32];
} bytes32;
static inline bytes32 load32(const void *p) {
    bytes32 v;
    memcpy(v.b, p, sizeof v.b);
    return v;
}
static inline lanes8 dot_us(lanes8 acc, bytes32 u, bytes32 s) {
    for (int i = 0; i < 32; i++) acc[i / 4] += (int32_t)u.b[i] * (int8_t)s.b[i];
    return acc;
}
static inline lanes8 dot_ss(lanes8 acc, bytes32 w, bytes32 s) {
    for (int i = 0; i < 32; i++) acc[i / 4] += (int8_t)w.b[i] * (int8_t)s.b[i];
    return acc;
}
static inline bytes32 nibbles32(const uint8_t *qs) {
    bytes32 v;
    for (int i = 0; i < 16; i++) {
        v.b[i] = qs[i] & 15;
        v.b[i + 16] = qs[i] >> 4;
    }
    return v;
}
static inline bytes32 fifths32(const uint8_t *qh) {
    bytes32 v;
    for (int i = 0; i < 32; i++) v.b[i] = (uint8_t)(((qh[i / 8] >> (i % 8)) & 1) << 4);
    return v;
}
static inline bytes32 field32(const uint8_t *p, int shift, int mask) {
    bytes32 v;
    for (int i = 0; i < 32; i++) v.b[i] = (uint8_t)((p[i] >> shift) & mask);
    return v;
}
static inline bytes32 or32(bytes32 a, bytes32 b) {
    for (int i = 0; i < 32; i++) a.b[i] |= b.b[i];
    return a;
}
static inline bytes32 shl4_32(bytes32 a) {
    for (int i = 0; i < 32; i++) a.b[i] = (uint8_t)(a.b[i] << 4);
    return a;
}
#endif

/* the lanes' sum, in one order on every build */
static inline float sum8(floats8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

/* ---- each type's quants as unsigned bytes (Q8_0's as they are, signed) ---- */

static inline bytes32 unpack_q4(const uint8_t *qs) { return nibbles32(qs); }
static inline bytes32 unpack_q5(const uint8_t *qs, const uint8_t *qh) {
#if defined(__AVX2__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    uint32_t bits; /* 16 added to the bytes whose bit is set: one masked add */
    memcpy(&bits, qh, sizeof bits);
    const bytes32 u = nibbles32(qs);
    return _mm256_mask_add_epi8(u, (__mmask32)bits, u, _mm256_set1_epi8(16));
#else
    return or32(nibbles32(qs), fifths32(qh));
#endif
}
/* Q4_K / Q5_K sub-block s: nibble s % 2 of qs[32 (s / 2) ..], Q5_K's bit s of qh[0 .. 31] as 16 */
static inline bytes32 unpack_k4(const uint8_t *qs, int s) { return field32(qs + 32 * (s / 2), 4 * (s % 2), 15); }
static inline bytes32 unpack_k5(const uint8_t *qs, const uint8_t *qh, int s) {
    return or32(unpack_k4(qs, s), shl4_32(field32(qh, s, 1)));
}
/* Q6_K elements 32 c .. 32 c + 31 (c < 8): see quant_types.h's BlockQ6_K */
static inline bytes32 unpack_k6(const BlockQ6_K *b, int c) {
    const int half = c / 4, r = 32 * (c % 4);
    const bytes32 low = field32(b->ql + 64 * half + r % 64, 4 * (r / 64), 15);
    return or32(low, shl4_32(field32(b->qh + 32 * half, 2 * (r / 32), 3)));
}

#endif
