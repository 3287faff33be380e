/*
 * simd.h's vector API on AVX-512 (VL = 16). Included by simd.h alone, which chooses it.
 */
#include <immintrin.h>

/* one widening load and one shift: GCC lowers the generic conversion (simd_avx2.h) to halves put
 * together with inserts and extracts, which made bfloat16 slower per byte than float32 */
static inline vf vload_bf16(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}

/* VL bytes zero- or sign-extended into int32 lanes (GCC's generic conversion of a byte vector
 * goes through scalars): the quantized kernels' loads of quants */
static inline vi vload_u8_i32(const uint8_t *p) { return (vi)_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
static inline vi vload_i8_i32(const int8_t *p) { return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)); }

/* lane i of table at lane index[i] % 16 (vpermps): a block's 16 possible 4-bit values, computed
 * once, picked per element instead of converting each quant to float and scaling it */
#define SIMD_PICK16 1
static inline vf vpick16(vf table, vi index) { return _mm512_permutexvar_ps((__m512i)index, table); }
