/*
 * y = x . W^T + b on the CPU, W stored in column tiles: the linear layers' kernel, in float32
 * and bfloat16. Entry points and arguments: kernels.h.
 *
 * Why not oneDNN: in a decode step every weight is read from DRAM once for a handful of rows,
 * and a GEMM that packs its operands as it goes stalls on that stream. Here each tile of 64
 * output columns is one contiguous run of memory that the k loop reads front to back
 * (prefetched PF rows ahead, into L2), the first block of rows pulls it from DRAM and the others
 * reuse it from L2 while they pull the next tile there (NEXT_TILE). The same loop runs
 * prefill's thousands of rows. float32 has three loops, chosen at compile time (simd.h): AVX-512
 * (gemm_avx512.h), AVX2 with FMA (column passes over a tile, gemm_avx2.h) and a portable one
 * (gemm_portable.h); bfloat16 runs on AVX512-BF16 (gemm_avx512bf16.h), else on AVX2 or portable
 * loops over pairs widened to float32. This file holds what every target shares: the layout, the
 * walk over tiles and rows, the workspaces and the epilogues.
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

/* the target's loops (simd.h chooses): each file defines its own, none a shared name */
#include "gemm_portable.h"
#if GEMM_AVX2
#include "gemm_avx2.h"
#endif
#if GEMM_AVX512
#include "gemm_avx512.h"
#endif
#if GEMM_AVX512_BF16
#include "gemm_avx512bf16.h"
#endif

/* A full tile's float32 loop, the target's, for row block `index` of the tile's (M rows), with the
 * next tile or NULL (see NEXT_TILE) */
#if GEMM_AVX512
/* a constant row count per call lets the compiler keep every accumulator in a register */
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

#elif GEMM_AVX2

/* the same k steps of the next tile are pulled as this call's, so a tile deeper than KC (a down
 * projection's 1,376 k) has all of it in L2 in time, not only its first chunk */
static void block_rows(const float *x, int64_t K, const float *tile, int64_t k0, int64_t k1, float *y,
                       int64_t N, int rows, int64_t index, int64_t M, const char *next_tile) {
    const char *next = next_tile == NULL ? NULL : next_tile + k0 * NR * sizeof(float);
    block_columns_of(x, K, (const char *)tile, k1 - k0, k0, k1, y, N, rows, index, M, next, 0);
}

#else /* portable: the same operations in the same order, left to the compiler's vectoriser */

static void block_rows(const float *x, int64_t K, const float *tile, int64_t k0, int64_t k1, float *y,
                       int64_t N, int rows, int64_t index, int64_t M, const char *next_tile) {
    (void)index, (void)M, (void)next_tile;
    narrow_rows(x, K, tile, NR, k0, k1, y, N, rows);
}

#endif

/* a tile of `width` <= NR columns times all M rows, into y (row stride ldy): a full tile in
 * registers, a narrower one with the portable loop */
static void tile_columns(const float *x, const float *tile, int64_t width, float *y, int64_t ldy, int64_t M,
                         int64_t K, const char *next_tile) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
        int64_t k1 = k0 + KC < K ? k0 + KC : K;
        for (int64_t m = 0; m < M; m += MR) {
            int rows = M - m < MR ? (int)(M - m) : MR;
            if (width == NR)
                block_rows(x + m * K, K, tile, k0, k1, y + m * ldy, ldy, rows, m / MR, M, next_tile);
            else
                narrow_rows(x + m * K, K, tile, width, k0, k1, y + m * ldy, ldy, rows);
        }
    }
}

void tiled_tile_f32(const float *x, const float *tile, int64_t width, float *y, int64_t ldy, int64_t M, int64_t K) {
    tile_columns(x, tile, width, y, ldy, M, K, NULL);
}

