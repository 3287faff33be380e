/*
 * The bfloat16 row kernel's pass 1 on AVX512-BF16: paged_attention_body.h includes this file in
 * its bfloat16 instantiation (queries and pools both bfloat16, KT = uint16_t) where the target
 * has the instructions (PAIRS defined), after SUFFIX(slot); attend_piece calls pair_scores for
 * head dimensions that are whole multiples of PAIR_DIMS.
 *
 * vdpbf16ps multiplies 32 bfloat16 pairs and adds each pair's two products into one float32
 * lane: the keys are read as they lie, with no conversion, and a key row of 64 elements is two
 * instructions per query head. A query is exactly a bfloat16 (the row kernel widened it), so
 * every product is exact, as with float32 multiply-adds; the sums run in another order (a pair
 * first, then across lanes), and the instruction flushes subnormal inputs and results to zero.
 * Scores therefore agree with the float32 loop's to rounding, and the same inputs always give
 * the same bits: every bfloat16 row (decode, recomputation, either side of any comparison) that
 * takes the row kernel takes this pass.
 *
 * The 16 lane sums of one head's 16 accumulators (one per position) are reduced together by a
 * folding tree (fold): each fold halves two vectors into one with one shuffle, one blend and one
 * add, and after four levels lane u holds position u's dot product, stored as one vector. The
 * float32 loop's hsum4 spends about twice the instructions per score.
 */

#define PAIR_DIMS 32   /* bfloat16 elements of one 512-bit row chunk */
#define PAIR_TOKENS 16 /* positions scored together: one per lane of the reduced vector */
#define PAIR_AHEAD 32  /* positions ahead whose keys pass 1 prefetches */
_Static_assert(VL == 16 && PAIR_TOKENS == VL, "the folding tree reduces 16 accumulators of 16 lanes");

/* x and y folded at lane distance k (8, 4, 2, 1): lane i holds x[i] + x[i ^ k] where bit k of i
 * is clear, y[i] + y[i ^ k] where it is set */
static inline __attribute__((always_inline)) __m512 fold(__m512 x, __m512 y, int k) {
    vi lane;
    __mmask16 from_y = 0;
    for (int i = 0; i < VL; i++) {
        lane[i] = (i ^ k) | (i & k ? VL : 0);
        from_y |= (__mmask16)((i & k ? 1u : 0u) << i);
    }
    return _mm512_add_ps(_mm512_mask_blend_ps(from_y, x, y), _mm512_permutex2var_ps(x, (__m512i)lane, y));
}

/* one key row k (D elements, D / PAIR_DIMS chunks) dotted with the query pairs qp, per lane */
static inline __attribute__((always_inline)) __m512 pair_dot(const uint16_t *k, const __m512bh *qp, int64_t D) {
    __m512 acc = _mm512_dpbf16_ps(_mm512_setzero_ps(), qp[0], (__m512bh)_mm512_loadu_si512(k));
    for (int64_t c = 1; c < D / PAIR_DIMS; c++)
        acc = _mm512_dpbf16_ps(acc, qp[c], (__m512bh)_mm512_loadu_si512(k + c * PAIR_DIMS));
    return acc;
}

/* the dot products of the query pairs qp with the key rows k[u] + off, lane u for position u */
static inline __attribute__((always_inline)) __m512 pair_dots(const uint16_t *const k[PAIR_TOKENS], int64_t off,
                                                              const __m512bh *qp, int64_t D) {
#define PAIR_DOT(u) pair_dot(k[u] + off, qp, D)
    const __m512 a0 = fold(PAIR_DOT(0), PAIR_DOT(8), 8), a1 = fold(PAIR_DOT(1), PAIR_DOT(9), 8);
    const __m512 a2 = fold(PAIR_DOT(2), PAIR_DOT(10), 8), a3 = fold(PAIR_DOT(3), PAIR_DOT(11), 8);
    const __m512 a4 = fold(PAIR_DOT(4), PAIR_DOT(12), 8), a5 = fold(PAIR_DOT(5), PAIR_DOT(13), 8);
    const __m512 a6 = fold(PAIR_DOT(6), PAIR_DOT(14), 8), a7 = fold(PAIR_DOT(7), PAIR_DOT(15), 8);
#undef PAIR_DOT
    const __m512 b0 = fold(a0, a4, 4), b1 = fold(a1, a5, 4), b2 = fold(a2, a6, 4), b3 = fold(a3, a7, 4);
    return fold(fold(b0, b2, 2), fold(b1, b3, 2), 1);
}

/* Pass 1 for a head dimension D (a constant where it can be): scores[j * ld + i] for position
 * t0 + i < n and every query head j, PAIR_TOKENS positions at a time (positions past n repeat
 * the last one; their scores land in the row's padding, which the softmax resets). The keys
 * PAIR_AHEAD positions ahead are prefetched, each query head's turn pulling its share. */
static inline __attribute__((always_inline)) void SUFFIX(pair_scores_d)(const Shape *s, const float *qf,
                                                                        const uint16_t *key, const int32_t *table,
                                                                        int64_t t0, int64_t n, float *scores,
                                                                        int64_t ld, int64_t D) {
    const int64_t H = s->num_heads, HD = s->kv_heads * D, group = H / s->kv_heads;
    for (int64_t i0 = 0; i0 < n; i0 += PAIR_TOKENS) {
        const uint16_t *k[PAIR_TOKENS];
        for (int u = 0; u < PAIR_TOKENS; u++)
            k[u] = key + SUFFIX(slot)(s, table, t0 + (i0 + u < n ? i0 + u : n - 1)) * HD;
        const int64_t ahead = n - i0 - PAIR_AHEAD < PAIR_TOKENS ? n - i0 - PAIR_AHEAD : PAIR_TOKENS;
        for (int64_t j = 0; j < H; j++) {
            for (int64_t u = j * ahead / H; u < (j + 1) * ahead / H; u++) {
                const char *next = (const char *)(key + SUFFIX(slot)(s, table, t0 + i0 + PAIR_AHEAD + u) * HD);
                for (int64_t b = 0; b < HD * (int64_t)sizeof(uint16_t); b += 64) PREFETCH_L2(next + b);
            }
            __m512bh qp[D / PAIR_DIMS];
            for (int64_t c = 0; c < D / PAIR_DIMS; c++) {
                const float *qc = qf + j * D + c * PAIR_DIMS; /* bfloat16 values: converted exactly */
                qp[c] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qc + VL), _mm512_loadu_ps(qc));
            }
            _mm512_storeu_ps(scores + j * ld + i0, pair_dots(k, j / group * D, qp, D));
        }
    }
}

/* pass 1 when D % PAIR_DIMS == 0: the common head dimensions compiled with a constant D */
static void SUFFIX(pair_scores)(const Shape *s, const float *qf, const uint16_t *key, const int32_t *table,
                                int64_t t0, int64_t n, float *scores, int64_t ld) {
    if (s->head_dim == 64)
        SUFFIX(pair_scores_d)(s, qf, key, table, t0, n, scores, ld, 64);
    else if (s->head_dim == 128)
        SUFFIX(pair_scores_d)(s, qf, key, table, t0, n, scores, ld, 128);
    else
        SUFFIX(pair_scores_d)(s, qf, key, table, t0, n, scores, ld, s->head_dim);
}
