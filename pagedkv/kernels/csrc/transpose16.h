/*
 * A 16 x 16 float32 transpose in AVX-512 registers, for the products that compute a block of
 * outputs transposed (the weight as the row operand) and write it back as rows: quant_amx.h and
 * quant_batch.h. Included only where AVX512F is.
 */
#ifndef PAGEDKV_TRANSPOSE16_H
#define PAGEDKV_TRANSPOSE16_H

#include <immintrin.h>

/* rows 0..15 of r become its columns: 4 x 4 blocks within each 128-bit lane (unpack, then
 * shuffle), then the lanes themselves (two rounds of 128-bit shuffles) */
static inline void transpose16(__m512 r[16]) {
    __m512 u[16];
    for (int q = 0; q < 4; q++) { /* u[4 q + p], lane L: column 4 L + p of rows 4 q .. 4 q + 3 */
        const __m512 lo01 = _mm512_unpacklo_ps(r[4 * q], r[4 * q + 1]), hi01 = _mm512_unpackhi_ps(r[4 * q], r[4 * q + 1]);
        const __m512 lo23 = _mm512_unpacklo_ps(r[4 * q + 2], r[4 * q + 3]),
                     hi23 = _mm512_unpackhi_ps(r[4 * q + 2], r[4 * q + 3]);
        u[4 * q] = _mm512_shuffle_ps(lo01, lo23, 0x44);
        u[4 * q + 1] = _mm512_shuffle_ps(lo01, lo23, 0xEE);
        u[4 * q + 2] = _mm512_shuffle_ps(hi01, hi23, 0x44);
        u[4 * q + 3] = _mm512_shuffle_ps(hi01, hi23, 0xEE);
    }
    for (int p = 0; p < 4; p++) { /* row 4 L + p: lane L of u[p], u[4 + p], u[8 + p], u[12 + p] */
        const __m512 low_a = _mm512_shuffle_f32x4(u[p], u[4 + p], 0x44), low_b = _mm512_shuffle_f32x4(u[8 + p], u[12 + p], 0x44);
        const __m512 high_a = _mm512_shuffle_f32x4(u[p], u[4 + p], 0xEE),
                     high_b = _mm512_shuffle_f32x4(u[8 + p], u[12 + p], 0xEE);
        r[p] = _mm512_shuffle_f32x4(low_a, low_b, 0x88);
        r[4 + p] = _mm512_shuffle_f32x4(low_a, low_b, 0xDD);
        r[8 + p] = _mm512_shuffle_f32x4(high_a, high_b, 0x88);
        r[12 + p] = _mm512_shuffle_f32x4(high_a, high_b, 0xDD);
    }
}

#endif
