/*
 * The tiled GEMM's bfloat16 product on AMX tiles (TDPBF16PS), for batches of AMX_ROWS rows and
 * more: tiled_gemm.c includes this file where the target has AMX-TILE and AMX-BF16 (and so
 * AVX512-BF16), after gemm_avx512bf16.h.
 *
 * The tiled layout already holds k in pairs per column (gemm_avx512bf16.h): 16 pairs of 16
 * columns of a full tile are one AMX B tile as they lie, rows 4 NR bytes apart, so the weights
 * are read in place. x is copied once per call into rows of whole 16-row and 32-k blocks, zero
 * beyond M and K (an A tile then never reads past x); a narrow last tile or a K that is not a
 * whole number of 32-k blocks is copied, zero-padded the same way, into a per-thread tile. The
 * zeros add nothing to any sum. Each 16 x 16 block of outputs sums its k blocks in order in a
 * float32 tile register, as oneDNN's AMX kernel does; the bias is added in float32 and the result
 * rounded to bfloat16 once, to nearest even.
 *
 * Fewer rows stay on the AVX512-BF16 loop: a decode step of a few rows streams its weights from
 * memory at the same rate either way, and there vdpbf16ps gives oneDNN's bits (see tiled_gemm.py
 * for which loop sums in which order). Linux hands a process the AMX register state only when
 * asked (arch_prctl); where it refuses, every batch stays on that loop.
 */
#include "amx_tiles.h"

#define AMX_ROWS 1 /* rows from which a bfloat16 product runs on AMX tiles */

static int amx_rows(int64_t M) { return M >= AMX_ROWS && amx_usable(); }

/* Tiles here: tmm0-3 the sums, tmm4-5 x, tmm6-7 the weights.
 * x [M, K] as AMX A rows: [round_up(M, 16), kp] zero beyond M and K (NULL without memory) */
static uint16_t *amx_rows_of(const uint16_t *x, int64_t M, int64_t K, int64_t kp) {
    const int64_t mp = (M + 15) / 16 * 16;
    uint16_t *a = aligned_alloc(64, sizeof(uint16_t) * mp * kp);
    if (a == NULL) return NULL;
    for (int64_t m = 0; m < mp; m++) {
        uint16_t *row = a + m * kp;
        const int64_t have = m < M ? K : 0;
        if (have) memcpy(row, x + m * K, sizeof(uint16_t) * K);
        memset(row + have, 0, sizeof(uint16_t) * (kp - have));
    }
    return a;
}

/* the tile's weights as whole B tiles: the tile itself when full and its pairs a multiple of 16,
 * else a copy zero-padded to NR columns and kp / 2 pairs in `spare` (room for kp * NR) */
static const uint16_t *amx_b_of(const uint16_t *tile, int64_t width, int64_t pairs, int64_t kp,
                                uint16_t *spare) {
    if (width == NR && pairs * 2 == kp) return tile;
    for (int64_t p = 0; p < kp / 2; p++) {
        uint16_t *row = spare + p * 2 * NR;
        const int64_t have = p < pairs ? 2 * width : 0;
        if (have) memcpy(row, tile + p * 2 * width, sizeof(uint16_t) * have);
        memset(row + have, 0, sizeof(uint16_t) * (2 * NR - have));
    }
    return spare;
}

/* sums[16 r + i, 16 c + j] (row stride 64 floats) for `blocks` row blocks (1 or 2) and the
 * column blocks `first` .. of the tile: four C tiles, as 1 x 4 or 2 x 2 blocks */
static inline __attribute__((always_inline)) void amx_block(const uint16_t *a, int64_t kp, const uint16_t *b,
                                                            int blocks, int first, float *sums) {
    const int64_t a_stride = kp * 2, b_stride = 4 * NR;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < kp; k += AMX_K) {
        const uint16_t *bk = b + k * NR; /* pair k / 2, as 16 rows of 2 NR values */
        _tile_loadd(4, a + k, a_stride);
        if (blocks == 2) {
            if (k + 2 * AMX_K < kp) /* the B rows two k steps ahead, into L1 */
                for (int r = 0; r < 16; r++)
                    _mm_prefetch((const char *)(bk + 2 * AMX_K * NR + r * 2 * NR + 2 * AMX_N * first), _MM_HINT_T0);
            _tile_loadd(5, a + 16 * kp + k, a_stride);
            _tile_loadd(6, bk + 2 * AMX_N * first, b_stride);
            _tile_loadd(7, bk + 2 * AMX_N * (first + 1), b_stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        } else {
            _tile_loadd(6, bk, b_stride);
            _tile_loadd(7, bk + 2 * AMX_N, b_stride);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_loadd(6, bk + 4 * AMX_N, b_stride);
            _tile_loadd(7, bk + 6 * AMX_N, b_stride);
            _tile_dpbf16ps(2, 4, 6);
            _tile_dpbf16ps(3, 4, 7);
        }
    }
    const int64_t s = 64 * sizeof(float);
    if (blocks == 2) {
        _tile_stored(0, sums + 16 * first, s);
        _tile_stored(1, sums + 16 * (first + 1), s);
        _tile_stored(2, sums + 16 * 64 + 16 * first, s);
        _tile_stored(3, sums + 16 * 64 + 16 * (first + 1), s);
    } else {
        _tile_stored(0, sums, s);
        _tile_stored(1, sums + 16, s);
        _tile_stored(2, sums + 32, s);
        _tile_stored(3, sums + 48, s);
    }
}

