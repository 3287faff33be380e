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
 * passes' inner loops are instantiated for constant head and vector counts (keys_ and values_
 * below): compiled for a run-time count, every position would pay a dozen tests and flag stores
 * around its eight multiply-adds. None of this changes a sum's order: results are bit for bit
 * those of the plain loops.
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

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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
/* Prefill tiles (DEFINE_PREFILL) and runs of rows (attend_lanes): TILE_KEYS key positions scored together (one multiply-add per
 * position for each element of the query tile), TILE_VALUES positions whose values are gathered
 * (converted to float32 once) per pass over the value sums, TILE_DIMS vectors of value sums held
 * in registers. */
#define TILE_KEYS 8
#define TILE_VALUES 64
#define TILE_DIMS 16
_Static_assert(TILE_VALUES >= TILE_KEYS, "the staging buffer holds TILE_VALUES rows");
_Static_assert(TOKENS == 4, "hsum4 reduces exactly four accumulators");

/* Loads of VL elements (vector) or one element (scalar) into float32; scalar stores back. */
static inline vf vload_f32(const float *p) { vf x; memcpy(&x, p, sizeof x); return x; }
#if defined(__AVX512F__)
/* one widening load and one shift: GCC lowers the generic conversion below to halves put
 * together with inserts and extracts, which made bfloat16 slower per byte than float32 */
