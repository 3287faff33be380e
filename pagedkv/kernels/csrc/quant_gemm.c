/*
 * Weights kept in GGUF's quantized blocks (quant_types.h): each type's pair of functions,
 * dequantize (one block to float32) and the product y[M, N] = x[M, K] . W[N, K]^T (+ bias) that
 * dequantizes as it goes, in float32 and bfloat16 activations. Entry points and arguments:
 * kernels.h.
 *
 * Dequantization equals gguf-py's (gguf.quants.dequantize) bit for bit: every product in it is
 * exact in float32 (a half scale has 11 significant bits, a 6-bit sub-scale 6 and a quant at
 * most 8, and Q6_K's 8-bit scale with its 6-bit quant stays under 24), so the only rounding is
 * the final add of a minimum, fused or not. Half scales are read from a table of all 65,536
 * values (one load the multiply broadcasts). On AVX-512 the 4- and 5-bit types (Q4_0, Q4_1, Q4_K,
 * Q5_0, Q5_1) make a block's (or Q4_K's sub-block's) 16 or 32 possible weights once, as the
 * generic code computes each, and every element picks its own by its quant (vpick16, vpick32):
 * the same values in fewer instructions. Q5_K's fifth bits come one per byte, not as a lane mask,
 * and its two tables per 32 values cost what they save: it converts each quant. Q5_0, the bulk of
 * a Q4_K_M file, has a second picker for the register path that skips the widening shuffles
 * (dequantize_q5_0_lanes: the shuffle port bounded that loop), in LANE_ORDER; Q4_K's register
 * path (dequantize_q4_k_lanes) skips them the same way. Q6_K on AVX-512BW
 * makes its 6-bit quants 64 at a time as bytes and scales each 16 by a broadcast operand.
 *
 * The product takes one of three paths by the row count M. Up to GEMV_ROWS rows (decode), each
 * block of a weight row is dequantized into registers and multiplied into every row's float32
 * lane accumulators: the weight is read once, as its quantized bytes. Above (prefill), each tile
 * of 64 weight rows is dequantized once into the tiled GEMM's layout and multiplied by the tiled
 * GEMM's own loop (tiled_tile_f32), so the rows' results are those of tiled_linear_f32 on the
 * dequantized weight, bit for bit. Between them on AVX-512 (decode batches, quant_batch.h) panels
 * of weight rows are dequantized as they lie and broadcast against x packed k-major: the same
 * bits as the tile path without its per-step transpose of the weight. All paths use the
 * dequantized weights exactly; only the order of the sums differs between the register path and
 * the others. The register path prefetches the weight a few KiB
 * ahead of the block it reads: a decode step streams every weight of the model from memory
 * once, and the hardware's own prefetch alone left the loop waiting on it. Threads split the output columns, as the tiled GEMM's
 * do. bfloat16 activations are widened to float32 once per call (exact) and the results rounded
 * to nearest even, after the bias, once; on AMX (quant_amx.h), from a few rows, bfloat16 is
 * instead the dense bfloat16 product of the weight rounded to bfloat16, on the tiles. The vector code is simd.h's (GCC's vector extensions,
 * lowered to the target's AVX-512, AVX2 or SSE registers).
 */
#include <stdlib.h>

#include "kernels.h"
#include "quant_types.h"

#define GEMV_ROWS 12    /* rows up to which the product dequantizes into registers */
#define GEMV_COLUMNS 16 /* output columns per work item there (the tile path's: the tile width) */
#define SPLIT 4         /* lane accumulators per row of the register path: independent FMA chains */
#define PREFETCH_BYTES 4096 /* how far ahead of its block the register path asks for weight bytes */
#define TILE_GROUP 16   /* weight rows dequantized together into a tile (a cache line of columns) */

