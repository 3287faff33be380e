/*
 * y = x . W^T + b on the CPU, W stored in column tiles: the linear layers' kernel, in float32
 * and bfloat16. Entry points and arguments: kernels.h.
 *
 * Why not oneDNN: in a decode step every weight is read from DRAM once for a handful of rows,
 * and a GEMM that packs its operands as it goes stalls on that stream. Here each tile of 64
 * output columns is one contiguous run of memory that the k loop reads front to back
 * (prefetched PF rows ahead, into L2), the first block of rows pulls it from DRAM and the others
 * reuse it from L2 while they pull the next tile there (NEXT_TILE). The same loop runs prefill's
 * thousands of rows. float32 has three loops, chosen at compile time: AVX-512, AVX2 with FMA
 * (column passes over a tile, see block_columns) and a portable one.
 *
 * Layout ("tiled"): W [N, K] becomes one flat run of N * K floats, tile after tile; full tile t
 * holds T[k, j] = W[64 t + j, k] (64 floats per k), and a last tile of r < 64 columns the same
 * with r floats per k. Nothing is padded, so the weight takes exactly its plain size.
 *
 * Sums run over k in order, one fused multiply-add per term, whatever the row count, the thread
 * count or the chunking: a row's result never depends on its batch. bfloat16 sums k in pairs,
 * each pair's odd product first (vdpbf16ps' order), on every path.
 *
 * The MLP's gate/up projection ([2 I, K]: I gate rows, then I up rows) has a second layout,
 * "paired": for each run t of 64 output columns of width w = min(64, I - 64 t), the [2 w, K]
 * matrix of gate rows 64 t .. + w then up rows 64 t .. + w in the tiled layout above, pair after
 * pair. One pass then makes a block of gate columns and the up columns they multiply together,
 * and silu(gate) * up (layer_ops.c's silu_and_mul_rows, bit for bit the unfused op) is applied
 * while they are in cache, instead of a separate pass over the whole [M, 2 I] product.
 *
 * A tied LM head's tiles also serve the embedding: tiled_rows copies rows W[ids] out of them.
 */
#include <stdlib.h>

#include "kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#define NR 64    /* output columns per tile */
#define MR 6     /* rows per register block: 6 x 4 accumulators + 4 weight vectors + 1 broadcast */
#define KC 1024  /* k per pass: a 1024 x 64 float32 tile chunk (256 KiB) stays in L2 */
#define PF 32    /* k rows to prefetch ahead (8 KiB), into L2 (prefetcht1): a decode step's weights
                  * stream cold, and lines pulled into L1 that early are evicted before use */
/* NEXT_TILE: while the later row blocks of a tile compute from L2, row blocks 1 and 2 each pull
 * half of the next tile into L2, two cache lines per k step (the first row block of every tile
 * otherwise waits on DRAM). The part a row block fetches, or NULL: */
#define NEXT_TILE(next, block_index, steps)                                                        \
    ((next) == NULL || (block_index) < 1 || (block_index) > 2 ? NULL                               \
                                                              : (next) + ((block_index) - 1) * 128 * (steps))

/* rows of x times a tile of `width` columns (k rows `width` floats apart), into y (row stride N);
 * continues the sums already in y unless k0 == 0 */
static void narrow_rows(const float *x, int64_t K, const float *tile, int64_t width, int64_t k0, int64_t k1,
                        float *y, int64_t N, int rows) {
    for (int i = 0; i < rows; i++) {
        float acc[NR];
        for (int64_t j = 0; j < width; j++) acc[j] = k0 == 0 ? 0.0f : y[i * N + j];
        for (int64_t k = k0; k < k1; k++) {
            float xi = x[i * K + k];
            const float *w = tile + k * width;
            for (int64_t j = 0; j < width; j++) acc[j] = __builtin_fmaf(xi, w[j], acc[j]);
        }
        memcpy(y + i * N, acc, width * sizeof(float));
    }
}

#ifndef __AVX512BF16__
/* narrow_rows for a bfloat16 tile in pairs (see "bfloat16" below): x in float32 (row stride K,
 * even), pair steps p0..p1, each pair's odd k first, as AVX512-BF16's vdpbf16ps adds them */