static inline vf vload_bf16(const uint16_t *p) {
    return (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#else
static inline vf vload_bf16(const uint16_t *p) {
    vu16 x;
    memcpy(&x, p, sizeof x);
    return (vf)(__builtin_convertvector(x, vi) << 16);
}
#endif
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

/* NAME: the entry point's suffix; QS/QT: query and output dtype; KS/KT: the pools' element type;
 * SCALED: 1 when the pools are quantized (their scales are read), else 0 (scales are NULL). */
#define DEFINE_PAGED_ATTENTION(NAME, QS, QT, KS, KT, SCALED)                                                          \
static inline int64_t slot_##NAME(const Shape *s, const int32_t *table, int64_t t) {            \
    if (s->block_shift >= 0)                                                                       \
        return ((int64_t)table[t >> s->block_shift] << s->block_shift) | (t & (s->block_size - 1)); \
    return (int64_t)table[t / s->block_size] * s->block_size + t % s->block_size;                  \
}                                                                                                  \
                                                                                                   \
/* Pass 1's inner step: the scores of TOKENS keys k[u] (KV head h) for gn query heads whose    \
 * float32 queries start at q (D apart), into rows[g * ld + u] for positions i0 + u < n. Each key  \
 * vector is loaded (and converted) once for all gn heads. Called with a constant gn where it   \
 * can be (gn <= GROUPS). */                                                                      \
static inline __attribute__((always_inline)) void keys_##NAME(                                     \
    const KT *const k[TOKENS], const float *const ks[TOKENS], const float *q, float *rows,         \
    int64_t h, int64_t i0, int64_t n, int64_t ld, int64_t D, int64_t vec_d, int64_t gn) {          \
    vf acc_g[GROUPS][TOKENS] = {{{0}}};                                                            \
    for (int64_t d = 0; d < vec_d; d += VL) {                                                      \
        vf kv[TOKENS];                                                                             \
        for (int u = 0; u < TOKENS; u++) kv[u] = vload_##KS(k[u] + h * D + d);                     \
        for (int g = 0; g < GROUPS; g++)                                                           \
            if (g < gn) {                                                                          \
                const vf qv = vload_f32(q + g * D + d);                                            \
                for (int u = 0; u < TOKENS; u++) acc_g[g][u] += qv * kv[u];                        \
            }                                                                                      \
    }                                                                                              \
    for (int g = 0; g < gn; g++) {                                                                 \
        float dots[TOKENS];                                                                        \
        hsum4(acc_g[g][0], acc_g[g][1], acc_g[g][2], acc_g[g][3], dots);                           \
        if (vec_d == D && !SCALED) { /* rows has room past n (ld): the padding is reset later */  \
            memcpy(rows + g * ld, dots, sizeof dots);                                              \
            continue;                                                                              \
        }                                                                                          \
        for (int u = 0; u < TOKENS && i0 + u < n; u++) {                                           \
            for (int64_t d = vec_d; d < D; d++) dots[u] += q[g * D + d] * load_##KS(k[u] + h * D + d);\
            rows[g * ld + u] = SCALED ? dots[u] * ks[u][h] : dots[u];                              \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* Pass 2's inner run over one segment: len positions (scores columns i0...) in consecutive slots  \
 * from slot0, so the walk follows a pointer, no block table. out[g * D + e * VL ...] (+)=         \
 * sum_i p[head0 + g, i0 + i] * v[slot0 + i][dim0 + e * VL] for g < gj query heads and e < nd      \
 * vectors, the sums in registers over the segment (first: from zero, else from out, which the     \
 * previous segment left: the same adds in the same order as one run). Each position pulls its     \
 * share of the next segment's lines (*owed / *pulled, `lines` over `total` positions of all walks).\
 * Called with constant gj and nd where it can be, so the loop over positions has no tests in it. */\
static inline __attribute__((always_inline)) void values_##NAME(                                   \
    const Shape *s, const KT *value, const float *value_scale, int64_t slot0, int64_t i0, int64_t len,\
    const float *scores, int64_t ld, int64_t h, int64_t head0, int64_t dim0, float *out, int64_t D,\
    int64_t gj, int64_t nd, int first, const char *next, int64_t lines, int64_t total, int64_t *owed_at,\
    int64_t *pulled_at) {                                                                          \
    const int64_t HD = s->kv_heads * D;                                                            \
    vf av[VGROUP][VDIMS] = {{{0}}};                                                                \
    if (!first)                                                                                    \
        for (int g = 0; g < VGROUP; g++)                                                           \
            for (int e = 0; e < VDIMS; e++)                                                        \
                if (g < gj && e < nd) av[g][e] = vload_f32(out + g * D + e * VL);                  \
    int64_t owed = *owed_at, pulled = *pulled_at;                                                  \
    const KT *vp = value + slot0 * HD + dim0;                                                      \
    for (int64_t i = 0; i < len; i++, vp += HD) {                                                  \
        if (next != NULL)                                                                          \
            for (owed += lines; owed >= total; owed -= total) PREFETCH_L2(next + 64 * pulled++);   \
        vf vv[VDIMS];                                                                              \
        for (int e = 0; e < VDIMS; e++)                                                            \
            if (e < nd) vv[e] = SCALED ? vload_##KS(vp + e * VL) * value_scale[(slot0 + i) * s->kv_heads + h]\
                                       : vload_##KS(vp + e * VL);                                  \
        for (int g = 0; g < VGROUP; g++)                                                           \
            if (g < gj) {                                                                          \
                const float p = scores[(head0 + g) * ld + i0 + i];                                 \
                for (int e = 0; e < VDIMS; e++)                                                    \
                    if (e < nd) av[g][e] += p * vv[e];                                             \
            }                                                                                      \
    }                                                                                              \
    *owed_at = owed, *pulled_at = pulled;                                                          \
    for (int g = 0; g < gj; g++)                                                                   \
        for (int e = 0; e < nd; e++) vstore(out + g * D + e * VL, av[g][e]);                       \
}                                                                                                  \
                                                                                                   \
/* One piece: positions [t0, t1] of one row; writes its partial max/sum/acc for every head.     \
 * scores is head-major, [H][chunk rounded up to VL]: the softmax runs along tokens, VL at once. */\
static void attend_piece_##NAME(const Shape *s, const float *qf, const KT *key, const KT *value,  \
                                const float *key_scale, const float *value_scale,                  \
                                const int32_t *table, int64_t t0, int64_t t1, float *scores,       \
                                int64_t ld, float *maxs, float *sums, float *acc) {                \
    const int64_t H = s->num_heads, D = s->head_dim, n = t1 - t0 + 1, HD = s->kv_heads * D;        \
    const int64_t group = H / s->kv_heads, vec_d = D - D % VL, padded = (n + VL - 1) / VL * VL;    \
    /* pass 1: scores[j * ld + i] for position t0 + i, TOKENS positions at a time; each key       \
     * vector is loaded (and converted) once for up to GROUPS query heads of its KV head (heads    \
     * past the group repeat its last one; their sums are dropped) */                             \
    for (int64_t i0 = 0; i0 < n; i0 += TOKENS) {                                                   \
        const KT *k[TOKENS];                                                                       \
        const float *ks[TOKENS];                                                                   \
        for (int u = 0; u < TOKENS; u++) {                                                         \
            const int64_t slot = slot_##NAME(s, table, t0 + (i0 + u < n ? i0 + u : n - 1));        \
            k[u] = key + slot * HD;                                                                \
            ks[u] = SCALED ? key_scale + slot * s->kv_heads : NULL;                                \
        }                                                                                          \
        /* the keys PREFETCH positions ahead, each KV head's turn pulling its share: issued at once,\
         * the 64 lines would stall the loop on a full miss queue */                               \
        const char *next = NULL;                                                                   \
        int64_t ahead = 0;                                                                         \
        if (i0 + PREFETCH < n) {                                                                   \
            next = (const char *)(key + slot_##NAME(s, table, t0 + i0 + PREFETCH) * HD);           \
            ahead = (int64_t)sizeof(KT) * HD * (n - i0 - PREFETCH < TOKENS ? n - i0 - PREFETCH : TOKENS);\
        }                                                                                          \
        for (int64_t h = 0; h < s->kv_heads; h++) {                                                \
            for (int64_t b = h * ahead / s->kv_heads / 64 * 64; b < (h + 1) * ahead / s->kv_heads; b += 64)\
                PREFETCH_L2(next + b);                                                             \
            for (int64_t g0 = 0; g0 < group; g0 += GROUPS) {                                       \
                /* a constant head count compiles to a loop with no tests in it */                 \
                const int64_t gn = group - g0 < GROUPS ? group - g0 : GROUPS;                      \
                const float *q0 = qf + (h * group + g0) * D;                                       \
                float *row = scores + (h * group + g0) * ld + i0;                                  \
                if (gn == 2)                                                                       \
                    keys_##NAME(k, ks, q0, row, h, i0, n, ld, D, vec_d, 2);                        \
                else if (gn == GROUPS)                                                             \
                    keys_##NAME(k, ks, q0, row, h, i0, n, ld, D, vec_d, GROUPS);                   \
                else if (gn == 1)                                                                  \
                    keys_##NAME(k, ks, q0, row, h, i0, n, ld, D, vec_d, 1);                        \
                else                                                                               \
                    keys_##NAME(k, ks, q0, row, h, i0, n, ld, D, vec_d, gn);                       \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
    /* per head: scale, soft-cap, max and softmax numerators, VL positions at a time (padding     \
     * positions hold -inf, whose exponential is 0) */                                             \
    for (int64_t j = 0; j < H; j++) {                                                              \
        float *row = scores + j * ld;                                                              \
        for (int64_t i = 0; i < n; i++) row[i] *= s->scale;                                        \
        if (s->soft_cap > 0.0f)                                                                    \
            for (int64_t i = 0; i < n; i++) row[i] = s->soft_cap * tanhf(row[i] / s->soft_cap);    \
        for (int64_t i = n; i < padded; i++) row[i] = -INFINITY;                                   \
        vf mv = vload_f32(row);                                                                    \
        for (int64_t i = VL; i < padded; i += VL) {                                                \
            mv = vmax(mv, vload_f32(row + i));                                                     \
        }                                                                                          \
        float m = mv[0];                                                                           \
        for (int l = 1; l < VL; l++) m = mv[l] > m ? mv[l] : m;                                    \
        vf sv = {0};                                                                               \
        for (int64_t i = 0; i < padded; i += VL) {                                                 \
            const vf p = vexp(vload_f32(row + i) - m);                                             \
            vstore(row + i, p);                                                                    \
            sv += p;                                                                               \
        }                                                                                          \
        float sum = 0.0f;                                                                          \
        for (int l = 0; l < VL; l++) sum += sv[l];                                                 \
        maxs[j] = m;                                                                               \
        sums[j] = sum;                                                                             \
    }                                                                                              \
    /* pass 2: acc[j] = sum_i p[j, i] * v[t0 + i], one segment (the piece's part of one KV block)  \
     * at a time, within it one KV head, up to VGROUP of its query heads and VDIMS vectors of the  \
     * head dimension at a time, the partial sums in registers over the segment; each value vector \
     * is loaded (converted and scaled) once per VGROUP query heads. The walks of a segment pull   \
     * the next segment's values into L2 between them: walked across all positions instead, each   \
     * walk would read a 128-byte slice of every position's values (1 KiB apart in float32). */  \
    const int64_t walks = s->kv_heads * ((group + VGROUP - 1) / VGROUP) * ((vec_d + VL * VDIMS - 1) / (VL * VDIMS));\
    for (int64_t i0 = 0; i0 < n;) {                                                                \
        const int64_t into = (t0 + i0) % s->block_size, slot0 = slot_##NAME(s, table, t0 + i0);    \
        const int64_t len = n - i0 < s->block_size - into ? n - i0 : s->block_size - into, i1 = i0 + len;\
        const char *next = NULL;                                                                   \
        int64_t lines = 0, owed = 0, pulled = 0, total = walks * len;                              \
        if (i1 < n) {                                                                              \
            next = (const char *)(value + slot_##NAME(s, table, t0 + i1) * HD);                    \
            lines = ((n - i1 < s->block_size ? n - i1 : s->block_size) * HD * (int64_t)sizeof(KT) + 63) / 64;\
        }                                                                                          \
        for (int64_t h = 0; h < s->kv_heads; h++)                                                  \
            for (int64_t j0 = h * group; j0 < (h + 1) * group; j0 += VGROUP) {                     \
                const int64_t gj = (h + 1) * group - j0 < VGROUP ? (h + 1) * group - j0 : VGROUP;  \
                for (int64_t d0 = 0; d0 < vec_d; d0 += VL * VDIMS) {                               \
                    const int64_t nd = (vec_d - d0) / VL < VDIMS ? (vec_d - d0) / VL : VDIMS;      \
                    float *o = acc + j0 * D + d0;                                                  \
                    const int64_t dim0 = h * D + d0;                                               \
                    /* whole groups of VDIMS vectors with a fixed head count compile to a loop     \
                     * with no tests in it (D = 64, 128: every group; D = 32: one group of 2       \
                     * vectors); the general case tests per position */                            \
                    if (nd == VDIMS && gj == 2)                                                    \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 2, VDIMS, i0 == 0, next, lines, total, &owed, &pulled);\
                    else if (nd == VDIMS && gj == 1)                                               \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 1, VDIMS, i0 == 0, next, lines, total, &owed, &pulled);\
                    else if (nd == VDIMS && gj == 4)                                               \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 4, VDIMS, i0 == 0, next, lines, total, &owed, &pulled);\
                    else if (nd == 2 && gj == 2) /* D = 32 (small models) */                       \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 2, 2, i0 == 0, next, lines, total, &owed, &pulled);\
                    else if (nd == 2 && gj == 1)                                                   \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 1, 2, i0 == 0, next, lines, total, &owed, &pulled);\
                    else if (nd == 2 && gj == 4)                                                   \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 4, 2, i0 == 0, next, lines, total, &owed, &pulled);\
                    else                                                                           \
                        values_##NAME(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, gj, nd, i0 == 0, next, lines, total, &owed, &pulled);\
                }                                                                                  \
            }                                                                                      \
        i0 = i1;                                                                                   \
    }                                                                                              \
    for (int64_t h = 0; h < s->kv_heads; h++) /* the head dimension's tail past its whole vectors */\
        for (int64_t d = vec_d; d < D; d++)                                                        \
            for (int64_t j = h * group; j < (h + 1) * group; j++) {                                \
                float sum = 0.0f;                                                                  \
                for (int64_t i = 0; i < n; i++) {                                                  \
                    const int64_t slot = slot_##NAME(s, table, t0 + i);                            \
                    const float x = load_##KS(value + slot * HD + h * D + d);                      \
                    sum += scores[j * ld + i] * (SCALED ? x * value_scale[slot * s->kv_heads + h] : x);\
                }                                                                                  \
                acc[j * D + d] = sum;                                                              \
            }                                                                                      \
}                                                                                                  \
                                                                                                   \