/* y [rows, width] (row stride ldy) = bfloat16(sums + bias), 16 columns at a time, rounded by the
 * instruction the AVX512-BF16 loop rounds with */
static void amx_store(const float *sums, int64_t rows, int64_t width, const uint16_t *bias, uint16_t *y,
                      int64_t ldy) {
    __m512 b[4];
    __mmask16 mask[4];
    for (int j = 0; j < 4; j++) {
        const int64_t lanes = width - 16 * j;
        mask[j] = lanes >= 16 ? 0xFFFF : lanes <= 0 ? 0 : (__mmask16)((1u << lanes) - 1);
        b[j] = bias == NULL ? _mm512_setzero_ps()
                            : _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask[j], bias + 16 * j)), 16));
    }
    for (int64_t m = 0; m < rows; m++)
        for (int j = 0; j < 4 && mask[j]; j++) {
            const __m512 sum = _mm512_add_ps(_mm512_load_ps(sums + m * 64 + 16 * j), b[j]);
            _mm256_mask_storeu_epi16(y + m * ldy + 16 * j, mask[j], (__m256i)_mm512_cvtneps_pbh(sum));
        }
}

/* y [M, width] (row stride ldy) = bfloat16(a . T + bias) for one tile T (`pairs` k pairs, width
 * <= NR columns), a from amx_rows_of; spare: see amx_b_of. The thread has run amx_configure. */
static void amx_tile_bf16(const uint16_t *a, int64_t kp, int64_t M, const uint16_t *tile, int64_t width,
                          int64_t pairs, const uint16_t *bias, uint16_t *y, int64_t ldy, uint16_t *spare) {
    float sums[32 * 64] __attribute__((aligned(64)));
    const uint16_t *b = amx_b_of(tile, width, pairs, kp, spare);
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int blocks = M - m0 > 16 ? 2 : 1;
        const uint16_t *am = a + m0 * kp;
        if (blocks == 2) {
            amx_block(am, kp, b, 2, 0, sums);
            if (width > 2 * AMX_N) amx_block(am, kp, b, 2, 2, sums);
        } else {
            amx_block(am, kp, b, 1, 0, sums);
        }
        amx_store(sums, M - m0 < 32 ? M - m0 : 32, width, bias, y + m0 * ldy, ldy);
    }
}

/* a call's sizes for K and n output columns: k padded to pairs, the pairs, k padded to whole
 * A tiles, tiles of NR columns, and whether a tile needs amx_b_of's copy */
typedef struct {
    int64_t padded, pairs, kp, count;
    int copies;
} AmxShape;

static AmxShape amx_shape(int64_t K, int64_t n) {
    AmxShape s = {.padded = K + K % 2};
    s.pairs = s.padded / 2;
    s.kp = (s.padded + AMX_K - 1) / AMX_K * AMX_K;
    s.count = (n + NR - 1) / NR;
    s.copies = n % NR != 0 || s.pairs * 2 != s.kp;
    return s;
}

/* tiled_linear_bf16 on AMX (M >= AMX_ROWS, amx_usable()) */
static int amx_linear_bf16(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t M,
                           int64_t K, int64_t N) {
    const AmxShape s = amx_shape(K, N);
    const int64_t padded = s.padded, pairs = s.pairs, kp = s.kp, count = s.count, copies = s.copies;
    uint16_t *a = amx_rows_of(x, M, K, kp);
    if (a == NULL) return 1;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *spare = copies ? aligned_alloc(64, sizeof(uint16_t) * kp * NR) : NULL;
        if (copies && spare == NULL) failed = 1;
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < count; t++) {
            if (copies && spare == NULL) continue;
            const int64_t col = t * NR, width = N - col < NR ? N - col : NR;
            amx_tile_bf16(a, kp, M, tiles + col * padded, width, pairs, bias == NULL ? NULL : bias + col,
                          y + col, N, spare);
        }
        _tile_release();
        free(spare);
    }
    free(a);
    return failed;
}

/* tiled_gate_up_bf16 on AMX (M >= AMX_ROWS, amx_usable()): each pair's tiles into the thread's
 * [M, 2 w] workspace, then the pair's epilogue, as the AVX512-BF16 loop does */
static int amx_gate_up_bf16(const uint16_t *x, const uint16_t *tiles, uint16_t *y, int64_t M, int64_t K, int64_t I,
                            int fused) {
    const AmxShape s = amx_shape(K, I);
    const int64_t padded = s.padded, pairs = s.pairs, kp = s.kp, count = s.count, copies = s.copies;
    uint16_t *a = amx_rows_of(x, M, K, kp);
    if (a == NULL) return 1;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *tmp = malloc(sizeof(uint16_t) * M * 2 * NR);
        uint16_t *spare = copies ? aligned_alloc(64, sizeof(uint16_t) * kp * NR) : NULL;
        const int missing = tmp == NULL || (copies && spare == NULL);
        if (missing) failed = 1;
        amx_configure();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < count; t++) {
            if (missing) continue;
            const GatePair p = gate_pair(tiles, t, count, I, NR * padded * sizeof(uint16_t));
            const int64_t n = 2 * p.w;
            for (int64_t c = 0; c < n; c += NR)
                amx_tile_bf16(a, kp, M, (const uint16_t *)p.pair + c * padded, n - c < NR ? n - c : NR, pairs,
                              NULL, tmp + c, n, spare);
            finish_pair_bf16(fused, tmp, y, M, p.w, I, t);
        }
        _tile_release();
        free(tmp);
        free(spare);
    }
    free(a);
    return failed;
}
