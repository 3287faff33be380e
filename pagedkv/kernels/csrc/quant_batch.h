/*
 * quant_gemm.c's float32 product for decode batches, above the register path's rows and up to
 * BATCH_ROWS (the C decode stack's most): included where AVX512F is (simd.h's GEMM_AVX512), after
 * the QuantKind entries.
 *
 * The tile path dequantizes each weight into the tiled GEMM's layout, k-major with 64 columns per
 * k: a transpose of every weight, which a prefill amortises over its many rows but a decode batch
 * pays on every step for a few dozen. Here the weight is the broadcast operand instead: a panel of
 * PANEL_ROWS weight rows is dequantized as it lies (k contiguous, the type's own dequantizer),
 * x is packed once per call as k-major vectors of 16 rows, and each output is one fused
 * multiply-add chain over k in order from zero, W[n, k] broadcast times x[m, k] -- the products
 * and the order of tiled_linear_f32's chain on the dequantized weight, so its bits. Sums come out
 * transposed ([n][m]) and are transposed back 16 x 16 in registers.
 */
#include "transpose16.h"

#define BATCH_ROWS 64 /* the most rows this path takes; more amortise the tile path's transpose */
#define PANEL_ROWS 48 /* weight rows per work item */
#define GROUP_ROWS 12 /* weight rows per register block: 12 x 2 accumulators, 2 x vectors */

/* x [M, K] as [ceil(M / 16)][K][16]: each k's 16 rows one vector, zero beyond M; NULL without memory */
static float *batch_columns_of(const float *x, int64_t M, int64_t K) {
    const int64_t groups = (M + 15) / 16;
    float *xt = aligned_alloc(64, sizeof(float) * 16 * K * groups);
    if (xt == NULL) return NULL;
    for (int64_t g = 0; g < groups; g++)
        for (int j = 0; j < 16; j++) {
            const int64_t m = 16 * g + j;
            float *column = xt + g * K * 16 + j;
            for (int64_t k = 0; k < K; k++) column[16 * k] = m < M ? x[m * K + k] : 0.0f;
        }
    return xt;
}

/* sums[r][16 v + j] (row stride 32) = panel row r . x row 16 v + j, r < GROUP_ROWS, v < vectors
 * (1 or 2, a constant after inlining), x the vectors of one or two 16-row groups (K * 16 apart) */
static inline __attribute__((always_inline)) void batch_block(const float *panel, int64_t K, const float *xt,
                                                              int vectors, float *sums) {
    /* named accumulators: GCC may spill an array of __m512, even with constant indices */
#define START(r) __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = a##r##0;
    START(0) START(1) START(2) START(3) START(4) START(5) START(6) START(7) START(8) START(9) START(10) START(11)
#undef START
    const float *x1 = xt + K * 16;
    for (int64_t k = 0; k < K; k++) {
        const __m512 v0 = _mm512_load_ps(xt + 16 * k), v1 = vectors == 2 ? _mm512_load_ps(x1 + 16 * k) : v0;
#define ROW(r)                                                                                     \
    {                                                                                              \
        const __m512 w = _mm512_set1_ps(panel[(r) * K + k]);                                       \
        a##r##0 = _mm512_fmadd_ps(w, v0, a##r##0);                                                 \
        if (vectors == 2) a##r##1 = _mm512_fmadd_ps(w, v1, a##r##1);                               \
    }
        ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
    }
#define STORE(r)                                                                                   \
    _mm512_store_ps(sums + 32 * (r), a##r##0);                                                     \
    if (vectors == 2) _mm512_store_ps(sums + 32 * (r) + 16, a##r##1);
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) STORE(6) STORE(7) STORE(8) STORE(9) STORE(10) STORE(11)
#undef STORE
}

/* out[m, j] (row stride ld) = x[m] . W[n0 + j] for j < width <= PANEL_ROWS and M rows, xt from
 * batch_columns_of; panel: room for PANEL_ROWS * K floats */
static void batch_columns(const QuantKind *kind, const float *xt, const void *w, int64_t K, int64_t M, int64_t n0,
                          int64_t width, float *out, int64_t ld, float *panel) {
    const int64_t blocks = K / kind->elements, row_bytes = blocks * kind->bytes;
    const int64_t groups = (width + GROUP_ROWS - 1) / GROUP_ROWS;
    for (int64_t r = 0; r < groups * GROUP_ROWS; r++) /* a group's rows past width read zeros */
        if (r < width)
            kind->dequantize((const char *)w + (n0 + r) * row_bytes, panel + r * K, blocks);
        else
            memset(panel + r * K, 0, sizeof(float) * K);
    float sums[64 * 32] __attribute__((aligned(64))); /* [n][m]: PANEL_ROWS rows, padded to 16s */
    for (int64_t m0 = 0; m0 < M; m0 += 32) {
        const int64_t rows = M - m0 < 32 ? M - m0 : 32;
        const float *x0 = xt + m0 / 16 * K * 16;
        for (int64_t g = 0; g < groups; g++)
            if (rows > 16)
                batch_block(panel + g * GROUP_ROWS * K, K, x0, 2, sums + g * GROUP_ROWS * 32);
            else
                batch_block(panel + g * GROUP_ROWS * K, K, x0, 1, sums + g * GROUP_ROWS * 32);
        for (int64_t i0 = 0; i0 < width; i0 += 16)
            for (int64_t j0 = 0; j0 < rows; j0 += 16) {
                __m512 r[16];
                for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(sums + (i0 + i) * 32 + j0);
                transpose16(r);
                const int64_t lanes = width - i0 < 16 ? width - i0 : 16, count = rows - j0 < 16 ? rows - j0 : 16;
                const __mmask16 mask = (__mmask16)((1u << lanes) - 1);
                for (int64_t j = 0; j < count; j++) _mm512_mask_storeu_ps(out + (m0 + j0 + j) * ld + i0, mask, r[j]);
            }
    }
}
