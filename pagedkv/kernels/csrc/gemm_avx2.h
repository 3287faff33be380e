/*
 * The tiled GEMM's AVX2 (with FMA) loops: tiled_gemm.c includes this file where the target has
 * them (simd.h's GEMM_AVX2, AVX-512 targets included: their bfloat16 runs here without
 * AVX512-BF16), after its NR, MR, KC and PF.
 */
#include <immintrin.h>

/*
 * AVX2: 16 registers of 8 floats. A block of `rows` rows by `vecs`
 * vectors of 8 columns, from column `col` of the tile, holds rows * vecs accumulators, vecs
 * weight vectors and one broadcast: 1 x 64 columns (the weights then fold into the multiply-adds'
 * memory operands), 2 x 32, or 3-6 x 16. Each k step issues 6-12 independent multiply-adds,
 * enough to cover their latency. The same sums in the same k order as the other paths.
 *
 * Both layouts step through a tile 256 bytes at a time, 4 bytes per column: a float32 k row, or
 * (`pairs`) a bfloat16 pair of k rows. A pair widens to two float32 vectors in two integer ops
 * (the odd k is the upper half of each 32-bit lane, the even one shifted up into it), which
 * multiply float32 x (row stride K, even) odd k first: vdpbf16ps' sums (each product is exact in
 * float32, so each fused multiply-add rounds as its adds do; it flushes denormals, this keeps them).
 */
