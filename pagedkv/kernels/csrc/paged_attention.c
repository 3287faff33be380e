/*
 * Paged attention on the CPU, reading keys and values in place from the block pool. Entry
 * points, layouts and arguments: kernels.h.
 *
 * Work is split into pieces: a piece is a run of at most `chunk` consecutive context positions
 * of one query row, all heads at once. Walking a piece token by token reads each token's keys
 * (all KV heads: one contiguous Hkv * D run), so every block is read as one sequential stream
 * and no gathered copy of the context is ever made. Every piece produces an un-normalised
 * partial (running max, sum of exponentials, weighted sum of values per query head); a second
 * parallel loop merges a row's pieces with log-sum-exp rescaling (flash-decoding), so long rows
 * keep every core busy even at batch 1. A row reads only positions [first, pos] of its own
 * sequence: slots past a sequence's length are never touched. Arithmetic is float32 for every
 * storage dtype.
 *
 * What keeps it fed: every key or value vector is loaded (and converted) once for all query
 * heads of its KV head (grouped-query attention would read each KV head `group` times
 * otherwise); scores are stored head-major, so the softmax exponentials run along positions,
 * VL at a time; keys PREFETCH positions ahead are prefetched into L2 (PREFETCH_L2), since the
 * block table breaks the stream into block-sized runs that the hardware prefetcher restarts on.
 * The weighted sum of values runs one KV block (a segment of the piece) at a time and within it
 * one KV head at a time, with up to VGROUP query heads x VDIMS vectors of their sums held in
 * registers over the segment, so each block is read as one run, prefetched a block ahead. Both
 * passes' inner loops are instantiated for constant head and vector counts (keys and values in
 * paged_attention_body.h): compiled for a run-time count, every position would pay a dozen tests
 * and flag stores around its eight multiply-adds. None of this changes a sum's order: results are bit for bit
 * those of the plain loops.
 *
 * bfloat16 queries over a bfloat16 pool, where the target has AVX512-BF16 and the head dimension
 * is a multiple of 32, score on the instruction set's pair dot products instead
 * (paged_attention_pairs_body.h): keys need no conversion, and 16 positions' sums are reduced
 * by one tree where the float32 loop reduces every 4. Products are exact either way (a query
 * is a bfloat16); the sums run in another order, so these scores agree with the float32 loop's
 * to rounding, and every bfloat16 row the row kernel takes is scored this way.
 *
 * Rows that come as a run -- 2 to MAX_RUN consecutive positions of one sequence and no other row
 * of it beside them, as speculative decoding's k + 1 verified rows do -- share their pieces: a
 * piece of a run is computed lanes across the run's query heads of one KV head (attend_lanes,
 * the prefill tiles' layout), so each key and value element is loaded once for all of them and a
 * position's scores need no horizontal sums; each row still sees only positions up to its own.
 * Such a row's sums run in another order than a lone row's (its results agree to rounding);
 * everything else is unchanged, and a run is computed the same way whatever else is in the call.
 *
 * Quantized pools (fp8 e4m3 or int8, one byte per element) are read in place too: each element
 * becomes a float in registers (int8 by conversion, fp8 by moving its bits into a float32's
 * exponent and mantissa) once, and serves every query head of its KV head from registers (up
 * to GROUPS at a time for keys); the float32 scale of each token and KV head multiplies the
 * whole dot product (keys) or the converted vector (values). Query and output keep the model's
 * dtype.
 *
 * Prefill has a second entry (unquantized pools, no window or soft cap): a row kernel reads a
 * prompt's keys and values once per query row, so a run of n new tokens costs n passes over its
 * context. Its work item is instead a tile of consecutive query rows of one sequence and one KV
 * head, VL lanes wide (VL / group rows, each with its group of query heads): every key or value
 * element is loaded once per tile and broadcast against all lanes, so the scores of a position
 * come out lane-wise, ready for a lane-wise softmax, with no horizontal sums. It needs
 * D % 16 == 0 and group | VL, and returns 2 otherwise.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"

#define TOKENS 4 /* tokens scored together: independent FMA chains, one q load for four keys */
/* query heads scored together per loaded (and converted) key vector: as many as keep their
 * accumulators in registers (16 of them with AVX2 and below: four heads' 16 accumulators would
 * spill to the stack and be cleared with a memset call per step) */
#if VL == 16
#define GROUPS 4
#else
#define GROUPS 2
#endif
#define PREFETCH 16 /* positions ahead whose keys are prefetched (values: a block ahead, in pass 2) */
/* Prefetches go to L2, not L1 (prefetcht1, not t0): 16 positions of keys are half of a 32 KiB
 * L1, and lines pulled there early are evicted again before their turn. */
