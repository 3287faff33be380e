/*
 * quant_linear_bf16's product on AMX tiles from AMX_QUANT_ROWS rows: quant_gemm.c includes this
 * file where simd.h's GEMM_AMX is 1, after its QuantKind entries. From that many rows the tiles
 * beat the register path, whose FMAs grow with the rows while a panel's dequantization is paid
 * once; fewer rows stay there (float32 sums of the exact weights, rounded once).
 *
 * The weight is the A operand and x the B one, the transpose of the dense product's roles
 * (gemm_amx.h): an A tile is 16 rows of 32 consecutive k, which is what a row's quantized blocks
 * dequantize to, so a panel of PANEL weight rows is dequantized (the type's own dequantizer, bit
 * for bit gguf-py's) and rounded to bfloat16 (to nearest even, as the weight's `.to(bfloat16)`
 * rounds) straight into tile rows, with no reordering; x is packed once per call as B tiles
 * (16 rows' k pairs as 32-bit columns, zero beyond M). Each 16 x 16 block of sums accumulates
 * its k blocks in order in a float32 tile register, the same products in the same order as the
 * dense AMX product on the rounded weight, so the result is that product's bit for bit: the
 * sums, transposed back to rows, get the bias in float32 and are rounded to bfloat16 once.
 *
 * Why the roles are swapped: the dense layout wants the weight as k pairs per column, a 16 x 16
 * transpose of 32-bit pairs per tile; a decode batch dequantizes every weight once per step, so
 * that transpose would cost every step what the tiles save. x is small and packed once; the
 * outputs are transposed per 32 x 32 block of sums, far fewer elements than the weight's.
 */
#include "amx_tiles.h"
#include "transpose16.h"

#define AMX_QUANT_ROWS 5  /* rows from which a bfloat16 product runs on the tiles */
#define PANEL 32          /* weight rows per work item: two A tiles */
#define AHEAD_BYTES 4096  /* how far ahead of the row dequantized its bytes are asked for */

/* x [M, K] as B tiles: [groups of 16 rows][K / 2 pairs][16 rows] 32-bit k pairs, zero beyond M;
 * NULL without memory */
static uint32_t *quant_amx_columns(const uint16_t *x, int64_t M, int64_t K) {
    const int64_t groups = (M + 15) / 16, pairs = K / 2;
    uint32_t *b = aligned_alloc(64, sizeof(uint32_t) * 16 * pairs * groups);
    if (b == NULL) return NULL;
#pragma omp parallel for schedule(static) if (M * K >= 65536)
    for (int64_t g = 0; g < groups; g++)
        for (int j = 0; j < 16; j++) {
            const int64_t m = 16 * g + j;
            uint32_t *column = b + g * pairs * 16 + j;
            if (m >= M) {
                for (int64_t p = 0; p < pairs; p++) column[16 * p] = 0;
                continue;
            }
            for (int64_t p = 0; p < pairs; p++) {
                uint32_t pair;
                memcpy(&pair, x + m * K + 2 * p, sizeof pair);
                column[16 * p] = pair;
            }
        }
    return b;
}

/* panel [PANEL, K] bfloat16: weight rows n0 .. n0 + rows - 1 (of N) dequantized and rounded, zero
 * rows after them. Each row first asks for a row's worth of bytes AHEAD_BYTES past its own start
 * (into the next panel's at the end): a batch's step streams every weight from memory, and the
 * hardware's prefetch alone left the dequantization waiting on it */
static void quant_amx_panel(const QuantKind *kind, const void *w, int64_t K, int64_t N, int64_t n0, int64_t rows,
                            uint16_t *panel) {
    const int64_t blocks = K / kind->elements, row_bytes = blocks * kind->bytes;
    for (int64_t r = 0; r < PANEL; r++) {
        uint16_t *out = panel + r * K;
        if (r >= rows) {
            memset(out, 0, sizeof(uint16_t) * K);
            continue;
        }
        const int64_t from = (n0 + r) * row_bytes + AHEAD_BYTES, to = from + row_bytes < N * row_bytes
                                                                        ? from + row_bytes
                                                                        : N * row_bytes;
        for (int64_t b = from; b < to; b += 64) _mm_prefetch((const char *)w + b, _MM_HINT_T0);
        kind->dequantize_bf16((const char *)w + (n0 + r) * row_bytes, out, blocks);
    }
}