static inline __attribute__((always_inline)) void block8(const float *x, int64_t K, const char *tile, int64_t col,
                                                         int64_t k0, int64_t k1, float *y, int64_t N, int rows,
                                                         int vecs, int first, int fetch, const char *next,
                                                         int64_t next_lines, int pairs, int stream) {
#define ACC_LOAD(i, j)                                                                             \
    if ((j) < vecs) a##i##j = _mm256_loadu_ps(y + (i) * N + col + 8 * (j));
#define START(i)                                                                                   \
    __m256 a##i##0 = _mm256_setzero_ps(), a##i##1 = a##i##0, a##i##2 = a##i##0, a##i##3 = a##i##0; \
    __m256 a##i##4 = a##i##0, a##i##5 = a##i##0, a##i##6 = a##i##0, a##i##7 = a##i##0;             \
    if (i < rows && !first) {                                                                      \
        ACC_LOAD(i, 0) ACC_LOAD(i, 1) ACC_LOAD(i, 2) ACC_LOAD(i, 3)                                \
        ACC_LOAD(i, 4) ACC_LOAD(i, 5) ACC_LOAD(i, 6) ACC_LOAD(i, 7)                                \
    }
    START(0) START(1) START(2) START(3) START(4) START(5)
#undef START
#undef ACC_LOAD
    const __m256i upper = _mm256_set1_epi32((int)0xFFFF0000u);
    int64_t owed = 0, pulled = 0;
#pragma GCC unroll 4
    for (int64_t k = k0; k < k1; k++) {
        const char *w = tile + k * NR * 4;
        if (fetch) { /* as the AVX-512 path: the first pass pulls the whole tile row ahead */
            const char *ahead = w + PF * NR * 4;
            if (stream) { /* see block_columns */
                _mm_prefetch(ahead, _MM_HINT_NTA);
                _mm_prefetch(ahead + 64, _MM_HINT_NTA);
                _mm_prefetch(ahead + 128, _MM_HINT_NTA);
                _mm_prefetch(ahead + 192, _MM_HINT_NTA);
            } else {
                _mm_prefetch(ahead, _MM_HINT_T1);
                _mm_prefetch(ahead + 64, _MM_HINT_T1);
                _mm_prefetch(ahead + 128, _MM_HINT_T1);
                _mm_prefetch(ahead + 192, _MM_HINT_T1);
            }
        }
        if (next != NULL) /* next_lines cache lines from `next` on, spread evenly over the k steps */
            for (owed += next_lines; owed >= k1 - k0; owed -= k1 - k0) _mm_prefetch(next + 64 * pulled++, _MM_HINT_T1);
        w += col * 4;
#define FMA(i, j, wv)                                                                              \
    if ((j) < vecs) a##i##j = _mm256_fmadd_ps(xi, wv##j, a##i##j);
#define ROW(i, wv, at)                                                                             \
    if (i < rows) {                                                                                \
        __m256 xi = _mm256_broadcast_ss(x + (i) * K + (at));                                       \
        FMA(i, 0, wv) FMA(i, 1, wv) FMA(i, 2, wv) FMA(i, 3, wv)                                    \
        FMA(i, 4, wv) FMA(i, 5, wv) FMA(i, 6, wv) FMA(i, 7, wv)                                    \
    }
#define ROWS(wv, at) ROW(0, wv, at) ROW(1, wv, at) ROW(2, wv, at) ROW(3, wv, at) ROW(4, wv, at) ROW(5, wv, at)
        if (!pairs) {
#define W(j) __m256 w##j = (j) < vecs ? _mm256_loadu_ps((const float *)w + 8 * (j)) : _mm256_setzero_ps();
            W(0) W(1) W(2) W(3) W(4) W(5) W(6) W(7)
#undef W
            ROWS(w, k)
        } else {
#define RAW(j) ((j) < vecs ? _mm256_loadu_si256((const __m256i *)(w + 32 * (j))) : _mm256_setzero_si256())
#define ODD(j) __m256 o##j = _mm256_castsi256_ps(_mm256_and_si256(RAW(j), upper));
#define EVEN(j) __m256 e##j = _mm256_castsi256_ps(_mm256_slli_epi32(RAW(j), 16));
            ODD(0) ODD(1) ODD(2) ODD(3) ODD(4) ODD(5) ODD(6) ODD(7)
            ROWS(o, 2 * k + 1)
            EVEN(0) EVEN(1) EVEN(2) EVEN(3) EVEN(4) EVEN(5) EVEN(6) EVEN(7)
            ROWS(e, 2 * k)
#undef EVEN
#undef ODD
#undef RAW
        }
#undef ROWS
#undef ROW
#undef FMA
    }
#define ACC_STORE(i, j)                                                                            \
    if ((j) < vecs) _mm256_storeu_ps(y + (i) * N + col + 8 * (j), a##i##j);
#define STORE(i)                                                                                   \
    if (i < rows) {                                                                                \
        ACC_STORE(i, 0) ACC_STORE(i, 1) ACC_STORE(i, 2) ACC_STORE(i, 3)                            \
        ACC_STORE(i, 4) ACC_STORE(i, 5) ACC_STORE(i, 6) ACC_STORE(i, 7)                            \
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
#undef ACC_STORE
}

/* column passes for `rows` rows: 1 x 64, 2 x 32, else 16 columns */
#define PASSES(rows) ((rows) == 1 ? 1 : (rows) == 2 ? 2 : 4)

/* all 64 columns of `rows` rows (a constant after inlining), row block `index` of M rows, k steps
 * k0..k1, in PASSES(rows) column passes. The first pass of row block 0 streams the tile from DRAM;
 * all the others, over all row blocks, compute from L2 and share out the pull into L2 of `steps`
 * k steps (at most KC) of the next tile from next_tile on, each its slice, spread over its k
 * steps: pulled by the first pass alone, DRAM would idle while the others run.
 * One row in all (one request's decode) reads each tile once: it streams past the caches
 * (prefetchnta) and pulls no next tile, which leaves L2 and L3 to the activations, the KV cache
 * and the rest of the step. */
static inline __attribute__((always_inline)) void block_columns(const float *x, int64_t K, const char *tile,
                                                                int64_t steps, int64_t k0, int64_t k1, float *y,
                                                                int64_t N, int rows, int64_t index, int64_t M,
                                                                const char *next_tile, int pairs) {
    const int vecs = 8 / PASSES(rows), first = k0 == 0;
    const int64_t last_rows = M - (M - 1) / MR * MR, blocks = (M - 1) / MR + 1;
    const int64_t sharers = (blocks - 1) * PASSES(MR) + PASSES(last_rows) - 1;
    const int64_t lines = (int64_t)NR * 4 / 64 * (steps < KC ? steps : KC);
    for (int pass = 0; pass < PASSES(rows); pass++) {
        const int64_t g = index * PASSES(MR) + pass; /* earlier row blocks are all full */
        const char *pull = NULL;
        int64_t count = 0;
        if (next_tile != NULL && sharers == 0) /* one pass in all: it pulls the whole next chunk */
            pull = next_tile, count = lines;
        else if (next_tile != NULL && g > 0)
            pull = next_tile + 64 * ((g - 1) * lines / sharers), count = g * lines / sharers - (g - 1) * lines / sharers;
        block8(x, K, tile, pass * 8 * vecs, k0, k1, y, N, rows, vecs, first, index == 0 && pass == 0,
               M == 1 ? NULL : pull, count, pairs, M == 1);
    }
}

/* block_columns with a row count the compiler sees as a constant */
static inline __attribute__((always_inline)) void block_columns_of(const float *x, int64_t K, const char *tile,
                                                                   int64_t steps, int64_t k0, int64_t k1, float *y,
                                                                   int64_t N, int rows, int64_t index, int64_t M,
                                                                   const char *next_tile, int pairs) {
    switch (rows) {
    case 6: block_columns(x, K, tile, steps, k0, k1, y, N, 6, index, M, next_tile, pairs); break;
    case 5: block_columns(x, K, tile, steps, k0, k1, y, N, 5, index, M, next_tile, pairs); break;
    case 4: block_columns(x, K, tile, steps, k0, k1, y, N, 4, index, M, next_tile, pairs); break;
    case 3: block_columns(x, K, tile, steps, k0, k1, y, N, 3, index, M, next_tile, pairs); break;
    case 2: block_columns(x, K, tile, steps, k0, k1, y, N, 2, index, M, next_tile, pairs); break;
    default: block_columns(x, K, tile, steps, k0, k1, y, N, 1, index, M, next_tile, pairs); break;
    }
}

#if !GEMM_AVX512_BF16 /* bfloat16 without AVX512-BF16 */
/* a full tile's `steps` pairs widened once into a float32 tile of 2 steps k rows, each pair's odd
 * k first (x is then read with its pairs swapped) */
static void widen_tile(const uint16_t *tile, int64_t steps, float *out) {
    const __m256i upper = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t p = 0; p < steps; p++)
        for (int j = 0; j < NR / 8; j++) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(tile + p * 2 * NR + 16 * j));
            _mm256_storeu_si256((__m256i *)(out + 2 * p * NR + 8 * j), _mm256_and_si256(raw, upper));
            _mm256_storeu_si256((__m256i *)(out + (2 * p + 1) * NR + 8 * j), _mm256_slli_epi32(raw, 16));
        }
}
#endif