/* A key or value vector of one KV head as float32 (scaled by `scale`): in place for a float32     \
 * pool, else converted into `stage`. */                                                           \
static inline const float *lane_row_##NAME(const KT *src, float *stage, int64_t D, float scale) {  \
    if (sizeof(KT) == sizeof(float) && !SCALED) return (const float *)(const void *)src;           \
    for (int64_t d = 0; d < D; d++) stage[d] = load_##KS(src + d) * scale;                         \
    return stage;                                                                                  \
}                                                                                                  \
                                                                                                   \
/* One piece of a run of m rows of one sequence at consecutive positions (m * group <= VL), for KV \
 * head h: lane r * group + g is row r's query head h * group + g (lanes past m * group repeat the \
 * last row), row r covering positions [t0, t1[r]]. Every key or value element is loaded (and      \
 * converted) once for all lanes and broadcast against them, so a position's scores come out       \
 * lane-wise, ready for a lane-wise softmax with no horizontal sums: the k + 1 rows of a           \
 * speculative verification cost about what one row does. Writes each row's partial max, sum and   \
 * weighted values for its query heads of h at outs[r], in the row kernel's layout. */             \
static void attend_lanes_##NAME(const Shape *s, const float *qf, const KT *key, const KT *value,   \
                                const float *key_scale, const float *value_scale, const int32_t *table,\
                                int64_t h, int64_t t0, const int64_t *t1, int64_t m, float *qt, float *sc,\
                                float *ot, float *stage, float *const *outs) {                     \
    const int64_t H = s->num_heads, D = s->head_dim, HD = s->kv_heads * D, group = H / s->kv_heads;\
    const int64_t n = t1[m - 1] - t0 + 1;                                                          \
    vi lane_end; /* each lane's last position, from t0 */                                          \
    for (int64_t lane = 0; lane < VL; lane++) {                                                    \
        const int64_t r = lane / group < m ? lane / group : m - 1;                                 \
        lane_end[lane] = (int32_t)(t1[r] - t0);                                                    \
        const float *qp = qf + r * H * D + (h * group + lane % group) * D;                         \
        for (int64_t d = 0; d < D; d++) qt[d * VL + lane] = qp[d];                                 \
    }                                                                                              \
    vf mv = (vf){0} - INFINITY;                                                                    \
    for (int64_t i0 = 0; i0 < n; i0 += TILE_KEYS) {                                                \
        const int64_t cnt = n - i0 < TILE_KEYS ? n - i0 : TILE_KEYS;                               \
        const float *k[TILE_KEYS];                                                                 \
        float kscale[TILE_KEYS];                                                                   \
        for (int u = 0; u < TILE_KEYS; u++) {                                                      \
            const int64_t slot = slot_##NAME(s, table, t0 + i0 + (u < cnt ? u : cnt - 1));         \
            k[u] = lane_row_##NAME(key + slot * HD + h * D, stage + u * D, D, 1.0f);               \
            kscale[u] = SCALED ? key_scale[slot * s->kv_heads + h] : 1.0f;                         \
        }                                                                                          \
        vf acc[TILE_KEYS];                                                                         \
        for (int u = 0; u < TILE_KEYS; u++) acc[u] = (vf){0};                                      \
        for (int64_t d = 0; d < D; d++) {                                                          \
            const vf qd = vload_f32(qt + d * VL);                                                  \
            for (int u = 0; u < TILE_KEYS; u++) acc[u] += qd * k[u][d];                            \
        }                                                                                          \
        for (int u = 0; u < cnt; u++) {                                                            \
            vf score = (SCALED ? acc[u] * kscale[u] : acc[u]) * s->scale;                          \
            if (s->soft_cap > 0.0f)                                                                \
                for (int l = 0; l < VL; l++) score[l] = s->soft_cap * tanhf(score[l] / s->soft_cap);\
            score = vselect(lane_end >= (vi){0} + (int32_t)(i0 + u), score, (vf){0} - INFINITY);   \
            vstore(sc + (i0 + u) * VL, score);                                                     \
            mv = vmax(mv, score);                                                                  \
        }                                                                                          \
    }                                                                                              \
    vf lv = {0};                                                                                   \
    for (int64_t i = 0; i < n; i++) {                                                              \
        const vf p = vexp(vload_f32(sc + i * VL) - mv);                                            \
        vstore(sc + i * VL, p);                                                                    \
        lv += p;                                                                                   \
    }                                                                                              \
    for (int64_t d = 0; d < D * VL; d++) ot[d] = 0.0f;                                             \
    for (int64_t i0 = 0; i0 < n; i0 += TILE_VALUES) {                                              \
        const int64_t cnt = n - i0 < TILE_VALUES ? n - i0 : TILE_VALUES;                           \
        const float *v[TILE_VALUES];                                                               \
        for (int64_t u = 0; u < cnt; u++) {                                                        \
            const int64_t slot = slot_##NAME(s, table, t0 + i0 + u);                               \
            const float vscale = SCALED ? value_scale[slot * s->kv_heads + h] : 1.0f;              \
            v[u] = lane_row_##NAME(value + slot * HD + h * D, stage + u * D, D, vscale);           \
        }                                                                                          \
        for (int64_t d0 = 0; d0 < D; d0 += TILE_DIMS) {                                            \
            vf o[TILE_DIMS];                                                                       \
            for (int e = 0; e < TILE_DIMS; e++) o[e] = vload_f32(ot + (d0 + e) * VL);              \
            for (int64_t u = 0; u < cnt; u++) {                                                    \
                const vf p = vload_f32(sc + (i0 + u) * VL);                                        \
                for (int e = 0; e < TILE_DIMS; e++) o[e] += p * v[u][d0 + e];                      \
            }                                                                                      \
            for (int e = 0; e < TILE_DIMS; e++) vstore(ot + (d0 + e) * VL, o[e]);                  \
        }                                                                                          \
    }                                                                                              \
    for (int64_t lane = 0; lane < m * group; lane++) {                                             \
        float *o = outs[lane / group];                                                             \
        const int64_t j = h * group + lane % group;                                                \
        o[j] = mv[lane];                                                                           \
        o[H + j] = lv[lane];                                                                       \
        for (int64_t d = 0; d < D; d++) o[2 * H + j * D + d] = ot[d * VL + lane];                  \
    }                                                                                              \
}                                                                                                  \
int paged_attention_rows_##NAME(                                                                   \
    const QT *q, const KT *key, const KT *value, const float *key_scale, const float *value_scale, \
    const int32_t *block_tables,                                                                   \
    const int32_t *row_seq, const int32_t *row_pos, QT *out, int64_t num_rows, int64_t num_heads,  \
    int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,       \
    int64_t window, float soft_cap, int64_t chunk, int num_threads) {                              \
    const Shape s = {num_heads, kv_heads, head_dim, block_size, scale, soft_cap,                   \
                     block_shift_of(block_size)};                                                  \
    const int64_t H = num_heads, D = head_dim, stride = H * (D + 2), group = H / kv_heads;         \
    /* runs: 2 to MAX_RUN rows of one sequence at consecutive positions, and no other row of it    \
     * next to them (speculative decoding's k + 1 rows), are computed together, lanes across their \
     * query heads, when the head shape allows it; any other row alone. Every row's pieces start   \
     * at the same positions either way (a window's rows never run together). */                   \
    const int laned = window <= 0 && VL % group == 0 && D % TILE_DIMS == 0;                        \
    int64_t *piece_start = malloc(sizeof(int64_t) * (num_rows + 1));                               \
    int64_t *run_start = malloc(sizeof(int64_t) * (num_rows + 1));                                 \
    if (!piece_start || !run_start) {                                                              \
        free(piece_start), free(run_start);                                                        \
        return 1;                                                                                  \
    }                                                                                              \
    piece_start[0] = 0;                                                                            \
    int64_t num_runs = 0;                                                                          \
    for (int64_t r = 0, end; r < num_rows; r = end) {                                              \
        for (end = r + 1; end < num_rows && row_seq[end] == row_seq[r] && row_pos[end] == row_pos[end - 1] + 1;) end++;\
        const int together = laned && end - r >= 2 && end - r <= MAX_RUN;                          \
        for (int64_t i = r; i < end; i++) {                                                        \
            const int64_t last = row_pos[i];                                                       \
            const int64_t first = (window > 0 && last + 1 > window) ? last + 1 - window : 0;       \
            piece_start[i + 1] = piece_start[i] + (last - first + chunk) / chunk;                  \
            if (i == r || !together) run_start[num_runs++] = i;                                    \
        }                                                                                          \
    }                                                                                              \
    run_start[num_runs] = num_rows;                                                                \
    /* work items: (run, piece), a run having its last row's pieces, the most of its rows' */      \
    int64_t num_items = 0;                                                                         \
    for (int64_t u = 0; u < num_runs; u++)                                                         \
        num_items += piece_start[run_start[u + 1]] - piece_start[run_start[u + 1] - 1];            \
    float *part = malloc(sizeof(float) * piece_start[num_rows] * stride);                          \
    int64_t *item_run = malloc(sizeof(int64_t) * (num_items + 1));                                 \
    int64_t *item_piece = malloc(sizeof(int64_t) * (num_items + 1));                               \
    int failed = part == NULL || item_run == NULL || item_piece == NULL;                           \
    for (int64_t u = 0, i = 0; u < num_runs && !failed; u++) {                                     \
        const int64_t last = run_start[u + 1] - 1;                                                 \
        for (int64_t p = 0; p < piece_start[last + 1] - piece_start[last]; p++, i++)               \
            item_run[i] = u, item_piece[i] = p;                                                    \
    }                                                                                              \
    _Pragma("omp parallel num_threads(num_threads) if(!failed)")                                   \
    {                                                                                              \
        const int64_t ld = (chunk + VL - 1) / VL * VL + VL; /* +VL: rows off the 4 KiB stride */   \
        float *qf = malloc(sizeof(float) * MAX_RUN * H * D);                                       \
        float *scores = malloc(sizeof(float) * ld * (H > VL ? H : VL));                            \
        float *lanes = malloc(sizeof(float) * (2 * D * VL + D * TILE_VALUES));                     \
        if (!qf || !scores || !lanes) failed = 1;                                                  \
        _Pragma("omp for schedule(dynamic, 1)")                                                    \
        for (int64_t i = 0; i < num_items; i++) {                                                  \
            if (failed) continue;                                                                  \
            const int64_t u = item_run[i], p = item_piece[i], r1 = run_start[u + 1];               \
            const int64_t last = row_pos[r1 - 1];                                                  \
            const int64_t first = (window > 0 && last + 1 > window) ? last + 1 - window : 0;       \
            const int64_t t0 = first + p * chunk;                                                  \
            /* the run's rows that reach this piece: a suffix, as rows are in ascending positions */\
            int64_t r0 = run_start[u];                                                             \
            while (piece_start[r0 + 1] - piece_start[r0] <= p) r0++;                               \
            int64_t t1[MAX_RUN];                                                                   \
            float *outs[MAX_RUN];                                                                  \
            for (int64_t r = r0; r < r1; r++) {                                                    \
                t1[r - r0] = t0 + chunk - 1 < row_pos[r] ? t0 + chunk - 1 : row_pos[r];            \
                outs[r - r0] = part + (piece_start[r] + p) * stride;                               \
                for (int64_t e = 0; e < H * D; e++) qf[(r - r0) * H * D + e] = load_##QS(q + r * H * D + e);\
            }                                                                                      \
            const int32_t *table = block_tables + (int64_t)row_seq[r1 - 1] * max_blocks;           \
            if (r1 - run_start[u] == 1) {                                                          \
                float *pm = outs[0];                                                               \
                attend_piece_##NAME(&s, qf, key, value, key_scale, value_scale, table, t0, t1[0], scores,\
                                    ld, pm, pm + H, pm + 2 * H);                                   \
                continue;                                                                          \
            }                                                                                      \
            const int64_t per_tile = VL / group; /* rows whose query heads fill the lanes */       \
            for (int64_t r = r0; r < r1; r += per_tile) {                                          \
                const int64_t m = r1 - r < per_tile ? r1 - r : per_tile;                           \
                for (int64_t h = 0; h < kv_heads; h++)                                             \
                    attend_lanes_##NAME(&s, qf + (r - r0) * H * D, key, value, key_scale, value_scale, table, h,\
                                        t0, t1 + (r - r0), m, lanes, scores, lanes + D * VL,       \
                                        lanes + 2 * D * VL, outs + (r - r0));                      \
            }                                                                                      \
        }                                                                                          \
        /* merge a row's pieces, each rescaled by exp(its max - the row's max) */                  \
        _Pragma("omp for schedule(static)")                                                        \
        for (int64_t r = 0; r < num_rows; r++) {                                                   \
            if (failed) continue;                                                                  \
            for (int64_t j = 0; j < H; j++) {                                                      \
                float m = -INFINITY, l = 0.0f;                                                     \
                for (int64_t p = piece_start[r]; p < piece_start[r + 1]; p++)                      \
                    m = part[p * stride + j] > m ? part[p * stride + j] : m;                       \
                float *o = qf; /* reused as one head's float32 accumulator */                      \
                memset(o, 0, sizeof(float) * D);                                                   \
                for (int64_t p = piece_start[r]; p < piece_start[r + 1]; p++) {                    \
                    const float *pm = part + p * stride;                                           \
                    const float w = expf(pm[j] - m);                                               \
                    l += w * pm[H + j];                                                            \
                    for (int64_t d = 0; d < D; d++) o[d] += w * pm[2 * H + j * D + d];             \
                }                                                                                  \
                for (int64_t d = 0; d < D; d++) store_##QS(out + (r * H + j) * D + d, o[d] / l);   \
            }                                                                                      \
        }                                                                                          \
        free(lanes);                                                                               \
        free(scores);                                                                              \
        free(qf);                                                                                  \
    }                                                                                              \
    free(part);                                                                                    \
    free(item_run);                                                                                \
    free(item_piece);                                                                              \
    free(run_start);                                                                               \
    free(piece_start);                                                                             \
    return failed;                                                                                 \
}