static inline vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf to_float(vi q) { return __builtin_convertvector(q, vf); }
/* lane i holds first + i */
static inline vu lane_index(uint32_t first) {
    vu index;
    for (int i = 0; i < VL; i++) index[i] = first + (uint32_t)i;
    return index;
}
/* the accumulators' sum: lanes folded in halves (log2(VL) adds of half-width vectors, not a chain
 * of VL scalar adds), the same order for every row count */
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));
static inline float lane_sum(const vf acc[SPLIT]) {
    const vf all = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#if VL == 16
    vf8 low8, high8;
    memcpy(&low8, &all, sizeof low8);
    memcpy(&high8, (const char *)&all + sizeof low8, sizeof high8);
    const vf8 eight = low8 + high8;
#elif VL == 8
    const vf8 eight = all;
#endif
#if VL >= 8
    vf4 low4, high4;
    memcpy(&low4, &eight, sizeof low4);
    memcpy(&high4, (const char *)&eight + sizeof low4, sizeof high4);
    const vf4 four = low4 + high4;
#else
    const vf4 four = all;
#endif
    return (four[0] + four[2]) + (four[1] + four[3]);
}

/* every half float's value, by its bits (half_to_float's): a block's scale is then one load the
 * multiply broadcasts, not a conversion and a broadcast */
float quant_half_values[1 << 16];
__attribute__((constructor)) static void fill_half_values(void) {
    for (uint32_t h = 0; h < 1u << 16; h++) quant_half_values[h] = half_to_float((uint16_t)h);
}
static inline float scale_of(uint16_t h) { return quant_half_values[h]; }
/* the 4-bit quant of element c.. of a 32-element block packed as Q4_0/Q5_0: elements 0..15 the
 * low nibbles of qs, 16..31 the high ones (a vector never straddles the two: VL <= 16) */
static inline vi nibbles(const uint8_t *qs, int c) { return (vload_u8_i32(qs + c % 16) >> (c / 16 * 4)) & 15; }

/* ---- each type's block dequantizer ---- */

#if SIMD_PICK16
/* a 4-bit block of one vector's worth of values per nibble (VL = 16): table[q] is the weight of
 * quant q, computed as the generic code computes it, and each element picks its own; the low
 * nibble needs no mask (vpick16 reads the index modulo 16) */
static inline void pick_nibbles(const uint8_t *qs, vf table, float *out) {
    const vi q = vload_u8_i32(qs);
    vstore(out, vpick16(table, q));
    vstore(out + 16, vpick16(table, q >> 4));
}
static inline vf quant_values(void) { return to_float((vi)lane_index(0)); }
#endif

static inline void dequantize_q4_0(const BlockQ4_0 *b, float *out) {
    const float d = scale_of(b->d);
#if SIMD_PICK16
    pick_nibbles(b->qs, d * (quant_values() - 8.0f), out);
#else
    for (int c = 0; c < QK_SMALL; c += VL) vstore(out + c, d * to_float(nibbles(b->qs, c) - 8));
#endif
}

static inline void dequantize_q4_1(const BlockQ4_1 *b, float *out) {
    const float d = scale_of(b->d), m = scale_of(b->m);
#if SIMD_PICK16
    pick_nibbles(b->qs, d * quant_values() + m, out);
#else
    for (int c = 0; c < QK_SMALL; c += VL) vstore(out + c, d * to_float(nibbles(b->qs, c)) + m);
#endif
}

/* the fifth bits of Q5_0/Q5_1: bit c + i of the block's 32-bit qh for lane i */
static inline vi fifth_bits(const uint8_t *qh, int c) {
    uint32_t bits;
    memcpy(&bits, qh, sizeof bits);
    return (vi)((((vu){0} + bits) >> lane_index((uint32_t)c)) & 1u) << 4;
}

#if SIMD_PICK16
/* a 5-bit block (VL = 16): low[q] and high[q] the weights of quants q and 16 + q, computed as the
 * generic code computes them; each element's index is its nibble with its fifth bit as bit 4 */
static inline void pick_fifths(const uint8_t *qs, const uint8_t *qh, vf low, vf high, float *out) {
    const vi q = vload_u8_i32(qs);
    uint16_t fifths[2]; /* elements 0..15's fifth bits, then 16..31's */
    memcpy(fifths, qh, sizeof fifths);
    vstore(out, vpick32(low, high, vwith_bit4(q & 15, fifths[0])));
    vstore(out + 16, vpick32(low, high, vwith_bit4(q >> 4, fifths[1])));
}
#endif