static void narrow_pairs(const float *x, int64_t K, const uint16_t *tile, int64_t width, int64_t p0, int64_t p1,
                         float *y, int64_t N, int rows) {
    for (int i = 0; i < rows; i++) {
        float acc[NR];
        for (int64_t j = 0; j < width; j++) acc[j] = p0 == 0 ? 0.0f : y[i * N + j];
        for (int64_t p = p0; p < p1; p++) {
            const float odd = x[i * K + 2 * p + 1], even = x[i * K + 2 * p];
            const uint16_t *w = tile + p * width * 2;
            for (int64_t j = 0; j < width; j++) {
                acc[j] = __builtin_fmaf(odd, bf16_to_f32(w[2 * j + 1]), acc[j]);
                acc[j] = __builtin_fmaf(even, bf16_to_f32(w[2 * j]), acc[j]);
            }
        }
        memcpy(y + i * N, acc, width * sizeof(float));
    }
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
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
#define BLOCK_COLUMNS(x, K, tile, steps, k0, k1, y, N, rows, index, M, next_tile, pairs)            \
    switch (rows) {                                                                                \
    case 6: block_columns(x, K, tile, steps, k0, k1, y, N, 6, index, M, next_tile, pairs); break;  \
    case 5: block_columns(x, K, tile, steps, k0, k1, y, N, 5, index, M, next_tile, pairs); break;  \
    case 4: block_columns(x, K, tile, steps, k0, k1, y, N, 4, index, M, next_tile, pairs); break;  \
    case 3: block_columns(x, K, tile, steps, k0, k1, y, N, 3, index, M, next_tile, pairs); break;  \
    case 2: block_columns(x, K, tile, steps, k0, k1, y, N, 2, index, M, next_tile, pairs); break;  \
    default: block_columns(x, K, tile, steps, k0, k1, y, N, 1, index, M, next_tile, pairs); break; \
    }
#endif

#ifdef __AVX512F__

/* acc[i] (4 vectors) += x[i, k0:k1] . tile[k0:k1]; loads acc from y unless first */
static inline __attribute__((always_inline)) void block(const float *x, int64_t K, const float *tile, int64_t k0,
                                                        int64_t k1, float *y, int64_t N, int rows, int first,
                                                        int fetch, const char *next) {
    /* named accumulators: GCC may spill an array of __m512, even with constant indices */
#define START(i)                                                                                   \
    __m512 a##i##0 = _mm512_setzero_ps(), a##i##1 = a##i##0, a##i##2 = a##i##0, a##i##3 = a##i##0; \
    if (i < rows && !first) {                                                                      \
        a##i##0 = _mm512_loadu_ps(y + (i) * N);                                                    \
        a##i##1 = _mm512_loadu_ps(y + (i) * N + 16);                                               \
        a##i##2 = _mm512_loadu_ps(y + (i) * N + 32);                                               \
        a##i##3 = _mm512_loadu_ps(y + (i) * N + 48);                                               \
    }
    START(0) START(1) START(2) START(3) START(4) START(5)
#undef START
#pragma GCC unroll 4
    for (int64_t k = k0; k < k1; k++) {
        const float *w = tile + k * NR;
        if (fetch) { /* the first row block pulls the tile from DRAM; the others find it in L2 */
            const char *ahead = (const char *)(w + PF * NR);
            _mm_prefetch(ahead, _MM_HINT_T1);
            _mm_prefetch(ahead + 64, _MM_HINT_T1);
            _mm_prefetch(ahead + 128, _MM_HINT_T1);
            _mm_prefetch(ahead + 192, _MM_HINT_T1);
        }
        if (next != NULL) { /* see NEXT_TILE */
            _mm_prefetch(next + 128 * (k - k0), _MM_HINT_T1);
            _mm_prefetch(next + 128 * (k - k0) + 64, _MM_HINT_T1);
        }
        __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
        __m512 w2 = _mm512_loadu_ps(w + 32), w3 = _mm512_loadu_ps(w + 48);
#define ROW(i)                                                                                     \
    if (i < rows) {                                                                                \
        __m512 xi = _mm512_set1_ps(x[(i) * K + k]);                                                \
        a##i##0 = _mm512_fmadd_ps(xi, w0, a##i##0);                                                \
        a##i##1 = _mm512_fmadd_ps(xi, w1, a##i##1);                                                \
        a##i##2 = _mm512_fmadd_ps(xi, w2, a##i##2);                                                \
        a##i##3 = _mm512_fmadd_ps(xi, w3, a##i##3);                                                \
    }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
    }
#define STORE(i)                                                                                   \
    if (i < rows) {                                                                                \
        _mm512_storeu_ps(y + (i) * N, a##i##0);                                                    \
        _mm512_storeu_ps(y + (i) * N + 16, a##i##1);                                               \
        _mm512_storeu_ps(y + (i) * N + 32, a##i##2);                                               \
        _mm512_storeu_ps(y + (i) * N + 48, a##i##3);                                               \
    }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

/* a constant row count per call lets the compiler keep every accumulator in a register; row
 * block `index` of the tile's (M rows), with the next tile or NULL (see NEXT_TILE) */
static void block_rows(const float *x, int64_t K, const float *tile, int64_t k0, int64_t k1, float *y,
                       int64_t N, int rows, int64_t index, int64_t M, const char *next_tile) {
    (void)M;
    const int first = k0 == 0, fetch = index == 0;
    const char *next = NEXT_TILE(k0 == 0 ? next_tile : NULL, index, K);
    switch (rows) {
    case 6: block(x, K, tile, k0, k1, y, N, 6, first, fetch, next); break;
    case 5: block(x, K, tile, k0, k1, y, N, 5, first, fetch, next); break;
    case 4: block(x, K, tile, k0, k1, y, N, 4, first, fetch, next); break;
    case 3: block(x, K, tile, k0, k1, y, N, 3, first, fetch, next); break;
    case 2: block(x, K, tile, k0, k1, y, N, 2, first, fetch, next); break;
    default: block(x, K, tile, k0, k1, y, N, 1, first, fetch, next); break;
    }
}

#elif defined(__AVX2__) && defined(__FMA__)

/* the same k steps of the next tile are pulled as this call's, so a tile deeper than KC (a down
 * projection's 1,376 k) has all of it in L2 in time, not only its first chunk */
static void block_rows(const float *x, int64_t K, const float *tile, int64_t k0, int64_t k1, float *y,
                       int64_t N, int rows, int64_t index, int64_t M, const char *next_tile) {
    const char *next = next_tile == NULL ? NULL : next_tile + k0 * NR * sizeof(float);
    BLOCK_COLUMNS(x, K, (const char *)tile, k1 - k0, k0, k1, y, N, rows, index, M, next, 0)
}

#else /* portable: the same operations in the same order, left to the compiler's vectoriser */

static void block_rows(const float *x, int64_t K, const float *tile, int64_t k0, int64_t k1, float *y,
                       int64_t N, int rows, int64_t index, int64_t M, const char *next_tile) {
    (void)index, (void)M, (void)next_tile;
    narrow_rows(x, K, tile, NR, k0, k1, y, N, rows);
}

#endif

/* columns [col, col + width) for all M rows from their tile: a full tile (width NR) in
 * registers, the last partial one with the portable loop */
static void tile_product(const float *x, const float *tile, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int64_t col, const char *next_tile) {
    int64_t width = N - col < NR ? N - col : NR;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t k1 = k0 + KC < K ? k0 + KC : K;
        for (int64_t m = 0; m < M; m += MR) {
            int rows = M - m < MR ? (int)(M - m) : MR;
            if (width == NR)
                block_rows(x + m * K, K, tile, k0, k1, y + m * N + col, N, rows, m / MR, M, next_tile);
            else
                narrow_rows(x + m * K, K, tile, width, k0, k1, y + m * N + col, N, rows);
        }
    }
    if (bias != NULL) /* added after the sum, as a GEMM with beta = 1 adds it */
        for (int64_t m = 0; m < M; m++)
            for (int64_t j = 0; j < width; j++) y[m * N + col + j] += bias[col + j];
}

int tiled_linear_f32(const float *x, const float *tiles, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N) {
    int64_t count = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < count; t++)
        tile_product(x, tiles + t * K * NR, bias, y, M, K, N, t * NR,
                     (t + 2) * NR <= N ? (const char *)(tiles + (t + 1) * K * NR) : NULL);
    return 0; /* float32 needs no workspace */
}

/* one pair's [M, 2 w] product (gate | up), row stride 2 w, into tmp: then (fused) silu(gate) * up
 * into y's columns 64 t .. + w (row stride I), else gate and up to their own columns */
#define FINISH_PAIR(T, S, fused, tmp, y, M, w, I, t)                                              \
    do {                                                                                           \
        if (fused) {                                                                               \
            silu_and_mul_rows_##S(tmp, y + (t) * NR, M, w, I);                                     \
        } else {                                                                                   \
            for (int64_t m = 0; m < (M); m++) {                                                    \
                memcpy(y + m * 2 * (I) + (t) * NR, tmp + m * 2 * (w), sizeof(T) * (w));           \
                memcpy(y + m * 2 * (I) + (I) + (t) * NR, tmp + m * 2 * (w) + (w), sizeof(T) * (w)); \
            }                                                                                      \
        }                                                                                          \
    } while (0)

/* the next full tile after column c of pair t (n = 2 w columns; pairs of `stride` elements), for
 * NEXT_TILE, or NULL */
static inline const char *next_full_tile(const char *pair, const char *next_pair, int64_t c, int64_t n,
                                         int64_t next_width, int64_t tile_bytes) {
    if (c + 2 * NR <= n) return pair + (c / NR + 1) * tile_bytes;
    if (c + NR >= n && next_pair != NULL && 2 * next_width >= NR) return next_pair;
    return NULL;
}

/* A pair runs a batch of more than PAIR_ROWS rows PAIR_ROWS at a time, both tiles and then the
 * epilogue: the [rows, 2 w] workspace stays in L2 with the pair's tiles (a prefill chunk's
 * 2,048 rows made it 1 MiB, written out and read back from L3 between the product and the
 * epilogue). The next tile is pulled as before, the up tile's in the first run of rows and the
 * next pair's in the last. */
#define PAIR_ROWS 48

int tiled_gate_up_f32(const float *x, const float *tiles, float *y, int64_t M, int64_t K, int64_t I,
                      int fused) {
    const int64_t pairs = (I + NR - 1) / NR, run = M < PAIR_ROWS ? M : PAIR_ROWS;
    const int64_t y_stride = fused ? I : 2 * I;
    int failed = 0;
#pragma omp parallel
    {
        float *tmp = malloc(sizeof(float) * run * 2 * NR);
        if (tmp == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; t++) {
            if (tmp == NULL) continue;
            const int64_t w = I - t * NR < NR ? I - t * NR : NR, n = 2 * w;
            const float *pair = tiles + t * 2 * NR * K;
            const int64_t next_w = I - (t + 1) * NR < NR ? I - (t + 1) * NR : NR;
            const char *next_pair = t + 1 < pairs ? (const char *)(pair + 2 * NR * K) : NULL;
            for (int64_t m0 = 0; m0 < M; m0 += run) {
                const int64_t rows = M - m0 < run ? M - m0 : run;
                for (int64_t c = 0; c < n; c += NR) {
                    const int pulls = c == 0 ? m0 == 0 : m0 + rows == M;
                    tile_product(x + m0 * K, pair + c * K, NULL, tmp, rows, K, n, c,
                                 pulls ? next_full_tile((const char *)pair, next_pair, c, n, next_w,
                                                        NR * K * sizeof(float))
                                       : NULL);
                }
                FINISH_PAIR(float, f32, fused, tmp, y + m0 * y_stride, rows, w, I, t);
            }
        }
        free(tmp);
    }
    return failed;
}

#ifdef __AVX512BF16__
/*
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
        if (next != NULL) { /* see NEXT_TILE */                                                    \
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

static void block_rows_bf16(const uint16_t *x, int64_t K, const uint16_t *tile, int64_t width,
                            const uint16_t *bias, uint16_t *y, int64_t N, int rows, int fetch,
                            const char *next) {
    switch (rows) {
    case 6: block_bf16(x, K, tile, width, bias, y, N, 6, fetch, next); break;
    case 5: block_bf16(x, K, tile, width, bias, y, N, 5, fetch, next); break;
    case 4: block_bf16(x, K, tile, width, bias, y, N, 4, fetch, next); break;
    case 3: block_bf16(x, K, tile, width, bias, y, N, 3, fetch, next); break;
    case 2: block_bf16(x, K, tile, width, bias, y, N, 2, fetch, next); break;
    default: block_bf16(x, K, tile, width, bias, y, N, 1, fetch, next); break;
    }
}

int tiled_linear_bf16(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t K, int64_t N) {
    int64_t count = (N + NR - 1) / NR, padded = K + K % 2;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < count; t++) {
        int64_t col = t * NR, width = N - col < NR ? N - col : NR;
        const char *next = (t + 2) * NR <= N ? (const char *)(tiles + (col + NR) * padded) : NULL;
        for (int64_t m = 0; m < M; m += MR) {
            int rows = M - m < MR ? (int)(M - m) : MR;
            block_rows_bf16(x + m * K, K, tiles + col * padded, width, bias == NULL ? NULL : bias + col,
                            y + m * N + col, N, rows, m == 0,
                            NEXT_TILE(next, m / MR, padded / 2));
        }
    }
    return 0;
}

int tiled_gate_up_bf16(const uint16_t *x, const uint16_t *tiles, uint16_t *y, int64_t M, int64_t K, int64_t I,
                       int fused) {
    const int64_t pairs = (I + NR - 1) / NR, padded = K + K % 2;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *tmp = malloc(sizeof(uint16_t) * M * 2 * NR);
        if (tmp == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; t++) {
            if (tmp == NULL) continue;
            const int64_t w = I - t * NR < NR ? I - t * NR : NR, n = 2 * w;
            const uint16_t *pair = tiles + t * 2 * NR * padded;
            const int64_t next_w = I - (t + 1) * NR < NR ? I - (t + 1) * NR : NR;
            const char *next_pair = t + 1 < pairs ? (const char *)(pair + 2 * NR * padded) : NULL;
            for (int64_t c = 0; c < n; c += NR) {
                const int64_t width = n - c < NR ? n - c : NR;
                const char *next = next_full_tile((const char *)pair, next_pair, c, n, next_w,
                                                  NR * padded * sizeof(uint16_t));
                for (int64_t m = 0; m < M; m += MR) {
                    int rows = M - m < MR ? (int)(M - m) : MR;
                    block_rows_bf16(x + m * K, K, pair + c * padded, width, NULL, tmp + m * n + c, n, rows, m == 0,
                                    NEXT_TILE(next, m / MR, padded / 2));
                }
            }
            FINISH_PAIR(uint16_t, bf16, fused, tmp, y, M, w, I, t);
        }
        free(tmp);
    }
    return failed;
}
#else
/*
 * bfloat16 without AVX512-BF16: the same tiles (k in pairs, see above) and the same sums. x is
 * widened to float32 once per call (rows padded to an even length with a zero, the partner of an
 * odd K's last k), each pair of weight rows is widened as it is loaded, and the products are
 * summed odd k first in float32 -- a product of two bfloat16 values is exact in float32, so each
 * fused multiply-add rounds as vdpbf16ps does. A tile's sums go to a float32 workspace, then
 * the bias is added and the result rounded to bfloat16 once, to nearest even. On AVX2 the loop
 * is block_columns' with widening loads; elsewhere the portable narrow_pairs.
 */
static void block_rows_pairs(const float *x, int64_t K, const uint16_t *tile, int64_t steps, int64_t p0, int64_t p1,
                             float *y, int64_t N, int rows, int64_t index, int64_t M, const char *next_tile) {
#if defined(__AVX2__) && defined(__FMA__)
    BLOCK_COLUMNS(x, K, (const char *)tile, steps, p0, p1, y, N, rows, index, M, next_tile, 1)
#else
    (void)steps, (void)index, (void)M, (void)next_tile;
    narrow_pairs(x, K, tile, NR, p0, p1, y, N, rows);
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
#define WIDEN_ROWS 24
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

/* the float32 sums of all M rows of x (row stride K, even) by a tile of `width` columns, into
 * acc [M, NR] */
static void pair_tile_sums(const float *x, const float *swapped, int64_t K, const uint16_t *tile, int64_t width,
                           float *acc, float *wide_tile, int64_t M, const char *next_tile) {
    const int64_t steps = K / 2;
#if defined(__AVX2__) && defined(__FMA__)
    if (M >= WIDEN_ROWS && width == NR) {
        widen_tile(tile, steps, wide_tile);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t k1 = k0 + KC < K ? k0 + KC : K;
            for (int64_t m = 0; m < M; m += MR) {
                const int rows = M - m < MR ? (int)(M - m) : MR;
                BLOCK_COLUMNS(swapped + m * K, K, (const char *)wide_tile, steps, k0, k1, acc + m * NR, NR, rows,
                              m / MR, M, k0 == 0 ? next_tile : NULL, 0)
            }
        }
        return;
    }
#else
    (void)swapped, (void)wide_tile;
#endif
    for (int64_t p0 = 0; p0 < steps; p0 += KC) {
        const int64_t p1 = p0 + KC < steps ? p0 + KC : steps;
        for (int64_t m = 0; m < M; m += MR) {
            const int rows = M - m < MR ? (int)(M - m) : MR;
            if (width == NR)
                block_rows_pairs(x + m * K, K, tile, steps, p0, p1, acc + m * NR, NR, rows, m / MR, M,
                                 p0 == 0 ? next_tile : NULL);
            else
                narrow_pairs(x + m * K, K, tile, width, p0, p1, acc + m * NR, NR, rows);
        }
    }
}

/* acc [M, NR]'s first `width` columns plus bias (bfloat16, or NULL), rounded to nearest even
 * (NaN to 0x7FC0, as torch rounds), into y (row stride N) */
static void round_rows(const float *acc, const uint16_t *bias, uint16_t *y, int64_t N, int64_t M, int64_t width) {
    for (int64_t m = 0; m < M; m++) {
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; j + 16 <= width; j += 16) {
            __m256i half[2];
            for (int h = 0; h < 2; h++) {
                __m256 sum = _mm256_loadu_ps(acc + m * NR + j + 8 * h);
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
            _mm256_storeu_si256((__m256i *)(y + m * N + j), packed);
        }
#endif
        for (; j < width; j++) {
            y[m * N + j] = f32_to_bf16(acc[m * NR + j] + (bias == NULL ? 0.0f : bf16_to_f32(bias[j])));
        }
    }
}

/* x [M, K] widened to float32 rows of even length (a zero after an odd K's last), then the same
 * rows with each pair's two k swapped, in one block; or NULL */
static float *widened_rows(const uint16_t *x, int64_t M, int64_t K) {
    const int64_t padded = K + K % 2;
    float *wide = malloc(sizeof(float) * (M * padded > 0 ? 2 * M * padded : 1));
    if (wide == NULL) return NULL;
    float *swapped = wide + M * padded;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t m = 0; m < M; m++) {
        int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; k + 8 <= K; k += 8) {
            const __m256 v = _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + m * K + k))), 16));
            _mm256_storeu_ps(wide + m * padded + k, v);
            _mm256_storeu_ps(swapped + m * padded + k, _mm256_permute_ps(v, 0xB1)); /* k ^ 1 */
        }
