/*
 * The decode product of GGUF-block weights in llama.cpp's arithmetic (opted into with the engine's
 * quantized_activations="q8"): each activation row is rounded once to 8-bit blocks, and the
 * products are integer dot products of the weights' quants with the activations' (vpdpbusd on
 * AVX512-VNNI or AVX-VNNI, vpmaddubsw on AVX2, plain C elsewhere: quant_dot_simd.h), scaled per
 * block. quant_gemm.c's product keeps float activations; this one trades the activations' low
 * bits for a loop that reads 32 quants in one instruction.
 *
 * Activation blocks (llama.cpp's, rounded as its reference quantizers round):
 *   Q8_0 for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 weights: 32 quants, d = max|x| / 127 held as a half,
 *        q = round-half-away(x / d) computed as x * (1 / d) -- gguf-py's Q8_0 bit for bit -- and
 *        t = d * sum q (exact), through which the weights' offsets and minimums enter (llama.cpp's
 *        Q8_1 keeps the same sum as a half; it is exact here)
 *   Q8_K for Q4_K, Q5_K, Q6_K weights: 256 quants, q = round-half-even(x * -127 / m), m the
 *        element of largest magnitude (the first), at most 127; d = 1 / (-127 / m), a float; the
 *        sums of each 16 quants (quantize_row_q8_K_ref's)
 *
 * Each row costs more here than in quant_gemm.c's product, which dequantizes a block once for
 * all its rows: this one wins for a few rows (a small decode step), and the caller decides
 * (models/quantized.py). Rows are taken Q8_GROUP at a time, each block unpacked once for the
 * group, and a row's result does not depend on the others. Threads split the output columns in
 * items of Q8_COLUMNS, as quant_gemm.c's. A caller that multiplies one input by several weights
 * (the parts of a packed projection, decode stack records in a row) passes a Q8Shared and the
 * input is rounded once for all of them.
 * Entry points and arguments: kernels.h.
 */
#include <math.h>
#include <stdlib.h>

#include "kernels.h"
#include "quant_dot_simd.h"

#define Q8_GROUP 4              /* rows multiplied together, each block's quants unpacked once for them */
#define Q8_COLUMNS 16           /* output columns per work item */
#define Q8_PREFETCH_BYTES 4096  /* how far ahead of its block the loop asks for weight bytes */

/* call(rows) with rows = M, a constant for each M from 1 to Q8_GROUP: the rows' accumulators stay
 * in registers (a loop over a variable M kept them in memory, and GCC vectorized it with gathers) */
#define BY_ROWS(M, call) \
    switch (M) {         \
    case 1: call(1); break; \
    case 2: call(2); break; \
    case 3: call(3); break; \
    default: call(4); break; \
    }

#include "quant_dot_act.h"
#include "quant_dot_k.h"

#define BLOCK BlockQ4_0
#define UNPACK(b) unpack_q4((b)->qs)
#define DOT dot_us
#define NEG neg8
#define SUFFIX(name) name##_q4_0
#include "quant_dot_small_body.h"

#define BLOCK BlockQ4_1
#define UNPACK(b) unpack_q4((b)->qs)
#define DOT dot_us
#define BIAS(b) quant_half_values[(b)->m]
#define SUFFIX(name) name##_q4_1
#include "quant_dot_small_body.h"

#define BLOCK BlockQ5_0
#define UNPACK(b) unpack_q5((b)->qs, (b)->qh)
#define DOT dot_us
#define NEG neg16
#define SUFFIX(name) name##_q5_0
#include "quant_dot_small_body.h"

#define BLOCK BlockQ5_1
#define UNPACK(b) unpack_q5((b)->qs, (b)->qh)
#define DOT dot_us
#define BIAS(b) quant_half_values[(b)->m]
#define SUFFIX(name) name##_q5_1
#include "quant_dot_small_body.h"

#define BLOCK BlockQ8_0
#define UNPACK(b) load32((b)->qs)
#define DOT dot_ss
#define SUFFIX(name) name##_q8_0
#include "quant_dot_small_body.h"

/* a weight type's activation blocks and product: out[m, j] = x[m] . W[n0 + j] for j < width */
typedef struct {
    int64_t elements, activation_bytes; /* elements per activation block, and its bytes */
    void (*quantize)(const float *x, void *out, int64_t blocks);
    void (*columns)(const void *act, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width, float *out,
                    int64_t ld);
} Q8Kind;

