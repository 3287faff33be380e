/*
 * The decoder layer's element-wise ops on the CPU, fused (vLLM's fused_add_rms_norm,
 * rotary_embedding + reshape_and_cache, silu_and_mul): one pass over the data and one call
 * instead of five to ten torch dispatches each. Entry points and arguments: kernels.h.
 *
 * Every op computes in float32 and rounds to the storage dtype at exactly the points where
 * transformers' eager ops round (round_<dtype> below), so bfloat16 and float16 results equal
 * torch's bit for bit, except where a sum runs in another order (the RMSNorm mean of squares)
 * and silu's exp (Cephes, about 1 ulp, like torch's Sleef). fp-contract is off: a fused
 * multiply-add would round once where torch rounds twice.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* before kernels.h, whose inline helpers (exp_reduced) then round as the ops here do */
#pragma GCC optimize("fp-contract=off")
#ifdef __clang__
#pragma clang fp contract(off)
#endif

#include "kernels.h"

#define GRAIN 32768 /* elements per call below which one thread does it all (torch's grain) */
#define MAX_HEAD_DIM 1024

/* Loads of n <= VL elements into float32 lanes (the rest zero), stores of the first n lanes,
 * and the rounding to each storage dtype. Stores expect already-rounded values. */
static inline vf load_f32(const float *p, int64_t n) {
    vf x = {0};
    if (n == VL) memcpy(&x, p, sizeof x); else memcpy(&x, p, n * sizeof *p);
    return x;
}
static inline void store_f32(float *p, vf x, int64_t n) {
    if (n == VL) memcpy(p, &x, sizeof x); else memcpy(p, &x, n * sizeof *p);
}
static inline vf round_f32(vf x) { return x; }

static inline vf load_bf16(const uint16_t *p, int64_t n) {
    vu16 h = {0};
    if (n == VL) memcpy(&h, p, sizeof h); else memcpy(&h, p, n * sizeof *p);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}
static inline void store_bf16(uint16_t *p, vf x, int64_t n) {
    vu16 h = __builtin_convertvector((vu)x >> 16, vu16);
    if (n == VL) memcpy(p, &h, sizeof h); else memcpy(p, &h, n * sizeof *p);
}
/* Round to nearest even on the upper 16 bits, NaN to 0x7FC0: c10::BFloat16's conversion. */
static inline vf round_bf16(vf x) {
    const vu u = (vu)x;
    const vu r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
    return vselect(x != x, (vf)((vu){0} + 0x7FC00000u), (vf)r);
}

#ifndef PAGEDKV_NO_F16
static inline vf load_f16(const _Float16 *p, int64_t n) {
    vh h = {0};
    if (n == VL) memcpy(&h, p, sizeof h); else memcpy(&h, p, n * sizeof *p);
    return __builtin_convertvector(h, vf);
}
static inline void store_f16(_Float16 *p, vf x, int64_t n) {
    vh h = __builtin_convertvector(x, vh);
    if (n == VL) memcpy(p, &h, sizeof h); else memcpy(p, &h, n * sizeof *p);
}
static inline vf round_f16(vf x) { return __builtin_convertvector(__builtin_convertvector(x, vh), vf); }
#endif

static inline float hsum(vf x) {
    float s = 0.0f;
    for (int i = 0; i < VL; i++) s += x[i];
    return s;
}
static inline int64_t chunk(int64_t n, int64_t i) { return n - i < VL ? n - i : VL; }

/* exp(x), about 1 ulp; +inf above 88.72 (where float32 overflows), and inputs below -80 give
 * exp(-80) (only used as 1 + exp(x) in silu, where anything below 1e-34 rounds away). */
static inline vf vexp(vf x) {
    const vi huge = x > 88.72283935546875f;
    x = vselect(x < -80.0f, (vf){0} - 80.0f, vselect(huge, (vf){0}, x));
    vf n;
    const vf y = exp_reduced(x, &n);
    const vf scale = (vf)((__builtin_convertvector(n, vi) + 126) << 23); /* 2^(n-1): n may be 128 */
    return vselect(huge, (vf){0} + __builtin_inff(), y * scale * 2.0f);
}

/* 1 / sqrt(mean(x^2) + eps) of a float32 row, as torch's rsqrt (a true division). */
static inline float rms_scale(const float *x, int64_t n, float eps) {
    vf acc = {0};
    for (int64_t i = 0; i < n; i += VL) {
        const vf v = load_f32(x + i, chunk(n, i));
        acc += v * v;
    }
    return 1.0f / sqrtf(hsum(acc) / (float)n + eps);
}

/* out = round(round(x * scale) * w): transformers' RMSNorm (cast back, then the weight). */
#define NORM_ROW(T, S)                                                                          \
    static inline void norm_row_##S(const float *x, T *out, const T *w, int64_t n, float eps) { \
        const float scale = rms_scale(x, n, eps);                                               \
        for (int64_t i = 0; i < n; i += VL) {                                                   \
            const int64_t m = chunk(n, i);                                                      \
            store_##S(out + i, round_##S(round_##S(load_f32(x + i, m) * scale) * load_##S(w + i, m)), m); \
        }                                                                                       \
    }

