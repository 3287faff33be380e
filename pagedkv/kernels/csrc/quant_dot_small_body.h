/*
 * quant_dot.c's product for one type of 32-element blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on Q8_0
 * activation blocks, included once per type (the `#include`-template idiom). The includer
 * defines, and this file undefines at its end:
 *   BLOCK          the block struct (quant_types.h)
 *   UNPACK(b)      the block's 32 quants as bytes32 (quant_dot_simd.h)
 *   DOT            dot_us (unsigned quants) or dot_ss (Q8_0's signed ones)
 *   NEG            for a type whose weights are d (u - o): the ActQ8_0 field holding -o times
 *                  the activation block's quant sum (neg8, neg16), which starts the block's
 *                  integer lanes; else omitted
 *   BIAS(b)        for a type whose weights are d u + m: the block's minimum m; else omitted
 *   SUFFIX(name)   name with the type's suffix
 *
 * Block i of weight row n against activation block a of row m adds
 *   d_w d_a (sum_j u_j q_j - o sum_j q_j)  +  m_w t_a      (t_a = d_a sum_j q_j: ActQ8_0's)
 * which is sum_j (d_w (u_j - o) + m_w) (d_a q_j): the weights exactly as dequantized, times the
 * activation rounded to 8 bits. The integer sum is exact; the first term goes into 8 float lanes
 * per row, the second (types with a minimum) into a float per row.
 */

/* block i of a weight row into every row's accumulators acc[m] (and offset[m]) */
static inline __attribute__((always_inline)) void SUFFIX(q8_block)(const ActQ8_0 *act, const BLOCK *b, int64_t i,
                                                                   int64_t blocks, int64_t M, floats8 *acc,
                                                                   float *offset) {
    const bytes32 u = UNPACK(b);
    const float d = quant_half_values[b->d];
#ifdef BIAS
    const float bias = BIAS(b);
#endif
    for (int64_t m = 0; m < M; m++) {
        const ActQ8_0 *a = act + m * blocks + i;
#ifdef NEG
        const lanes8 start = {a->NEG};
#else
        const lanes8 start = {0};
#endif
        const lanes8 sums = DOT(start, u, load32(a->qs));
        acc[m] += (d * a->d) * __builtin_convertvector(sums, floats8);
#ifdef BIAS
        offset[m] += bias * a->t;
#else
        (void)offset;
#endif
    }
}

/* out[m, j] = x[m] . W[n0 + j]: even and odd blocks into two accumulators per row (two chains
 * of float adds in flight), added at the row's end */
static inline __attribute__((always_inline)) void SUFFIX(q8_rows)(const ActQ8_0 *act, const BLOCK *w, int64_t K,
                                                                  int64_t M, int64_t n0, int64_t width,
                                                                  float *out, int64_t ld) {
    const int64_t blocks = K / QK_SMALL;
    for (int64_t j = 0; j < width; j++) {
        const BLOCK *row = w + (n0 + j) * blocks;
        floats8 even[Q8_GROUP], odd[Q8_GROUP];
        float offset[Q8_GROUP];
        for (int64_t m = 0; m < M; m++) {
            even[m] = odd[m] = (floats8){0};
            offset[m] = 0.0f;
        }
        int64_t i = 0;
        for (; i + 1 < blocks; i += 2) { /* a pair is at least 36 bytes: one prefetch for both */
            __builtin_prefetch((const char *)(row + i) + Q8_PREFETCH_BYTES);
            SUFFIX(q8_block)(act, row + i, i, blocks, M, even, offset);
            SUFFIX(q8_block)(act, row + i + 1, i + 1, blocks, M, odd, offset);
        }
        if (i < blocks) SUFFIX(q8_block)(act, row + i, i, blocks, M, even, offset);
        for (int64_t m = 0; m < M; m++) out[m * ld + j] = sum8(even[m] + odd[m]) + offset[m];
    }
}

/* Q8Kind.columns for this type, M (up to Q8_GROUP) a constant after inlining */
static void SUFFIX(q8_columns)(const void *act, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width,
                               float *out, int64_t ld) {
#define ROWS(rows) SUFFIX(q8_rows)(act, w, K, rows, n0, width, out, ld)
    BY_ROWS(M, ROWS)
#undef ROWS
}

#undef BLOCK
#undef UNPACK
#undef DOT
#undef BIAS
#undef NEG
#undef SUFFIX