#define PREFETCH_L2(p) __builtin_prefetch((p), 0, 2)
#define VGROUP 4 /* query heads whose value sums stay in registers together */
#define VDIMS 4 /* vectors of the head dimension whose value sums stay in registers together */
#define MAX_RUN 16 /* the most rows of one sequence computed together (paged_attention_rows) */
/* Prefill tiles (paged_attention_prefill_body.h) and runs of rows (attend_lanes): TILE_KEYS key
 * positions scored together (one multiply-add per position for each element of the query tile),
 * TILE_VALUES positions whose values are gathered (converted to float32 once) per pass over the
 * value sums, TILE_DIMS vectors of value sums held in registers. */
#define TILE_KEYS 8
#define TILE_VALUES 64
#define TILE_DIMS 16
_Static_assert(TILE_VALUES >= TILE_KEYS, "the staging buffer holds TILE_VALUES rows");
_Static_assert(TOKENS == 4, "hsum4 reduces exactly four accumulators");

/* Loads of VL elements (vector) or one element (scalar) into float32; scalar stores back
 * (vload_bf16: the instruction set's, simd.h). */
static inline vf vload_f32(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
static inline float load_f32(const float *p) { return *p; }
static inline float load_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline void store_f32(float *p, float x) { *p = x; }
/* float16 needs the compiler's _Float16 (GCC >= 12, recent clang); PAGEDKV_NO_F16 leaves it out. */
#ifndef PAGEDKV_NO_F16
static inline vf vload_f16(const _Float16 *p) { vh x; memcpy(&x, p, sizeof x); return __builtin_convertvector(x, vf); }
static inline float load_f16(const _Float16 *p) { return (float)*p; }
static inline void store_f16(_Float16 *p, float x) { *p = (_Float16)x; }
#endif
static inline void store_bf16(uint16_t *p, float x) { *p = f32_to_bf16(x); }
static inline void vstore(float *p, vf x) { memcpy(p, &x, sizeof x); }
static inline vf vmax(vf a, vf b) {
    const vi a_greater = a > b;
    return (vf)(((vi)a & a_greater) | ((vi)b & ~a_greater));
}

/* One-byte quantized elements. fp8 e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits.
 * Placed at a float32's exponent/mantissa boundary (<< 20) the bits read as the same number
 * times 2^-120 (bias 127 vs 7), subnormals included, so one multiply by 2^120 finishes the
 * conversion. The quantizer never stores NaN (0x7F/0xFF), so no lane needs special handling. */
typedef uint8_t vu8 __attribute__((vector_size(VL)));
typedef int8_t vi8 __attribute__((vector_size(VL)));
static inline vf vload_fp8(const uint8_t *p) {
    vu8 x;
    memcpy(&x, p, sizeof x);
    const vu b = __builtin_convertvector(x, vu);
    return (vf)(((b & 0x7Fu) << 20) | ((b & 0x80u) << 24)) * 0x1p120f;
}
static inline float load_fp8(const uint8_t *p) {
    const uint32_t b = *p, u = ((b & 0x7Fu) << 20) | ((b & 0x80u) << 24);
    float f;
    memcpy(&f, &u, sizeof f);
    return f * 0x1p120f;
}
static inline vf vload_i8(const int8_t *p) { vi8 x; memcpy(&x, p, sizeof x); return __builtin_convertvector(x, vf); }
static inline float load_i8(const int8_t *p) { return (float)*p; }

/* The lane sums of four vectors at once (a transposing tree: 13 shuffles/adds instead of 4
 * separate horizontal sums); sums[] receives sum(a), sum(b), sum(c), sum(d). */
static inline void hsum4(vf a, vf b, vf c, vf d, float sums[4]) {
    const int q = VL / 4;
    vi lo1, hi1, lo2, hi2, lane;
    for (int i = 0; i < VL; i++) {
        lane[i] = i;
        lo1[i] = i < VL / 2 ? i : VL + i - VL / 2;
        hi1[i] = lo1[i] + VL / 2;
        const int g = i / q;
        lo2[i] = (g % 2 ? VL : 0) + (g / 2 ? VL / 2 : 0) + i % q;
        hi2[i] = lo2[i] + q;
    }
    const vf ab = __builtin_shuffle(a, b, lo1) + __builtin_shuffle(a, b, hi1);
    const vf cd = __builtin_shuffle(c, d, lo1) + __builtin_shuffle(c, d, hi1);
    vf x = __builtin_shuffle(ab, cd, lo2) + __builtin_shuffle(ab, cd, hi2); /* groups: a c b d */
    for (int k = q / 2; k > 0; k /= 2) x += __builtin_shuffle(x, lane ^ k);
    sums[0] = x[0];
    sums[1] = x[2 * q];
    sums[2] = x[q];
    sums[3] = x[3 * q];
}

/* exp(x) for x <= 0 (a score minus its row's max), Cephes-style: 2^n * p(r), |r| <= ln2 / 2,
 * about 1 ulp; inputs below -87 (results under 1.7e-38) flush to 0. */
static inline vf vexp(vf x) {
    const vi tiny = x < -87.0f;
    x = (vf)(((vi)x & ~tiny) | ((vi)((vf){0} - 87.0f) & tiny));
    vf n;
    const vf y = exp_reduced(x, &n);
    const vi scale = (__builtin_convertvector(n, vi) + 127) << 23;
    return (vf)((vi)(y * (vf)scale) & ~tiny);
}

/* The lane-wise passes of a prefill tile and of a run of rows (paged_attention_prefill_body.h,
 * attend_lanes): the query tile qt [D, VL] holds element d of each lane's query, the scores
 * sc [positions, VL] one position's scores of every lane. */

/* acc[u] = the lanes' dot products with key row k[u], for TILE_KEYS keys */
static inline __attribute__((always_inline)) void lane_scores(const float *qt, const float *const *k,
                                                              int64_t D, vf *acc) {
    for (int u = 0; u < TILE_KEYS; u++) acc[u] = (vf){0};
    for (int64_t d = 0; d < D; d++) {
        const vf qd = vload_f32(qt + d * VL);
        for (int u = 0; u < TILE_KEYS; u++) acc[u] += qd * k[u][d];
    }
}

/* the n positions' scores become exp(score - mv), lane-wise; returns each lane's sum of them */
static inline vf lane_softmax(float *sc, int64_t n, vf mv) {
    vf lv = {0};
    for (int64_t i = 0; i < n; i++) {
        const vf p = vexp(vload_f32(sc + i * VL) - mv);
        vstore(sc + i * VL, p);
        lv += p;
    }
    return lv;
}

/* ot [D, VL] += the weights sc [cnt, VL] times the value rows v[u], TILE_DIMS vectors of ot
 * held in registers over the cnt rows */
static inline __attribute__((always_inline)) void lane_values(float *ot, const float *sc,
                                                              const float *const *v, int64_t cnt, int64_t D) {
    for (int64_t d0 = 0; d0 < D; d0 += TILE_DIMS) {
        vf o[TILE_DIMS];
        for (int e = 0; e < TILE_DIMS; e++) o[e] = vload_f32(ot + (d0 + e) * VL);
        for (int64_t u = 0; u < cnt; u++) {
            const vf p = vload_f32(sc + u * VL);
            for (int e = 0; e < TILE_DIMS; e++) o[e] += p * v[u][d0 + e];
        }
        for (int e = 0; e < TILE_DIMS; e++) vstore(ot + (d0 + e) * VL, o[e]);
    }
}

typedef struct {
    int64_t num_heads, kv_heads, head_dim, block_size;
    float scale, soft_cap;
    /* log2(block_size) when it is a power of two (16 by default), else -1: a slot is then a
     * shift and a mask, not two integer divisions per position */
    int block_shift;
} Shape;

static inline int block_shift_of(int64_t block_size) {
    for (int shift = 0; shift < 31; shift++)
        if ((int64_t)1 << shift == block_size) return shift;
    return -1;
}

/* query rows x query heads per prefill tile: VL lanes */
int64_t paged_attention_prefill_lanes(void) { return VL; }

/* the entry points for each pair of query and pool dtypes: paged_attention_body.h (and the prefill
 * entry for unquantized pools: paged_attention_prefill_body.h) */
#define SUFFIX(name) name##_f32
#define QT float
#define QS f32
#define KT float
#define KS f32
#define SCALED 0
#include "paged_attention_body.h"

#define SUFFIX(name) name##_bf16
#define QT uint16_t
#define QS bf16
#define KT uint16_t
#define KS bf16
#define SCALED 0
#if GEMM_AVX512_BF16
#define PAIRS /* pass 1 on bfloat16 pairs, pass 2 reading pairs: paged_attention_pairs_body.h */
#endif
#include "paged_attention_body.h"

#define SUFFIX(name) name##_f32_fp8
#define QT float
#define QS f32
#define KT uint8_t
#define KS fp8
#define SCALED 1
#include "paged_attention_body.h"

#define SUFFIX(name) name##_f32_i8
#define QT float
#define QS f32
#define KT int8_t
#define KS i8
#define SCALED 1
#include "paged_attention_body.h"

#define SUFFIX(name) name##_bf16_fp8
#define QT uint16_t
#define QS bf16
#define KT uint8_t
#define KS fp8
#define SCALED 1
#include "paged_attention_body.h"

#define SUFFIX(name) name##_bf16_i8
#define QT uint16_t
#define QS bf16
#define KT int8_t
#define KS i8
#define SCALED 1
#include "paged_attention_body.h"

#ifndef PAGEDKV_NO_F16

#define SUFFIX(name) name##_f16
#define QT _Float16
#define QS f16
#define KT _Float16
#define KS f16
#define SCALED 0
#include "paged_attention_body.h"

#define SUFFIX(name) name##_f16_fp8
#define QT _Float16
#define QS f16
#define KT uint8_t
#define KS fp8
#define SCALED 1
#include "paged_attention_body.h"

#define SUFFIX(name) name##_f16_i8
#define QT _Float16
#define QS f16
#define KT int8_t
#define KS i8
#define SCALED 1
#include "paged_attention_body.h"
#endif