/* columns [col, col + width) for all M rows from their tile (width: NR, or what is left of N) */
static void tile_product(const float *x, const float *tile, const float *bias, float *y,
                         int64_t M, int64_t K, int64_t N, int64_t col, const char *next_tile) {
    int64_t width = N - col < NR ? N - col : NR;
    tile_columns(x, tile, width, y + col, N, M, K, next_tile);
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
 * into y's columns 64 t .. + w (row stride I), else gate and up to their own columns; in float32
 * and in bfloat16 */
static inline void finish_pair_f32(int fused, const float *tmp, float *y, int64_t M, int64_t w, int64_t I,
                                   int64_t t) {
    if (fused) {
        silu_and_mul_rows_f32(tmp, y + t * NR, M, w, I);
    } else {
        for (int64_t m = 0; m < M; m++) {
            memcpy(y + m * 2 * I + t * NR, tmp + m * 2 * w, sizeof(float) * w);
            memcpy(y + m * 2 * I + I + t * NR, tmp + m * 2 * w + w, sizeof(float) * w);
        }
    }
}

static inline void finish_pair_bf16(int fused, const uint16_t *tmp, uint16_t *y, int64_t M, int64_t w, int64_t I,
                                    int64_t t) {
    if (fused) {
        silu_and_mul_rows_bf16(tmp, y + t * NR, M, w, I);
    } else {
        for (int64_t m = 0; m < M; m++) {
            memcpy(y + m * 2 * I + t * NR, tmp + m * 2 * w, sizeof(uint16_t) * w);
            memcpy(y + m * 2 * I + I + t * NR, tmp + m * 2 * w + w, sizeof(uint16_t) * w);
        }
    }
}

/* pair t of the `pairs` pairs of a gate/up weight of I rows each (its gate tile or tiles, then
 * its up ones, each tile `tile_bytes` long): the columns of each half (w <= NR), where it starts,
 * and the next pair with its w (NULL after the last) */
typedef struct {
    int64_t w, next_w, tile_bytes;
    const char *pair, *next_pair;
} GatePair;

static inline GatePair gate_pair(const void *tiles, int64_t t, int64_t pairs, int64_t I, int64_t tile_bytes) {
    GatePair p;
    p.w = I - t * NR < NR ? I - t * NR : NR;
    p.next_w = I - (t + 1) * NR < NR ? I - (t + 1) * NR : NR;
    p.tile_bytes = tile_bytes;
    p.pair = (const char *)tiles + t * 2 * tile_bytes;
    p.next_pair = t + 1 < pairs ? p.pair + 2 * tile_bytes : NULL;
    return p;
}

/* the next full tile after column c of a pair (of n = 2 w columns), for NEXT_TILE, or NULL */
static inline const char *next_full_tile(const GatePair *p, int64_t c) {
    const int64_t n = 2 * p->w;
    if (c + 2 * NR <= n) return p->pair + (c / NR + 1) * p->tile_bytes;
    if (c + NR >= n && p->next_pair != NULL && 2 * p->next_w >= NR) return p->next_pair;
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
            const GatePair p = gate_pair(tiles, t, pairs, I, NR * K * sizeof(float));
            const int64_t w = p.w, n = 2 * w;
            const float *pair = (const float *)p.pair;
            for (int64_t m0 = 0; m0 < M; m0 += run) {
                const int64_t rows = M - m0 < run ? M - m0 : run;
                for (int64_t c = 0; c < n; c += NR) {
                    const int pulls = c == 0 ? m0 == 0 : m0 + rows == M;
                    tile_product(x + m0 * K, pair + c * K, NULL, tmp, rows, K, n, c,
                                 pulls ? next_full_tile(&p, c) : NULL);
                }
                finish_pair_f32(fused, tmp, y + m0 * y_stride, rows, w, I, t);
            }
        }
        free(tmp);
    }
    return failed;
}

#if GEMM_AVX512_BF16
/* bfloat16 on AVX512-BF16 (gemm_avx512bf16.h): a narrow last tile runs the same loop, masked */
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

#if GEMM_AMX
#include "gemm_amx.h"
#endif