/* query rows x query heads per prefill tile: VL lanes */
int64_t paged_attention_prefill_lanes(void) { return VL; }

#define DEFINE_PREFILL(NAME, QS, QT, KS, KT)                                                                  \
/* Prefill tiles: one work item is a tile of up to VL / group consecutive query rows of one                   \
 * sequence and one KV head, its VL lanes being those rows' query heads of that KV head. Keys                 \
 * and values are read once per tile (the row kernel reads them once per row) and every loaded                \
 * element serves all VL lanes: a broadcast multiply-add, so scores and value sums need no                    \
 * horizontal reduction. Pass 1 stores every score of the tile's range, lane-wise; the causal                 \
 * mask only touches positions past the tile's first row; pass 2 sums the values. */                          \
static inline const float *row_##NAME(const KT *src, float *stage, int64_t D) {                               \
    if (sizeof(KT) == sizeof(float)) return (const float *)(const void *)src;                                 \
    for (int64_t d = 0; d < D; d += VL) vstore(stage + d, vload_##KS(src + d));                               \
    return stage;                                                                                             \
}                                                                                                             \
                                                                                                              \
static void prefill_tile_##NAME(const Shape *s, const QT *q, const KT *key, const KT *value,                  \
                                const int32_t *table, int64_t row0, int64_t pos0, int64_t rows,               \
                                int64_t h, QT *out, float *qt, float *sc, float *ot, float *stage) {          \
    const int64_t H = s->num_heads, D = s->head_dim, HD = s->kv_heads * D, group = H / s->kv_heads;           \
    const int64_t n = pos0 + rows; /* key positions 0 .. the last row's */                                    \
    vi lane_pos;                                                                                              \
    for (int64_t lane = 0; lane < VL; lane++) { /* padding lanes repeat the tile's last row */                \
        const int64_t r = lane / group < rows ? lane / group : rows - 1;                                      \
        lane_pos[lane] = (int32_t)(pos0 + r);                                                                 \
        const QT *qp = q + ((row0 + r) * H + h * group + lane % group) * D;                                   \
        for (int64_t d = 0; d < D; d++) qt[d * VL + lane] = load_##QS(qp + d);                                \
    }                                                                                                         \
    vf mv = (vf){0} - INFINITY;                                                                               \
    for (int64_t t0 = 0; t0 < n; t0 += TILE_KEYS) {                                                           \
        const int64_t cnt = n - t0 < TILE_KEYS ? n - t0 : TILE_KEYS;                                          \
        const float *k[TILE_KEYS];                                                                            \
        for (int u = 0; u < TILE_KEYS; u++) {                                                                 \
            const int64_t t = t0 + (u < cnt ? u : cnt - 1);                                                   \
            k[u] = row_##NAME(key + slot_##NAME(s, table, t) * HD + h * D, stage + u * D, D);                 \
        }                                                                                                     \
        vf acc[TILE_KEYS];                                                                                    \
        for (int u = 0; u < TILE_KEYS; u++) acc[u] = (vf){0};                                                 \
        for (int64_t d = 0; d < D; d++) {                                                                     \
            const vf qd = vload_f32(qt + d * VL);                                                             \
            for (int u = 0; u < TILE_KEYS; u++) acc[u] += qd * k[u][d];                                       \
        }                                                                                                     \
        for (int u = 0; u < cnt; u++) {                                                                       \
            const int64_t t = t0 + u;                                                                         \
            vf score = acc[u] * s->scale;                                                                     \
            if (t > pos0) score = vselect(lane_pos >= (vi){0} + (int32_t)t, score, (vf){0} - INFINITY);                \
            vstore(sc + t * VL, score);                                                                       \
            mv = vmax(mv, score);                                                                             \
        }                                                                                                     \
    }                                                                                                         \
    vf lv = {0};                                                                                              \
    for (int64_t t = 0; t < n; t++) {                                                                         \
        const vf p = vexp(vload_f32(sc + t * VL) - mv);                                                       \
        vstore(sc + t * VL, p);                                                                               \
        lv += p;                                                                                              \
    }                                                                                                         \
    for (int64_t d = 0; d < D * VL; d++) ot[d] = 0.0f;                                                        \
    for (int64_t t0 = 0; t0 < n; t0 += TILE_VALUES) {                                                         \
        const int64_t cnt = n - t0 < TILE_VALUES ? n - t0 : TILE_VALUES;                                      \
        const float *v[TILE_VALUES];                                                                          \
        for (int64_t u = 0; u < cnt; u++)                                                                     \
            v[u] = row_##NAME(value + slot_##NAME(s, table, t0 + u) * HD + h * D, stage + u * D, D);          \
        for (int64_t d0 = 0; d0 < D; d0 += TILE_DIMS) {                                                       \
            vf o[TILE_DIMS];                                                                                  \
            for (int e = 0; e < TILE_DIMS; e++) o[e] = vload_f32(ot + (d0 + e) * VL);                         \
            for (int64_t u = 0; u < cnt; u++) {                                                               \
                const vf p = vload_f32(sc + (t0 + u) * VL);                                                   \
                for (int e = 0; e < TILE_DIMS; e++) o[e] += p * v[u][d0 + e];                                 \
            }                                                                                                 \
            for (int e = 0; e < TILE_DIMS; e++) vstore(ot + (d0 + e) * VL, o[e]);                             \
        }                                                                                                     \
    }                                                                                                         \
    for (int64_t lane = 0; lane < rows * group; lane++) {                                                     \
        QT *o = out + ((row0 + lane / group) * H + h * group + lane % group) * D;                             \
        for (int64_t d = 0; d < D; d++) store_##QS(o + d, ot[d * VL + lane] / lv[lane]);                      \
    }                                                                                                         \
}                                                                                                             \
                                                                                                              \