static inline void dequantize_q5_0(const BlockQ5_0 *b, float *out) {
    const float d = scale_of(b->d);
#if SIMD_PICK16
    pick_fifths(b->qs, b->qh, d * (quant_values() - 16.0f), d * quant_values(), out);
#else
    for (int c = 0; c < QK_SMALL; c += VL)
        vstore(out + c, d * to_float((nibbles(b->qs, c) | fifth_bits(b->qh, c)) - 16));
#endif
}

#if SIMD_PICK16
/* Q5_0 for the register path, in LANE_ORDER (see there): each 16 elements' quants are a 4-byte
 * group of the block's 16 bytes broadcast and shifted per lane (no widening shuffle), their
 * fifth bits the block's 32 rotated per lane to bit 4, merged by one bitwise select; the values
 * are picked from the same tables as dequantize_q5_0's, so each is the same weight */
static inline void dequantize_q5_0_lanes(const BlockQ5_0 *b, float *out) {
    const float d = scale_of(b->d);
    const vf low = d * (quant_values() - 16.0f), high = d * quant_values();
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)b->qs));
    uint32_t bits;
    memcpy(&bits, b->qh, sizeof bits);
    const __m512i fifths = _mm512_set1_epi32((int)bits), fifteen = _mm512_set1_epi32(15);
    for (int half = 0; half < 2; half++) {
        vi shift, rotate; /* lane j: element e = 4 (j % 4) + j / 4 of the half */
        for (int j = 0; j < 16; j++) {
            const int e = 4 * (j % 4) + j / 4;
            shift[j] = 8 * (j / 4) + 4 * half;
            rotate[j] = (4 - e - 16 * half) & 31;
        }
        const __m512i quant = _mm512_srlv_epi32(bytes, (__m512i)shift);
        const __m512i index = _mm512_ternarylogic_epi32(quant, _mm512_rolv_epi32(fifths, (__m512i)rotate), fifteen,
                                                        0xE4); /* low 4 bits from quant, bit 4 from fifths */
        vstore(out + 16 * half, (vf)_mm512_permutex2var_ps((__m512)low, index, (__m512)high));
    }
}
#endif

static inline void dequantize_q5_1(const BlockQ5_1 *b, float *out) {
    const float d = scale_of(b->d), m = scale_of(b->m);
#if SIMD_PICK16
    pick_fifths(b->qs, b->qh, d * quant_values() + m, d * (quant_values() + 16.0f) + m, out);
#else
    for (int c = 0; c < QK_SMALL; c += VL)
        vstore(out + c, d * to_float(nibbles(b->qs, c) | fifth_bits(b->qh, c)) + m);
#endif
}

static inline void dequantize_q8_0(const BlockQ8_0 *b, float *out) {
    const float d = scale_of(b->d);
    for (int c = 0; c < QK_SMALL; c += VL) vstore(out + c, d * to_float(vload_i8_i32(b->qs + c)));
}

/* Q4_K and Q5_K: eight sub-blocks of 32, each with a 6-bit scale and minimum (multiples of d and
 * dmin) packed in 12 bytes: sub-block j < 4 has the low 6 bits of bytes j and j + 4, sub-block
 * j >= 4 the nibbles of byte j + 4 below the top two bits of bytes j - 4 and j. Sub-block s's
 * quants are nibble s % 2 of qs[32 (s / 2) + i], plus for Q5_K (qh not NULL) bit s of qh[i]
 * as the fifth. The sub-blocks' scales and minimums are unpacked first, all eight at once, into
 * arrays the loop over sub-blocks broadcasts from (k_scales). */
static inline void k_scales(const uint8_t *packed, uint16_t d_bits, uint16_t dmin_bits, float scales[8],
                            float mins[8]) {
    const float d = scale_of(d_bits), dmin = scale_of(dmin_bits);
    for (int s = 0; s < 8; s++) {
        const int j = s % 4, high_pair = s / 4;
        const int sc = high_pair ? (packed[j + 8] & 15) | (packed[j] >> 6) << 4 : packed[j] & 63;
        const int mn = high_pair ? (packed[j + 8] >> 4) | (packed[j + 4] >> 6) << 4 : packed[j + 4] & 63;
        scales[s] = d * (float)sc;
        mins[s] = dmin * (float)mn;
    }
}

