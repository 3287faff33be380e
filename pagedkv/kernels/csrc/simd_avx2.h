/*
 * simd.h's vector API on AVX and AVX2 (VL = 8). Included by simd.h alone, which chooses it.
 */

/* a bfloat16 is a float32's upper half: widen each lane and shift it there */
static inline vf vload_bf16(const uint16_t *p) {
    vu16 x;
    memcpy(&x, p, sizeof x);
    return (vf)(__builtin_convertvector(x, vi) << 16);
}

/* VL bytes zero- or sign-extended into int32 lanes: one widening load on AVX2 (GCC's generic
 * conversion of a byte vector goes through scalars), two SSE4.1 halves on AVX alone */
#include <immintrin.h>
static inline vi vload_u8_i32(const uint8_t *p) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
#if defined(__AVX2__)
    return (vi)_mm256_cvtepu8_epi32(bytes);
#else
    return (vi)_mm256_set_m128i(_mm_cvtepu8_epi32(_mm_srli_si128(bytes, 4)), _mm_cvtepu8_epi32(bytes));
#endif
}
static inline vi vload_i8_i32(const int8_t *p) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
#if defined(__AVX2__)
    return (vi)_mm256_cvtepi8_epi32(bytes);
#else
    return (vi)_mm256_set_m128i(_mm_cvtepi8_epi32(_mm_srli_si128(bytes, 4)), _mm_cvtepi8_epi32(bytes));
#endif
}