int paged_attention_prefill_##NAME(                                                                           \
    const QT *q, const KT *key, const KT *value, const int32_t *block_tables, const int32_t *tile_seq,        \
    const int32_t *tile_row, const int32_t *tile_pos, const int32_t *tile_rows, QT *out,                      \
    int64_t num_tiles, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,             \
    int64_t max_blocks, float scale, int num_threads) {                                                       \
    const Shape s = {num_heads, kv_heads, head_dim, block_size, scale, 0.0f, block_shift_of(block_size)};     \
    const int64_t D = head_dim;                                                                               \
    if (D % TILE_DIMS || D % VL || VL % (num_heads / kv_heads)) return 2;                                     \
    int64_t longest = 0;                                                                                      \
    for (int64_t i = 0; i < num_tiles; i++)                                                                   \
        if (tile_pos[i] + tile_rows[i] > longest) longest = tile_pos[i] + tile_rows[i];                       \
    int failed = 0;                                                                                           \
    _Pragma("omp parallel num_threads(num_threads)")                                                          \
    {                                                                                                         \
        float *qt = malloc(sizeof(float) * D * VL), *ot = malloc(sizeof(float) * D * VL);                     \
        float *sc = malloc(sizeof(float) * (longest + TILE_KEYS) * VL);                                       \
        float *stage = malloc(sizeof(float) * D * TILE_VALUES);                                               \
        if (!qt || !ot || !sc || !stage) failed = 1;                                                          \
        _Pragma("omp for schedule(dynamic, 1)")                                                               \
        for (int64_t item = 0; item < num_tiles * kv_heads; item++) {                                         \
            if (failed) continue;                                                                             \
            const int64_t i = item / kv_heads, h = item % kv_heads;                                           \
            prefill_tile_##NAME(&s, q, key, value, block_tables + (int64_t)tile_seq[i] * max_blocks,          \
                                tile_row[i], tile_pos[i], tile_rows[i], h, out, qt, sc, ot, stage);           \
        }                                                                                                     \
        free(qt), free(ot), free(sc), free(stage);                                                            \
    }                                                                                                         \
    return failed;                                                                                            \
}