static inline void dequantize_k_quants(const uint8_t *packed, uint16_t d_bits, uint16_t dmin_bits,
                                       const uint8_t *qh, const uint8_t *qs, float *out) {
    float scales[8], mins[8];
    k_scales(packed, d_bits, dmin_bits, scales, mins);
    for (int s = 0; s < 8; s++) {
        const float scale = scales[s], min = mins[s];
#if SIMD_PICK16
        if (qh == NULL) { /* Q4_K: each sub-block's 16 values picked from its table */
            const vf table = scale * quant_values() - min;
            for (int c = 0; c < 32; c += VL)
                vstore(out + 32 * s + c, vpick16(table, vload_u8_i32(qs + 32 * (s / 2) + c) >> (4 * (s % 2))));
            continue;
        }
#endif
        for (int c = 0; c < 32; c += VL) {
            vi q = (vload_u8_i32(qs + 32 * (s / 2) + c) >> (4 * (s % 2))) & 15;
            if (qh != NULL) q |= ((vload_u8_i32(qh + c) >> s) & 1) << 4;
            vstore(out + 32 * s + c, scale * to_float(q) - min);
        }
    }
}

static inline void dequantize_q4_k(const BlockQ4_K *b, float *out) {
    dequantize_k_quants(b->scales, b->d, b->dmin, NULL, b->qs, out);
}

#if SIMD_PICK16
/* Q4_K for the register path, in LANE_ORDER (as dequantize_q5_0_lanes): each 16 quants are a
 * 16-byte group of qs broadcast and shifted per lane to its nibble, which vpick16 reads modulo 16
 * (no widening shuffle, no mask), picked from the same per-sub-block table as dequantize_k_quants' */
static inline void dequantize_q4_k_lanes(const BlockQ4_K *b, float *out) {
    float scales[8], mins[8];
    k_scales(b->scales, b->d, b->dmin, scales, mins);
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        vi shift; /* lane j: byte j / 4 of its 32 bits (element 4 (j % 4) + j / 4 of the 16), nibble s % 2 */
        for (int j = 0; j < 16; j++) shift[j] = 8 * (j / 4) + 4 * (s % 2);
        const vf table = scales[s] * quant_values() - mins[s];
        for (int c = 0; c < 32; c += 16) {
            const __m512i bytes = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(b->qs + 32 * (s / 2) + c)));
            vstore(out + 32 * s + c, vpick16(table, (vi)_mm512_srlv_epi32(bytes, (__m512i)shift)));
        }
    }
}
#endif

static inline void dequantize_q5_k(const BlockQ5_K *b, float *out) {
    dequantize_k_quants(b->scales, b->d, b->dmin, b->qh, b->qs, out);
}

#if SIMD_PICK16 && defined(__AVX512BW__)
/* Q6_K on AVX-512BW: each half's 128 quants are made 64 at a time as bytes (its 64 ql bytes give
 * elements 0..63 by their low nibbles and 64..127 by their high ones; its 32 qh bytes, held twice
 * in one vector, give each 32 elements' bit pair by a per-half shift of 16-bit lanes and a mask
 * of bits 4..5, which keeps no bit shifted across a byte), less 32 as signed bytes; each 16 of
 * them are then widened and converted as the generic loop converts each quant, and scaled by the
 * same exact product of d and the sub-block's scale. */
static inline void dequantize_q6_k(const BlockQ6_K *b, float *out) {
    const float d = scale_of(b->d);
    int8_t quants[QK_K] __attribute__((aligned(64)));
    const __m512i nibble = _mm512_set1_epi8(15), pair = _mm512_set1_epi8(0x30), bias = _mm512_set1_epi8(32);
    /* 16-bit lane shifts bringing bit pair 0 / 1 (left 4 / 2) and 2 / 3 (right 0 / 2) to bits 4..5 */
    const __m512i up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    for (int half = 0; half < 2; half++) {
        const __m512i ql = _mm512_loadu_si512(b->ql + 64 * half);
        const __m512i qh = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b->qh + 32 * half)));
        const __m512i first = _mm512_ternarylogic_epi32(ql, nibble, _mm512_and_si512(_mm512_sllv_epi16(qh, up), pair),
                                                        0xEA); /* (ql & 15) | bits */
        const __m512i second = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), nibble,
                                                         _mm512_and_si512(_mm512_srlv_epi16(qh, down), pair), 0xEA);
        _mm512_store_si512(quants + 128 * half, _mm512_sub_epi8(first, bias));
        _mm512_store_si512(quants + 128 * half + 64, _mm512_sub_epi8(second, bias));
    }
    float scales[QK_K / 16]; /* d times each sub-block's scale, exact: a broadcast operand of the multiply */
    vstore(scales, d * to_float(vload_i8_i32(b->scales)));
