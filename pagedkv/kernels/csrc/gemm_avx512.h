/*
 * The tiled GEMM's AVX-512 float32 loop: tiled_gemm.c includes this file where the target has
 * AVX512F (simd.h's GEMM_AVX512), after its NR, MR, KC and PF.
 */
#include <immintrin.h>

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