/* round_rows' whole groups of 16 columns of one row (acc: its float32 sums, y: its bfloat16
 * outputs, bias: its bias or NULL); returns the first column left to the scalar loop */
static inline int64_t round_row_avx2(const float *acc, const uint16_t *bias, uint16_t *y, int64_t width) {
    int64_t j = 0;
    for (; j + 16 <= width; j += 16) {
        __m256i half[2];
        for (int h = 0; h < 2; h++) {
            __m256 sum = _mm256_loadu_ps(acc + j + 8 * h);
            const __m256i b = bias == NULL ? _mm256_setzero_si256()
                                           : _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(
                                                                   (const __m128i *)(bias + j + 8 * h))),
                                                               16);
            sum = _mm256_add_ps(sum, _mm256_castsi256_ps(b));
            const __m256i u = _mm256_castps_si256(sum);
            const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
            __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
            const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(sum, sum, _CMP_UNORD_Q));
            half[h] = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
        }
        /* packus interleaves 128-bit lanes: put the four 64-bit quarters back in order */
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(half[0], half[1]), 0xD8);
        _mm256_storeu_si256((__m256i *)(y + j), packed);
    }
    return j;
}

/* widened_rows' whole groups of 8 k of one row x: widened into wide and, each pair's two k
 * swapped, into swapped; returns the first k left to the scalar loop */
static inline int64_t widen_row_avx2(const uint16_t *x, float *wide, float *swapped, int64_t K) {
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + k))), 16));
        _mm256_storeu_ps(wide + k, v);
        _mm256_storeu_ps(swapped + k, _mm256_permute_ps(v, 0xB1)); /* k ^ 1 */
    }
    return k;
}