#pragma GCC unroll 16
    for (int e = 0; e < QK_K; e += VL) vstore(out + e, scales[e / 16] * to_float(vload_i8_i32(quants + e)));
}
#else
static inline void dequantize_q6_k(const BlockQ6_K *b, float *out) {
    const float d = scale_of(b->d);
#pragma GCC unroll 16 /* every offset and shift a constant: rolled, the index arithmetic cost more than the values */
    for (int e = 0; e < QK_K; e += VL) {
        const int half = e / 128, r = e % 128;
        const vi low = (vload_u8_i32(b->ql + 64 * half + r % 64) >> (4 * (r / 64))) & 15;
        const vi high = ((vload_u8_i32(b->qh + 32 * half + r % 32) >> (2 * (r / 32))) & 3) << 4;
        vstore(out + e, d * (float)b->scales[e / 16] * to_float((low | high) - 32));
    }
}
#endif

/* ---- the per-type products (quant_gemm_body.h) ---- */

/* A type's entries: elements and bytes per block; `dequantize` turns `blocks` consecutive blocks
 * into float32 (`dequantize_bf16`: into bfloat16, rounded); `columns` makes out[m, j] = x[m] . W[n0 + j] for j < width and all M rows of x
 * (float32, row stride K), into out (row stride ld): on the register path when tile is NULL,
 * else through tile, room for width * K floats. */
typedef struct {
    int64_t elements, bytes;
    int lane_order; /* the register path reads x in LANE_ORDER */
    void (*dequantize)(const void *row, float *out, int64_t blocks);
    void (*dequantize_bf16)(const void *row, uint16_t *out, int64_t blocks); /* AMX builds; else NULL */
    void (*columns)(const float *x, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width, float *out,
                    int64_t ld, float *tile);
} QuantKind;

#define BLOCK BlockQ4_0
#define QK QK_SMALL
#define DEQUANTIZE dequantize_q4_0
#define SUFFIX(name) name##_q4_0
#include "quant_gemm_body.h"

#define BLOCK BlockQ4_1
#define QK QK_SMALL
#define DEQUANTIZE dequantize_q4_1
#define SUFFIX(name) name##_q4_1
#include "quant_gemm_body.h"

#define BLOCK BlockQ5_0
#define QK QK_SMALL
#define DEQUANTIZE dequantize_q5_0
#if SIMD_PICK16
#define GEMV_DEQUANTIZE dequantize_q5_0_lanes
#endif
#define SUFFIX(name) name##_q5_0
#include "quant_gemm_body.h"

#define BLOCK BlockQ5_1
#define QK QK_SMALL
#define DEQUANTIZE dequantize_q5_1
#define SUFFIX(name) name##_q5_1
#include "quant_gemm_body.h"

#define BLOCK BlockQ8_0
#define QK QK_SMALL
#define DEQUANTIZE dequantize_q8_0
#define SUFFIX(name) name##_q8_0
#include "quant_gemm_body.h"

#define BLOCK BlockQ4_K
#define QK QK_K
#define DEQUANTIZE dequantize_q4_k
#if SIMD_PICK16
#define GEMV_DEQUANTIZE dequantize_q4_k_lanes
#endif
#define SUFFIX(name) name##_q4_k
#include "quant_gemm_body.h"

#define BLOCK BlockQ5_K
#define QK QK_K
#define DEQUANTIZE dequantize_q5_k
#define SUFFIX(name) name##_q5_k
#include "quant_gemm_body.h"

#define BLOCK BlockQ6_K
#define QK QK_K
#define DEQUANTIZE dequantize_q6_k
#define SUFFIX(name) name##_q6_k
#include "quant_gemm_body.h"