/* sums[i][j] (row stride 32) = panel row i . x row m0 + j for i < 32 and j < 16 or 32 (two:
 * whether x has a second group of 16 rows here) */
static inline void quant_amx_block(const uint16_t *panel, int64_t K, const uint32_t *group, int two, float *sums) {
    const int64_t pairs = K / 2, a_stride = K * sizeof(uint16_t), b_stride = 16 * sizeof(uint32_t);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < K; k += AMX_K) {
        _tile_loadd(4, panel + k, a_stride);
        _tile_loadd(5, panel + 16 * K + k, a_stride);
        _tile_loadd(6, group + k / 2 * 16, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(2, 5, 6);
        if (two) {
            _tile_loadd(7, group + pairs * 16 + k / 2 * 16, b_stride);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    const int64_t s = 32 * sizeof(float);
    _tile_stored(0, sums, s);
    _tile_stored(2, sums + 16 * 32, s);
    if (two) {
        _tile_stored(1, sums + 16, s);
        _tile_stored(3, sums + 16 * 32 + 16, s);
    }
}

/* y[j, i] (row stride ldy) = bfloat16(sums[i][j] + bias[i]) for j < rows, i < width (both <= 16;
 * sums' row stride 32): the block transposed in registers, each row rounded by the instruction
 * the dense AMX product rounds with */
static inline void quant_amx_store(const float *sums, int64_t rows, int64_t width, const float *bias, uint16_t *y,
                                   int64_t ldy) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(sums + 32 * i);
    transpose16(r);
    const __m512 b = _mm512_load_ps(bias);
    const __mmask16 mask = (__mmask16)((1u << width) - 1);
    for (int64_t j = 0; j < rows; j++)
        _mm256_mask_storeu_epi16(y + j * ldy, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(r[j], b)));
}

/* quant_linear_bf16 on AMX (M >= AMX_QUANT_ROWS, amx_usable()): nonzero when out of memory */
static int quant_amx_linear_bf16(const QuantKind *kind, const uint16_t *x, const void *w, const uint16_t *bias,
                                 uint16_t *y, int64_t M, int64_t K, int64_t N, int64_t ldy) {
    uint32_t *columns = quant_amx_columns(x, M, K);
    if (columns == NULL) return 1;
    const int64_t items = (N + PANEL - 1) / PANEL, pairs = K / 2;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *panel = aligned_alloc(64, sizeof(uint16_t) * PANEL * K);
        const int missing = panel == NULL;
        if (missing) failed = 1;
        amx_configure();
        float sums[32 * 32] __attribute__((aligned(64)));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < items; t++) {
            if (missing) continue;
            const int64_t n0 = t * PANEL, width = N - n0 < PANEL ? N - n0 : PANEL;
            quant_amx_panel(kind, w, K, N, n0, width, panel);
            float b[PANEL] __attribute__((aligned(64)));
            for (int64_t i = 0; i < PANEL; i++) b[i] = bias != NULL && i < width ? bf16_to_f32(bias[n0 + i]) : 0.0f;
            for (int64_t m0 = 0; m0 < M; m0 += 32) {
                const int64_t rows = M - m0 < 32 ? M - m0 : 32;
                quant_amx_block(panel, K, columns + m0 / 16 * pairs * 16, rows > 16, sums);
                for (int64_t j0 = 0; j0 < rows; j0 += 16)
                    for (int64_t i0 = 0; i0 < width; i0 += 16)
                        quant_amx_store(sums + i0 * 32 + j0, rows - j0 < 16 ? rows - j0 : 16,
                                        width - i0 < 16 ? width - i0 : 16, b + i0, y + (m0 + j0) * ldy + n0 + i0,
                                        ldy);
            }
        }
        _tile_release();
        free(panel);
    }
    free(columns);
    return failed;
}
