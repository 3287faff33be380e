/*
 * The bodies of layer_ops.c's ops for one storage dtype, included once per dtype (the
 * `#include`-template idiom: plain C, so a debugger steps through these lines and coverage
 * counts them). Entry points and arguments: kernels.h.
 *
 * The includer defines, and this file undefines at its end:
 *   T            the storage element type (float, uint16_t for bfloat16 bits, _Float16)
 *   SUFFIX(name) name with the dtype's suffix: rms_norm -> rms_norm_bf16
 *   LOAD(p, n)   n <= VL elements at p into float32 lanes (the rest zero)
 *   STORE(p, x, n)  the first n lanes of x, already rounded, to p
 *   ROUND(x)     each lane rounded to T and back, as torch rounds after each op
 */

/* residual = round(x + residual), kept as float32 in row too: the adding norms' first half */
static inline void SUFFIX(add_residual_row)(const T *x, T *residual, float *row, int64_t n) {
    for (int64_t i = 0; i < n; i += VL) {
        const int64_t m = chunk(n, i);
        const vf sum = ROUND(LOAD(x + i, m) + LOAD(residual + i, m));
        STORE(residual + i, sum, m);
        store_f32(row + i, sum, m);
    }
}

/* out = round(round(x * scale) * w): transformers' RMSNorm (cast back, then the weight). */
static inline void SUFFIX(norm_row)(const float *x, T *out, const T *w, int64_t n, float eps) {
    const float scale = rms_scale(x, n, eps);
    for (int64_t i = 0; i < n; i += VL) {
        const int64_t m = chunk(n, i);
        STORE(out + i, ROUND(ROUND(load_f32(x + i, m) * scale) * LOAD(w + i, m)), m);
    }
}

/* n elements of x as float32 */
static inline void SUFFIX(to_f32)(const T *x, float *out, int64_t n) {
    for (int64_t i = 0; i < n; i += VL) store_f32(out + i, LOAD(x + i, chunk(n, i)), chunk(n, i));
}

#include "layer_ops_gemma_body.h" /* Gemma's norms and GeGLU */

/* each row of x normed into out: Llama's norm, or Gemma's 1 + weight one when offset; with
 * add, x is first added to the residual and normed in place */
static inline void SUFFIX(norm_rows)(T *x, T *out, T *residual, const T *w, int64_t rows, int64_t n, float eps,
                                     int offset) {
#pragma omp parallel for if (rows * n >= GRAIN)
    for (int64_t r = 0; r < rows; r++) {
        float row[n];
        if (residual) SUFFIX(add_residual_row)(x + r * n, residual + r * n, row, n);
        else SUFFIX(to_f32)(x + r * n, row, n);
        if (offset) SUFFIX(offset_norm_row)(row, out + r * n, w, n, eps);
        else SUFFIX(norm_row)(row, out + r * n, w, n, eps);
    }
}

void SUFFIX(rms_norm)(const T *x, T *out, const T *w, int64_t rows, int64_t n, float eps) {
    SUFFIX(norm_rows)((T *)x, out, NULL, w, rows, n, eps, 0);
}

void SUFFIX(add_rms_norm)(T *x, T *residual, const T *w, int64_t rows, int64_t n, float eps) {
    SUFFIX(norm_rows)(x, x, residual, w, rows, n, eps, 0);
}

void SUFFIX(offset_rms_norm)(const T *x, T *out, const T *w, int64_t rows, int64_t n, float eps) {
    SUFFIX(norm_rows)((T *)x, out, NULL, w, rows, n, eps, 1);
}

void SUFFIX(add_offset_rms_norm)(T *x, T *residual, const T *w, int64_t rows, int64_t n, float eps) {
    SUFFIX(norm_rows)(x, x, residual, w, rows, n, eps, 1);
}

void SUFFIX(silu_and_mul_rows)(const T *gate_up, T *out, int64_t rows, int64_t n, int64_t out_stride) {
    for (int64_t r = 0; r < rows; r++) {
        const T *gate = gate_up + r * 2 * n, *up = gate + n;
        for (int64_t i = 0; i < n; i += VL) {
            const int64_t m = chunk(n, i);
            const vf g = LOAD(gate + i, m);
            const vf silu = ROUND(g / (1.0f + vexp(-g)));
            STORE(out + r * out_stride + i, ROUND(silu * LOAD(up + i, m)), m);
        }
    }
}

void SUFFIX(silu_and_mul)(const T *gate_up, T *out, int64_t rows, int64_t n) {
#pragma omp parallel for if (rows * n >= GRAIN)
    for (int64_t r = 0; r < rows; r++) SUFFIX(silu_and_mul_rows)(gate_up + r * 2 * n, out + r * n, 1, n, n);
}

/* One head: optional RMSNorm (Gemma's 1 + weight one when offset), then out = x * cos +
 * roll(x, d / 2) * sin, rounding after each op as torch does. */
static inline void SUFFIX(rotate_head)(const T *x, T *out, const T *cos, const T *sin, const T *w, float eps,
                                       int64_t d, int64_t offset) {
    float h[MAX_HEAD_DIM];
    SUFFIX(to_f32)(x, h, d);
    if (w) {
        T normed[MAX_HEAD_DIM];
        if (offset) SUFFIX(offset_norm_row)(h, normed, w, d, eps);
        else SUFFIX(norm_row)(h, normed, w, d, eps);
        SUFFIX(to_f32)(normed, h, d);
    }
    const int64_t half = d / 2;
    for (int64_t i = 0; i < half; i += VL) {
        const int64_t m = chunk(half, i);
        const vf x1 = load_f32(h + i, m), x2 = load_f32(h + half + i, m);
        const vf a = ROUND(x1 * LOAD(cos + i, m));
        const vf b = ROUND(x2 * LOAD(sin + i, m));
        const vf c = ROUND(x2 * LOAD(cos + half + i, m));
        const vf e = ROUND(x1 * LOAD(sin + half + i, m));
        STORE(out + i, ROUND(a + b), m);
        STORE(out + half + i, ROUND(c + e), m);
    }
}

void SUFFIX(rotary_write_kv)(const T *qkv, T *q_out, const T *cos, const T *sin, const T *q_w, const T *k_w,
                             float eps, T *key_pool, T *value_pool, const int64_t *slots, int64_t tokens, int64_t nq,
                             int64_t nkv, int64_t d, int64_t offset) {
    const int64_t width = (nq + 2 * nkv) * d;
#pragma omp parallel for if (tokens * width >= GRAIN)
    for (int64_t t = 0; t < tokens; t++) {
        const T *row = qkv + t * width, *c = cos + t * d, *s = sin + t * d;
        for (int64_t h = 0; h < nq; h++)
            SUFFIX(rotate_head)(row + h * d, q_out + (t * nq + h) * d, c, s, q_w, eps, d, offset);
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int64_t h = 0; h < nkv; h++)
            SUFFIX(rotate_head)(row + (nq + h) * d, key_pool + (slot * nkv + h) * d, c, s, k_w, eps, d, offset);
        memcpy(value_pool + slot * nkv * d, row + (nq + nkv) * d, nkv * d * sizeof(T));
    }
}

#ifdef MOE
#include "layer_ops_moe_body.h" /* the routed experts (dtypes with a tiled GEMM) */
#undef MOE
#endif

#undef T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef ROUND