#endif
        for (; k < K; k++) wide[m * padded + k] = bf16_to_f32(x[m * K + k]);
        if (K % 2) wide[m * padded + K] = 0.0f;
        for (k = K / 8 * 8; k < padded; k++) swapped[m * padded + (k ^ 1)] = wide[m * padded + k];
    }
    return wide;
}

int tiled_linear_bf16(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t K, int64_t N) {
    const int64_t count = (N + NR - 1) / NR, padded = K + K % 2;
    float *wide = widened_rows(x, M, K);
    int failed = wide == NULL;
#pragma omp parallel if (!failed)
    {
        float *acc = malloc(sizeof(float) * M * NR), *wide_tile = malloc(sizeof(float) * NR * padded);
        if (acc == NULL || wide_tile == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < count; t++) {
            if (acc == NULL || wide_tile == NULL) continue;
            const int64_t col = t * NR, width = N - col < NR ? N - col : NR;
            const char *next = (t + 2) * NR <= N ? (const char *)(tiles + (col + NR) * padded) : NULL;
            pair_tile_sums(wide, wide + M * padded, padded, tiles + col * padded, width, acc, wide_tile, M, next);
            round_rows(acc, bias == NULL ? NULL : bias + col, y + col, N, M, width);
        }
        free(acc);
        free(wide_tile);
    }
    free(wide);
    return failed;
}

