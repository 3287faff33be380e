/*
 * quant_gemm.c's functions for one block type, included once per type (the `#include`-template
 * idiom: plain C a debugger steps through). The includer defines, and this file undefines at
 * its end:
 *   BLOCK         the block struct (quant_types.h)
 *   QK            elements per block
 *   DEQUANTIZE    the type's block dequantizer: (const BLOCK *, float out[QK])
 *   GEMV_DEQUANTIZE  optional: the register path's, writing LANE_ORDER (quant_gemm.c)
 *   SUFFIX(name)  name with the type's suffix: gemv -> gemv_q4_0
 * and gets the type's QuantKind, SUFFIX(kind).
 */

#ifdef GEMV_DEQUANTIZE
#define SUFFIX_LANE_ORDER 1
#else
#define GEMV_DEQUANTIZE DEQUANTIZE
#define SUFFIX_LANE_ORDER 0
#endif

/* `blocks` consecutive blocks (one row, or a run of rows) into float32 */
static void SUFFIX(dequantize_row)(const void *row, float *out, int64_t blocks) {
    const BLOCK *b = row;
    for (int64_t i = 0; i < blocks; i++) DEQUANTIZE(b + i, out + i * QK);
}

#if GEMM_AMX
/* `blocks` consecutive blocks into bfloat16 rounded to nearest even (quant_amx.h's panel rows,
 * 64-byte aligned): each block converted while it is still in registers or L1 */
static void SUFFIX(dequantize_row_bf16)(const void *row, uint16_t *out, int64_t blocks) {
    const BLOCK *b = row;
    for (int64_t i = 0; i < blocks; i++) {
        float wq[QK] __attribute__((aligned(64)));
        DEQUANTIZE(b + i, wq);
        for (int c = 0; c < QK; c += 32) /* the second operand makes lanes 0-15 */
            _mm512_store_si512(out + i * QK + c,
                               (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(wq + c + 16), _mm512_load_ps(wq + c)));
    }
}
#define SUFFIX_ROW_BF16 SUFFIX(dequantize_row_bf16)
#else
#define SUFFIX_ROW_BF16 NULL
#endif

/* out[m, j] = x[m] . W[n0 + j] for j < width and M rows: each block of a weight row is
 * dequantized once into registers (a QK-float buffer the compiler keeps there), then multiplied
 * into every row's SPLIT lane accumulators, which are summed at the row's end. M a constant after
 * inlining (gemv: 1, or any up to GEMV_ROWS). */
static inline __attribute__((always_inline)) void SUFFIX(gemv_rows)(const float *x, const BLOCK *w, int64_t K,
                                                                   int64_t M, int64_t n0, int64_t width,
                                                                   float *out, int64_t ld) {
    const int64_t blocks = K / QK;
    for (int64_t j = 0; j < width; j++) {
        const BLOCK *row = w + (n0 + j) * blocks;
        vf acc[GEMV_ROWS][SPLIT];
        for (int64_t m = 0; m < M; m++)
            for (int s = 0; s < SPLIT; s++) acc[m][s] = (vf){0};
        for (int64_t i = 0; i < blocks; i++) {
            float wq[QK] __attribute__((aligned(64)));
            __builtin_prefetch((const char *)(row + i) + PREFETCH_BYTES);
            GEMV_DEQUANTIZE(row + i, wq);
            for (int64_t m = 0; m < M; m++) {
                const float *xm = x + m * K + i * QK;
                for (int c = 0; c < QK; c += VL) acc[m][c / VL % SPLIT] += vload(xm + c) * vload(wq + c);
            }
        }
        for (int64_t m = 0; m < M; m++) out[m * ld + j] = lane_sum(acc[m]);
    }
}

static void SUFFIX(gemv)(const float *x, const BLOCK *w, int64_t K, int64_t M, int64_t n0, int64_t width,
                         float *out, int64_t ld) {
    if (M == 1)
        SUFFIX(gemv_rows)(x, w, K, 1, n0, width, out, ld);
    else
        SUFFIX(gemv_rows)(x, w, K, M, n0, width, out, ld);
}

/* rows n0 .. n0 + width of W dequantized into the tiled GEMM's layout, tile[k * width + j] =
 * W[n0 + j, k]: block column by block column, TILE_GROUP rows at a time staged in L1, so each
 * store into the tile fills a run of TILE_GROUP columns (one cache line), not one float */
static void SUFFIX(to_tile)(const BLOCK *w, int64_t K, int64_t n0, int64_t width, float *tile) {
    const int64_t blocks = K / QK;
    float stage[TILE_GROUP][QK] __attribute__((aligned(64)));
    for (int64_t i = 0; i < blocks; i++)
        for (int64_t j0 = 0; j0 < width; j0 += TILE_GROUP) {
            const int64_t group = width - j0 < TILE_GROUP ? width - j0 : TILE_GROUP;
            for (int64_t j = 0; j < group; j++) DEQUANTIZE(w + (n0 + j0 + j) * blocks + i, stage[j]);
            float *run = tile + i * QK * width + j0;
            if (group == TILE_GROUP)
                for (int e = 0; e < QK; e++)
                    for (int j = 0; j < TILE_GROUP; j++) run[e * width + j] = stage[j][e];
            else
                for (int e = 0; e < QK; e++)
                    for (int64_t j = 0; j < group; j++) run[e * width + j] = stage[j][e];
        }
}

/* QuantKind.columns for this type (see quant_gemm.c) */
static void SUFFIX(columns)(const float *x, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width,
                            float *out, int64_t ld, float *tile) {
    if (tile == NULL) {
        SUFFIX(gemv)(x, w, K, M, n0, width, out, ld);
    } else {
        SUFFIX(to_tile)(w, K, n0, width, tile);
        tiled_tile_f32(x, tile, width, out, ld, M, K);
    }
}

static const QuantKind SUFFIX(kind) = {QK, sizeof(BLOCK), SUFFIX_LANE_ORDER, SUFFIX(dequantize_row), SUFFIX_ROW_BF16,
                                        SUFFIX(columns)};

#undef SUFFIX_LANE_ORDER
#undef SUFFIX_ROW_BF16
#undef GEMV_DEQUANTIZE
#undef BLOCK
#undef QK
#undef DEQUANTIZE
#undef SUFFIX