static void quantize_small(const float *x, void *out, int64_t blocks) { quantize_q8_0(x, out, blocks); }
static void quantize_k(const float *x, void *out, int64_t blocks) { quantize_q8_k(x, out, blocks); }

#define SMALL(suffix) {QK_SMALL, sizeof(ActQ8_0), quantize_small, q8_columns_##suffix}
#define K_TYPE(columns) {QK_K, sizeof(ActQ8_K), quantize_k, columns}
static const Q8Kind kind_q4_0 = SMALL(q4_0), kind_q4_1 = SMALL(q4_1), kind_q5_0 = SMALL(q5_0),
                    kind_q5_1 = SMALL(q5_1), kind_q8_0 = SMALL(q8_0), kind_q4_k = K_TYPE(q4_k_q8_columns),
                    kind_q5_k = K_TYPE(q5_k_q8_columns), kind_q6_k = K_TYPE(q6_k_q8_columns);

/* the weight type's entries, by its ggml code; NULL for a type not here or a K that is not a whole
 * number of activation blocks */
static const Q8Kind *const q8_kinds[QUANT_Q6_K + 1] = {
    [QUANT_Q4_0] = &kind_q4_0, [QUANT_Q4_1] = &kind_q4_1, [QUANT_Q5_0] = &kind_q5_0, [QUANT_Q5_1] = &kind_q5_1,
    [QUANT_Q8_0] = &kind_q8_0, [QUANT_Q4_K] = &kind_q4_k, [QUANT_Q5_K] = &kind_q5_k, [QUANT_Q6_K] = &kind_q6_k,
};
static const Q8Kind *q8_kind(int64_t type, int64_t K) {
    const Q8Kind *kind = type >= 0 && type <= QUANT_Q6_K ? q8_kinds[type] : NULL;
    return kind != NULL && K > 0 && K % kind->elements == 0 ? kind : NULL;
}

/* x [M, K] (float32, or bfloat16 widened) rounded into shared's blocks of kind's format, unless
 * they already hold this x in it; 0, or 1 without memory */
static int quantize_rows(const void *x, int bf16, const Q8Kind *kind, int64_t M, int64_t K, Q8Shared *shared) {
    if (shared->x == x && shared->elements == kind->elements && shared->rows == M && shared->K == K) return 0;
    const size_t bytes = (size_t)(M * (K / kind->elements) * kind->activation_bytes);
    if (bytes > shared->capacity) {
        free(shared->blocks);
        shared->blocks = malloc(bytes);
        shared->capacity = shared->blocks == NULL ? 0 : bytes;
        if (shared->blocks == NULL) return 1;
    }
    float *wide = NULL;
    if (bf16) {
        if ((wide = malloc(sizeof(float) * (size_t)K)) == NULL) return 1;
    }
    for (int64_t m = 0; m < M; m++) {
        const float *row = (const float *)x + m * K;
        if (bf16) {
            for (int64_t k = 0; k < K; k++) wide[k] = bf16_to_f32(((const uint16_t *)x)[m * K + k]);
            row = wide;
        }
        kind->quantize(row, (char *)shared->blocks + m * (K / kind->elements) * kind->activation_bytes,
                       K / kind->elements);
    }
    free(wide);
    shared->x = x, shared->elements = kind->elements, shared->rows = M, shared->K = K;
    return 0;
}

