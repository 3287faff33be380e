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

/* lane i of the 32-entry table (low, high) at index[i] % 32 (vpermt2ps): entries 0..15 from low,
 * 16..31 from high; the 5-bit types' table picks, as vpick16 is the 4-bit types' */
static inline vf vpick32(vf low, vf high, vi index) {
    return _mm512_permutex2var_ps(low, (__m512i)index, high);
}

/* index with bit 4 set in the lanes whose bit is set in lanes (one masked or): a 5-bit quant from
 * its nibble and its block's 16 fifth bits, without spreading the bits over lanes first */
static inline vi vwith_bit4(vi index, uint16_t lanes) {
    return (vi)_mm512_mask_or_epi32((__m512i)index, (__mmask16)lanes, (__m512i)index, _mm512_set1_epi32(16));
}