/* the type's entries, or NULL for a type not here or a K that is not a whole number of blocks */
static const QuantKind *kind_of(int64_t type, int64_t K) {
    const QuantKind *kind = NULL;
    switch (type) {
    case QUANT_Q4_0: kind = &kind_q4_0; break;
    case QUANT_Q4_1: kind = &kind_q4_1; break;
    case QUANT_Q5_0: kind = &kind_q5_0; break;
    case QUANT_Q5_1: kind = &kind_q5_1; break;
    case QUANT_Q8_0: kind = &kind_q8_0; break;
    case QUANT_Q4_K: kind = &kind_q4_k; break;
    case QUANT_Q5_K: kind = &kind_q5_k; break;
    case QUANT_Q6_K: kind = &kind_q6_k; break;
    default: return NULL;
    }
    return K > 0 && K % kind->elements == 0 ? kind : NULL;
}

int quant_dequantize_f32(const void *w, int64_t type, float *out, int64_t rows, int64_t K) {
    const QuantKind *kind = kind_of(type, K);
    if (kind == NULL) return 2;
    const int64_t blocks = K / kind->elements;
#pragma omp parallel for schedule(static) if (rows * K >= 65536)
    for (int64_t r = 0; r < rows; r++) kind->dequantize((const char *)w + r * blocks * kind->bytes, out + r * K, blocks);
    return 0;
}

int quant_dequantize_bf16(const void *w, int64_t type, uint16_t *out, int64_t rows, int64_t K) {
    const QuantKind *kind = kind_of(type, K);
    if (kind == NULL) return 2;
    const int64_t blocks = K / kind->elements;
    int failed = 0;
#pragma omp parallel if (rows * K >= 65536)
    {
        float *row = malloc(sizeof(float) * K);
        if (row == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (row == NULL) continue;
            kind->dequantize((const char *)w + r * blocks * kind->bytes, row, blocks);
            for (int64_t k = 0; k < K; k++) out[r * K + k] = f32_to_bf16(row[k]);
        }
        free(row);
    }
    return failed;
}

/* LANE_ORDER: a register-path dequantizer may write each 16 elements in the order e(j) =
 * 4 (j % 4) + j / 4 (lane j holds element e(j)), the order its quants come out of the block's
 * bytes without a widening shuffle; x is then read in the same order (a copy made once per
 * call), so every product is still x[k] * W[n, k], only summed in other lanes. */
static void to_lane_order(const float *x, float *out, int64_t count) {
    for (int64_t c = 0; c < count; c += 16)
        for (int j = 0; j < 16; j++) out[c + j] = x[c + 4 * (j % 4) + j / 4];
}

#if GEMM_AVX512
#include "quant_batch.h"
#define BATCH_PATH_ROWS BATCH_ROWS
#else
#define BATCH_PATH_ROWS GEMV_ROWS /* no batch path: the tile path from GEMV_ROWS rows */
#define PANEL_ROWS 0
#endif

/* Which path a product of M rows takes: the register path up to GEMV_ROWS, the batch path
 * (quant_batch.h) up to BATCH_PATH_ROWS, the tile path above */
static int batch_path(int64_t M) { return M > GEMV_ROWS && M <= BATCH_PATH_ROWS; }

/* output columns per work item, and the workspace each thread dequantizes into (NULL: registers) */
static int64_t columns_per_item(int64_t M) {
    return M <= GEMV_ROWS ? GEMV_COLUMNS : batch_path(M) ? PANEL_ROWS : tiled_gemm_tile_width();
}
static float *tile_for(int64_t M, int64_t K) {
    const int64_t width = batch_path(M) ? PANEL_ROWS : tiled_gemm_tile_width();
    return M <= GEMV_ROWS ? NULL : aligned_alloc(64, sizeof(float) * ((width * K + 15) / 16 * 16));
}

/* x packed for the batch path (batch_columns_of), or NULL on the other paths; *failed set when
 * out of memory */
static float *batch_x(const float *x, int64_t M, int64_t K, int *failed) {
#if GEMM_AVX512
    if (!batch_path(M)) return NULL;
    float *xt = batch_columns_of(x, M, K);
    if (xt == NULL) *failed = 1;
    return xt;
#else
    (void)x, (void)M, (void)K, (void)failed;
    return NULL;
#endif
}