DEFINE_PAGED_ATTENTION(f32, f32, float, f32, float, 0)
DEFINE_PAGED_ATTENTION(bf16, bf16, uint16_t, bf16, uint16_t, 0)
DEFINE_PAGED_ATTENTION(f32_fp8, f32, float, fp8, uint8_t, 1)
DEFINE_PAGED_ATTENTION(f32_i8, f32, float, i8, int8_t, 1)
DEFINE_PAGED_ATTENTION(bf16_fp8, bf16, uint16_t, fp8, uint8_t, 1)
DEFINE_PAGED_ATTENTION(bf16_i8, bf16, uint16_t, i8, int8_t, 1)
DEFINE_PREFILL(f32, f32, float, f32, float)
DEFINE_PREFILL(bf16, bf16, uint16_t, bf16, uint16_t)
#ifndef PAGEDKV_NO_F16
DEFINE_PAGED_ATTENTION(f16, f16, _Float16, f16, _Float16, 0)
DEFINE_PAGED_ATTENTION(f16_fp8, f16, _Float16, fp8, uint8_t, 1)
DEFINE_PAGED_ATTENTION(f16_i8, f16, _Float16, i8, int8_t, 1)
DEFINE_PREFILL(f16, f16, _Float16, f16, _Float16)
#endif