int tiled_linear_bf16(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t K, int64_t N) {
#if GEMM_AMX
    if (amx_rows(M)) return amx_linear_bf16(x, tiles, bias, y, M, K, N);
#endif
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
#if GEMM_AMX
    if (amx_rows(M)) return amx_gate_up_bf16(x, tiles, y, M, K, I, fused);
#endif
    const int64_t pairs = (I + NR - 1) / NR, padded = K + K % 2;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *tmp = malloc(sizeof(uint16_t) * M * 2 * NR);
        if (tmp == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < pairs; t++) {
            if (tmp == NULL) continue;
            const GatePair p = gate_pair(tiles, t, pairs, I, NR * padded * sizeof(uint16_t));
            const int64_t w = p.w, n = 2 * w;
            const uint16_t *pair = (const uint16_t *)p.pair;
            for (int64_t c = 0; c < n; c += NR) {
                const int64_t width = n - c < NR ? n - c : NR;
                const char *next = next_full_tile(&p, c);
                for (int64_t m = 0; m < M; m += MR) {
                    int rows = M - m < MR ? (int)(M - m) : MR;
                    block_rows_bf16(x + m * K, K, pair + c * padded, width, NULL, tmp + m * n + c, n, rows, m == 0,
                                    NEXT_TILE(next, m / MR, padded / 2));
                }
            }
            finish_pair_bf16(fused, tmp, y, M, w, I, t);
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
#if GEMM_AVX2
    block_columns_of(x, K, (const char *)tile, steps, p0, p1, y, N, rows, index, M, next_tile, 1);
#else
    (void)steps, (void)index, (void)M, (void)next_tile;
    narrow_pairs(x, K, tile, NR, p0, p1, y, N, rows);
#endif
}

#if GEMM_AVX2
#define WIDEN_ROWS 24 /* rows from which a full tile is widened once (widen_tile), not per row block */
#endif

/* the float32 sums of all M rows of x (row stride K, even) by a tile of `width` columns, into
 * acc [M, NR] */
static void pair_tile_sums(const float *x, const float *swapped, int64_t K, const uint16_t *tile, int64_t width,
                           float *acc, float *wide_tile, int64_t M, const char *next_tile) {
    const int64_t steps = K / 2;
#if GEMM_AVX2
    if (M >= WIDEN_ROWS && width == NR) {
        widen_tile(tile, steps, wide_tile);
        for (int64_t k0 = 0; k0 < K; k0 += KC) {
            const int64_t k1 = k0 + KC < K ? k0 + KC : K;
            for (int64_t m = 0; m < M; m += MR) {
                const int rows = M - m < MR ? (int)(M - m) : MR;
                block_columns_of(swapped + m * K, K, (const char *)wide_tile, steps, k0, k1, acc + m * NR, NR, rows,
                                 m / MR, M, k0 == 0 ? next_tile : NULL, 0);
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
#if GEMM_AVX2
        j = round_row_avx2(acc + m * NR, bias, y + m * N, width);
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
#if GEMM_AVX2
        k = widen_row_avx2(x + m * K, wide + m * padded, swapped + m * padded, K);
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
            const GatePair p = gate_pair(tiles, t, pairs, I, NR * padded * sizeof(uint16_t));
            const int64_t w = p.w, n = 2 * w;
            const uint16_t *pair = (const uint16_t *)p.pair;
            for (int64_t c = 0; c < n; c += NR) {
                const int64_t width = n - c < NR ? n - c : NR;
                pair_tile_sums(wide, wide + M * padded, padded, pair + c * padded, width, acc, wide_tile, M,
                               next_full_tile(&p, c));
                round_rows(acc, NULL, tmp + c, n, M, width);
            }
            finish_pair_bf16(fused, tmp, y, M, w, I, t);
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

int64_t tiled_gemm_amx_rows(void) {
#if GEMM_AMX
    return amx_usable() ? AMX_ROWS : 0;
#else
    return 0;
#endif
}

int64_t tiled_gemm_bf16_loop(void) {
#if GEMM_AVX512_BF16
    return 2;
#elif GEMM_AVX2
    return 1;
#else
    return 0;
#endif
}
