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
#include <stdlib.h>
#include <string.h>

/* before kernels.h, whose inline helpers (simd.h's exp_reduced) then round as the ops here do */
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

int64_t layer_ops_max_head_dim(void) { return MAX_HEAD_DIM; }

/* the ops for each storage dtype: layer_ops_body.h */
#define T float
#define SUFFIX(name) name##_f32
#define LOAD load_f32
#define STORE store_f32
#define ROUND round_f32
#define MOE
#include "layer_ops_body.h"

#define T uint16_t
#define SUFFIX(name) name##_bf16
#define LOAD load_bf16
#define STORE store_bf16
#define ROUND round_bf16
#define MOE
#include "layer_ops_body.h"

#ifndef PAGEDKV_NO_F16
#define T _Float16
#define SUFFIX(name) name##_f16
#define LOAD load_f16
#define STORE store_f16
#define ROUND round_f16
#include "layer_ops_body.h"
#endif