/* y [M, N] (row stride ldy) = the activations of shared . W^T, then + bias and stored by store */
static int q8_product(const void *x, int bf16, const void *w, const Q8Kind *kind, const void *bias, void *y,
                      int64_t M, int64_t K, int64_t N, int64_t ldy, Q8Shared *shared) {
    if (quantize_rows(x, bf16, kind, M, K, shared)) return 1;
    const int64_t items = (N + Q8_COLUMNS - 1) / Q8_COLUMNS, row_bytes = K / kind->elements * kind->activation_bytes;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < items; t++) {
        const int64_t n0 = t * Q8_COLUMNS, width = N - n0 < Q8_COLUMNS ? N - n0 : Q8_COLUMNS;
        float sums[Q8_GROUP * Q8_COLUMNS];
        for (int64_t m0 = 0; m0 < M; m0 += Q8_GROUP) { /* the item's columns stay in L1 for every group */
            const int64_t rows = M - m0 < Q8_GROUP ? M - m0 : Q8_GROUP;
            kind->columns((const char *)shared->blocks + m0 * row_bytes, w, K, rows, n0, width, sums, Q8_COLUMNS);
            for (int64_t r = 0; r < rows; r++)
                for (int64_t j = 0; j < width; j++) {
                    const int64_t m = m0 + r;
                    const float sum = sums[r * Q8_COLUMNS + j]; /* the bias after the sum, as quant_gemm.c adds it */
                    if (bf16) {
                        const float b = bias == NULL ? 0.0f : bf16_to_f32(((const uint16_t *)bias)[n0 + j]);
                        ((uint16_t *)y)[m * ldy + n0 + j] = f32_to_bf16(bias == NULL ? sum : sum + b);
                    } else {
                        ((float *)y)[m * ldy + n0 + j] = bias == NULL ? sum : sum + ((const float *)bias)[n0 + j];
                    }
                }
        }
    }
    return 0;
}

int quant_linear_q8_shared_f32(const float *x, const void *w, int64_t type, const float *bias, float *y, int64_t M,
                               int64_t K, int64_t N, int64_t ldy, Q8Shared *shared) {
    const Q8Kind *kind = q8_kind(type, K);
    if (kind == NULL) return 2;
    return M == 0 ? 0 : q8_product(x, 0, w, kind, bias, y, M, K, N, ldy, shared);
}

int quant_linear_q8_shared_bf16(const uint16_t *x, const void *w, int64_t type, const uint16_t *bias, uint16_t *y,
                                int64_t M, int64_t K, int64_t N, int64_t ldy, Q8Shared *shared) {
    const Q8Kind *kind = q8_kind(type, K);
    if (kind == NULL) return 2;
    return M == 0 ? 0 : q8_product(x, 1, w, kind, bias, y, M, K, N, ldy, shared);
}

int quant_linear_q8_f32(const float *x, const void *w, int64_t type, const float *bias, float *y, int64_t M,
                        int64_t K, int64_t N, int64_t ldy) {
    Q8Shared shared = {0};
    const int status = quant_linear_q8_shared_f32(x, w, type, bias, y, M, K, N, ldy, &shared);
    free(shared.blocks);
    return status;
}

int quant_linear_q8_bf16(const uint16_t *x, const void *w, int64_t type, const uint16_t *bias, uint16_t *y,
                         int64_t M, int64_t K, int64_t N, int64_t ldy) {
    Q8Shared shared = {0};
    const int status = quant_linear_q8_shared_bf16(x, w, type, bias, y, M, K, N, ldy, &shared);
    free(shared.blocks);
    return status;
}

int quant_activations_f32(const float *x, int64_t format, void *out, int64_t rows, int64_t K) {
    const int k_type = format == QUANT_Q8_K;
    if ((format != QUANT_Q8_0 && !k_type) || K <= 0 || K % (k_type ? QK_K : QK_SMALL)) return 2;
    const int64_t elements = k_type ? QK_K : QK_SMALL, blocks = rows * (K / elements);
    void *act = malloc((size_t)blocks * (k_type ? sizeof(ActQ8_K) : sizeof(ActQ8_0)));
    if (act == NULL) return 1;
    uint8_t *bytes = out;
    if (k_type) {
        quantize_q8_k(x, act, blocks);
        for (int64_t i = 0; i < blocks; i++, bytes += 292) { /* ggml's block_q8_K */
            const ActQ8_K *a = (const ActQ8_K *)act + i;
            memcpy(bytes, &a->d, 4);
            memcpy(bytes + 4, a->qs, QK_K);
            memcpy(bytes + 4 + QK_K, a->bsums, sizeof a->bsums);
        }
    } else {
        quantize_q8_0(x, act, blocks);
        for (int64_t i = 0; i < blocks; i++, bytes += sizeof(BlockQ8_0)) {
            const ActQ8_0 *a = (const ActQ8_0 *)act + i;
            const uint16_t d = float_to_half(a->d);
            memcpy(bytes, &d, 2);
            memcpy(bytes + 2, a->qs, QK_SMALL);
        }
    }
    free(act);
    return 0;
}

const char *quant_dot_isa(void) { return QUANT_DOT_ISA; }
