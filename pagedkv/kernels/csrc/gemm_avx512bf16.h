/*
 * The tiled GEMM's bfloat16 loop on AVX512-BF16's dot products of pairs: tiled_gemm.c includes
 * this file where the target has them (simd.h's GEMM_AVX512_BF16), after its NR, MR, KC and PF.
 *
 * bfloat16, on AVX512-BF16's dot product of pairs (vdpbf16ps, as oneDNN runs bf16 here): the tile
 * holds k in pairs, T[p, j, 0..1] = W[64 t + j, 2p .. 2p + 1], and a weight with odd K gets a zero
 * k row at the end. Sums run in float32 over the pairs in order; the bias is added in float32 and
 * the result rounded to bfloat16 once, to nearest even. A narrow last tile uses masked loads and
 * stores on the same loop.
 */

/* two bfloat16 x values as one 32-bit lane, read as one load the compiler can broadcast */
static inline int pair_at(const uint16_t *x) {
    int both;
    memcpy(&both, x, sizeof both);
    return both;
}

static inline int lone_at(const uint16_t *x) { return x[0]; }

static inline __attribute__((always_inline)) void block_bf16(const uint16_t *x, int64_t K, const uint16_t *tile,
                                                             int64_t width, const uint16_t *bias, uint16_t *y,
                                                             int64_t N, int rows, int fetch, const char *next) {
    __mmask16 mask[4];
    for (int j = 0; j < 4; j++) {
        int64_t lanes = width - 16 * j;
        mask[j] = lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
    }
    /* named accumulators: GCC spills an array of __m512 here, even with constant indices */
#define ZERO(i) __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = a##i##0, a##i##2 = a##i##0, a##i##3 = a##i##0;
    ZERO(0) ZERO(1) ZERO(2) ZERO(3) ZERO(4) ZERO(5)
#undef ZERO
#define ROW(i, p, PAIR_OF)                                                                         \
    if (i < rows) {                                                                                \
        __m512bh xb = (__m512bh)_mm512_set1_epi32(PAIR_OF(x + (i) * K + 2 * (p)));                 \
        a##i##0 = _mm512_dpbf16_ps(a##i##0, xb, w0);                                               \
        a##i##1 = _mm512_dpbf16_ps(a##i##1, xb, w1);                                               \
        a##i##2 = _mm512_dpbf16_ps(a##i##2, xb, w2);                                               \
        a##i##3 = _mm512_dpbf16_ps(a##i##3, xb, w3);                                               \
    }
#define STEP(p, PAIR_OF)                                                                           \
    {                                                                                              \
        const uint16_t *w = tile + (p) * width * 2;                                                \
        if (fetch) {                                                                               \
            const char *ahead = (const char *)(w + PF * width * 2);                                \
            _mm_prefetch(ahead, _MM_HINT_T1);                                                      \
            _mm_prefetch(ahead + 64, _MM_HINT_T1);                                                 \
            _mm_prefetch(ahead + 128, _MM_HINT_T1);                                                \
            _mm_prefetch(ahead + 192, _MM_HINT_T1);                                                \
        }                                                                                          \
        if (next != NULL) { /* see NEXT_TILE */                                                   \
            _mm_prefetch(next + 128 * (p), _MM_HINT_T1);                                           \
            _mm_prefetch(next + 128 * (p) + 64, _MM_HINT_T1);                                      \
        }                                                                                          \
        __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi32(mask[0], w);                              \
        __m512bh w1 = (__m512bh)_mm512_maskz_loadu_epi32(mask[1], w + 32);                         \
        __m512bh w2 = (__m512bh)_mm512_maskz_loadu_epi32(mask[2], w + 64);                         \
        __m512bh w3 = (__m512bh)_mm512_maskz_loadu_epi32(mask[3], w + 96);                         \
        ROW(0, p, PAIR_OF) ROW(1, p, PAIR_OF) ROW(2, p, PAIR_OF)                                   \
        ROW(3, p, PAIR_OF) ROW(4, p, PAIR_OF) ROW(5, p, PAIR_OF)                                   \
    }
#pragma GCC unroll 4
    for (int64_t p = 0; p < K / 2; p++) STEP(p, pair_at)
    if (K % 2) /* the last x has no partner in its row: pair it with zero (its weight row is zero) */
        STEP(K / 2, lone_at)
#undef STEP
#undef ROW
    __m512 b[4];
    for (int j = 0; j < 4; j++) /* bf16 -> f32 is a shift into the high half */
        b[j] = bias == NULL ? _mm512_setzero_ps()
                            : _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask[j], bias + 16 * j)), 16));
#define STORE(i, j)                                                                                \
    _mm256_mask_storeu_epi16(y + (i) * N + 16 * (j), mask[j], (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a##i##j, b[j])));
#define STORE_ROW(i)                                                                               \
    if (i < rows) {                                                                                \
        STORE(i, 0) STORE(i, 1) STORE(i, 2) STORE(i, 3)                                            \
    }
    STORE_ROW(0) STORE_ROW(1) STORE_ROW(2) STORE_ROW(3) STORE_ROW(4) STORE_ROW(5)
#undef STORE_ROW
#undef STORE
}