int tiled_gate_up_bf16(const uint16_t *x, const uint16_t *tiles, uint16_t *y, int64_t M, int64_t K, int64_t I,
                       int fused) {
    const int64_t pairs = (I + NR - 1) / NR, padded = K + K % 2;
    float *wide = widened_rows(x, M, K);
    int failed = wide == NULL;
#pragma omp parallel if (!failed)
    {
        float *acc = malloc(sizeof(float) * M * NR), *wide_tile = malloc(sizeof(float) * NR * padded);
        uint16_t *tmp = malloc(sizeof(uint16_t) * M * 2 * NR);
        if (acc == NULL || tmp == NULL || wide_tile == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; t++) {
            if (acc == NULL || tmp == NULL || wide_tile == NULL) continue;
            const int64_t w = I - t * NR < NR ? I - t * NR : NR, n = 2 * w;
            const uint16_t *pair = tiles + t * 2 * NR * padded;
            const int64_t next_w = I - (t + 1) * NR < NR ? I - (t + 1) * NR : NR;
            const char *next_pair = t + 1 < pairs ? (const char *)(pair + 2 * NR * padded) : NULL;
            for (int64_t c = 0; c < n; c += NR) {
                const int64_t width = n - c < NR ? n - c : NR;
                pair_tile_sums(wide, wide + M * padded, padded, pair + c * padded, width, acc, wide_tile, M,
                               next_full_tile((const char *)pair, next_pair, c, n, next_w,
                                              NR * padded * sizeof(uint16_t)));
                round_rows(acc, NULL, tmp + c, n, M, width);
            }
            FINISH_PAIR(uint16_t, bf16, fused, tmp, y, M, w, I, t);
        }
        free(acc);
        free(tmp);
        free(wide_tile);
    }
    free(wide);
    return failed;
}
#endif