#define LAYER_OPS(T, S)                                                                         \
    NORM_ROW(T, S)                                                                              \
    static inline void to_f32_##S(const T *x, float *out, int64_t n) {                          \
        for (int64_t i = 0; i < n; i += VL) store_f32(out + i, load_##S(x + i, chunk(n, i)), chunk(n, i)); \
    }                                                                                           \
    void rms_norm_##S(const T *x, T *out, const T *w, int64_t rows, int64_t n, float eps) {     \
        _Pragma("omp parallel for if (rows * n >= GRAIN)")                                       \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            float row[n];                                                                       \
            to_f32_##S(x + r * n, row, n);                                                      \
            norm_row_##S(row, out + r * n, w, n, eps);                                          \
        }                                                                                       \
    }                                                                                           \
    void add_rms_norm_##S(T *x, T *residual, const T *w, int64_t rows, int64_t n, float eps) {   \
        _Pragma("omp parallel for if (rows * n >= GRAIN)")                                       \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            T *xr = x + r * n, *res = residual + r * n;                                         \
            float row[n];                                                                       \
            for (int64_t i = 0; i < n; i += VL) {                                               \
                const int64_t m = chunk(n, i);                                                  \
                const vf sum = round_##S(load_##S(xr + i, m) + load_##S(res + i, m));           \
                store_##S(res + i, sum, m);                                                     \
                store_f32(row + i, sum, m);                                                     \
            }                                                                                   \
            norm_row_##S(row, xr, w, n, eps);                                                   \
        }                                                                                       \
    }                                                                                           \
    void silu_and_mul_rows_##S(const T *gate_up, T *out, int64_t rows, int64_t n,               \
                               int64_t out_stride) {                                            \
        for (int64_t r = 0; r < rows; r++) {                                                    \
            const T *gate = gate_up + r * 2 * n, *up = gate + n;                                \
            for (int64_t i = 0; i < n; i += VL) {                                               \
                const int64_t m = chunk(n, i);                                                  \
                const vf g = load_##S(gate + i, m);                                             \
                const vf silu = round_##S(g / (1.0f + vexp(-g)));                               \
                store_##S(out + r * out_stride + i, round_##S(silu * load_##S(up + i, m)), m);  \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    void silu_and_mul_##S(const T *gate_up, T *out, int64_t rows, int64_t n) {                  \
        _Pragma("omp parallel for if (rows * n >= GRAIN)")                                       \
        for (int64_t r = 0; r < rows; r++) silu_and_mul_rows_##S(gate_up + r * 2 * n, out + r * n, 1, n, n);\
    }                                                                                           \
    /* One head: optional RMSNorm, then out = x * cos + roll(x, d / 2) * sin, rounding after   \
     * each op as torch does. */                                                                \
    static inline void rotate_head_##S(const T *x, T *out, const T *cos, const T *sin,          \
                                       const T *w, float eps, int64_t d) {                      \
        float h[MAX_HEAD_DIM];                                                                  \
        to_f32_##S(x, h, d);                                                                    \
        if (w) {                                                                                \
            T normed[MAX_HEAD_DIM];                                                             \
            norm_row_##S(h, normed, w, d, eps);                                                 \
            to_f32_##S(normed, h, d);                                                           \
        }                                                                                       \
        const int64_t half = d / 2;                                                             \
        for (int64_t i = 0; i < half; i += VL) {                                                \
            const int64_t m = chunk(half, i);                                                   \
            const vf x1 = load_f32(h + i, m), x2 = load_f32(h + half + i, m);                   \
            const vf a = round_##S(x1 * load_##S(cos + i, m));                                  \
            const vf b = round_##S(x2 * load_##S(sin + i, m));                                  \
            const vf c = round_##S(x2 * load_##S(cos + half + i, m));                           \
            const vf e = round_##S(x1 * load_##S(sin + half + i, m));                           \
            store_##S(out + i, round_##S(a + b), m);                                            \
            store_##S(out + half + i, round_##S(c + e), m);                                     \
        }                                                                                       \
    }                                                                                           \
    void rotary_write_kv_##S(const T *qkv, T *q_out, const T *cos, const T *sin, const T *q_w,  \
                             const T *k_w, float eps, T *key_pool, T *value_pool,               \
                             const int64_t *slots, int64_t tokens, int64_t nq, int64_t nkv,     \
                             int64_t d) {                                                       \
        const int64_t width = (nq + 2 * nkv) * d;                                               \
        _Pragma("omp parallel for if (tokens * width >= GRAIN)")                                 \
        for (int64_t t = 0; t < tokens; t++) {                                                  \
            const T *row = qkv + t * width, *c = cos + t * d, *s = sin + t * d;                 \
            for (int64_t h = 0; h < nq; h++)                                                    \
                rotate_head_##S(row + h * d, q_out + (t * nq + h) * d, c, s, q_w, eps, d);      \
            const int64_t slot = slots[t];                                                      \
            if (slot < 0) continue;                                                             \
            for (int64_t h = 0; h < nkv; h++)                                                   \
                rotate_head_##S(row + (nq + h) * d, key_pool + (slot * nkv + h) * d, c, s, k_w, eps, d); \
            memcpy(value_pool + slot * nkv * d, row + (nq + nkv) * d, nkv * d * sizeof(T));     \
        }                                                                                       \
    }

int64_t layer_ops_max_head_dim(void) { return MAX_HEAD_DIM; }

LAYER_OPS(float, f32)
LAYER_OPS(uint16_t, bf16)
#ifndef PAGEDKV_NO_F16
LAYER_OPS(_Float16, f16)
#endif
