/*
 * The tiled GEMM's portable loops (tiled_gemm.c includes this file on every target, after its
 * NR, MR, KC and PF): plain C that the compiler vectorises as the target allows, with the same
 * fused multiply-adds in the same order as the vector loops of gemm_avx512.h, gemm_avx512bf16.h
 * and gemm_avx2.h. They run a tile narrower than NR on every target, and every tile where the
 * target has none of those.
 */

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

#if !GEMM_AVX512_BF16 /* the other bfloat16 paths' */
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