/* one work item's columns, out[m, j] = x[m] . W[n0 + j]: the batch path's when xt is not NULL */
static void item_columns(const QuantKind *kind, const float *x, const float *xt, const void *w, int64_t K,
                         int64_t M, int64_t n0, int64_t width, float *out, int64_t ld, float *tile) {
#if GEMM_AVX512
    if (xt != NULL) {
        batch_columns(kind, xt, w, K, M, n0, width, out, ld, tile);
        return;
    }
#else
    (void)xt;
#endif
    kind->columns(x, w, K, M, n0, width, out, ld, tile);
}

int quant_linear_f32(const float *x, const void *w, int64_t type, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N, int64_t ldy) {
    const QuantKind *kind = kind_of(type, K);
    if (kind == NULL) return 2;
    const int64_t step = columns_per_item(M), items = (N + step - 1) / step;
    float *ordered = NULL;
    if (kind->lane_order && M <= GEMV_ROWS) {
        if ((ordered = malloc(sizeof(float) * M * K)) == NULL) return 1;
        to_lane_order(x, ordered, M * K);
        x = ordered;
    }
    int failed = 0;
    float *xt = batch_x(x, M, K, &failed);
    if (failed) {
        free(ordered);
        return 1;
    }
#pragma omp parallel
    {
        float *tile = tile_for(M, K);
        const int missing = M > GEMV_ROWS && tile == NULL;
        if (missing) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < items; t++) {
            if (missing) continue;
            const int64_t n0 = t * step, width = N - n0 < step ? N - n0 : step;
            item_columns(kind, x, xt, w, K, M, n0, width, y + n0, ldy, tile);
            if (bias != NULL) /* added after the sum, as the tiled GEMM adds it */
                for (int64_t m = 0; m < M; m++)
                    for (int64_t j = 0; j < width; j++) y[m * ldy + n0 + j] += bias[n0 + j];
        }
        free(tile);
    }
    free(ordered);
    free(xt);
    return failed;
}

#if GEMM_AMX
#include "quant_amx.h"
#endif

int quant_linear_bf16(const uint16_t *x, const void *w, int64_t type, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t K, int64_t N, int64_t ldy) {
    const QuantKind *kind = kind_of(type, K);
    if (kind == NULL) return 2;
#if GEMM_AMX
    if (M >= AMX_QUANT_ROWS && amx_usable()) return quant_amx_linear_bf16(kind, x, w, bias, y, M, K, N, ldy);
#endif
    const int64_t step = columns_per_item(M), items = (N + step - 1) / step;
    float *wide = malloc(sizeof(float) * (M * K > 0 ? M * K : 1));
    if (wide == NULL) return 1;
    for (int64_t i = 0; i < M * K; i++) wide[i] = bf16_to_f32(x[i]);
    if (kind->lane_order && M <= GEMV_ROWS) { /* in place, a block of 16 at a time */
        float block[16];
        for (int64_t c = 0; c < M * K; c += 16) {
            memcpy(block, wide + c, sizeof block);
            to_lane_order(block, wide + c, 16);
        }
    }
    int failed = 0;
    float *xt = batch_x(wide, M, K, &failed);
    if (failed) {
        free(wide);
        return 1;
    }
#pragma omp parallel
    {
        float *tile = tile_for(M, K), *acc = malloc(sizeof(float) * (M * step > 0 ? M * step : 1));
        const int missing = (M > GEMV_ROWS && tile == NULL) || acc == NULL;
        if (missing) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < items; t++) {
            if (missing) continue;
            const int64_t n0 = t * step, width = N - n0 < step ? N - n0 : step;
            item_columns(kind, wide, xt, w, K, M, n0, width, acc, step, tile);
            for (int64_t m = 0; m < M; m++)
                for (int64_t j = 0; j < width; j++) {
                    const float sum = acc[m * step + j];
                    y[m * ldy + n0 + j] = f32_to_bf16(bias == NULL ? sum : sum + bf16_to_f32(bias[n0 + j]));
                }
        }
        free(tile);
        free(acc);
    }
    free(wide);
    free(xt);
    return failed;
}
