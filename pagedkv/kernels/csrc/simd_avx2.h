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
 * conversion of a byte vector goes through scalars), lane by lane on AVX alone */
#if defined(__AVX2__)
#include <immintrin.h>
static inline vi vload_u8_i32(const uint8_t *p) { return (vi)_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
static inline vi vload_i8_i32(const int8_t *p) { return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#else
static inline vi vload_u8_i32(const uint8_t *p) {
    vi x;
    for (int i = 0; i < VL; i++) x[i] = p[i];
    return x;
}
static inline vi vload_i8_i32(const int8_t *p) {
    vi x;
    for (int i = 0; i < VL; i++) x[i] = p[i];
    return x;
}
#endif