/* out[r, :] = W[ids[r], :] for a tiled W of N rows of K elements of `elem` bytes, k stored in
 * groups of `group` (bfloat16: pairs, with a zero k when K is odd): one strided gather per row,
 * where indexing the tiles in torch takes a dozen small ops. */
int tiled_rows(const char *tiles, const int64_t *ids, char *out, int64_t n, int64_t K, int64_t N, int64_t elem,
               int64_t group) {
    for (int64_t r = 0; r < n; r++)
        if (ids[r] < 0 || ids[r] >= N) return 1;
    const int64_t padded = (K + group - 1) / group * group, full = N / NR * NR;
    for (int64_t r = 0; r < n; r++) {
        const int64_t id = ids[r];
        const int64_t width = id < full ? NR : N - full, col = id < full ? id % NR : id - full;
        const char *base = tiles + (id < full ? id / NR * NR : full) * padded * elem + col * group * elem;
        char *row = out + r * K * elem;
        const int64_t stride = width * group * elem;
        if (group == 1 && elem == 4)
            for (int64_t k = 0; k < K; k++) memcpy(row + k * 4, base + k * stride, 4);
        else
            for (int64_t k = 0; k < K; k += group)
                memcpy(row + k * elem, base + k / group * stride, (K - k < group ? K - k : group) * elem);
    }
    return 0;
}

int64_t tiled_gemm_tile_width(void) { return NR; }

int64_t tiled_gemm_bf16_loop(void) {
#if defined(__AVX512BF16__)
    return 2;
#elif defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}
