/*
 * quant_dot.c's products for the K types (Q4_K, Q5_K, Q6_K) on Q8_K activation blocks (256
 * quants, a float scale d_a and the sum of each 16 quants, bsums), as llama.cpp's
 * ggml_vec_dot_q4_K_q8_K / ..._q6_K_q8_K compute them: integer sums per sub-block times the
 * sub-block's integer scale, summed exactly in 8 int32 lanes per super-block, then scaled once:
 *
 *   Q4_K, Q5_K  d_w d_a sum_s sc_s (u_s . q_s)  -  dmin_w d_a sum_s mn_s (bsums of sub-block s)
 *   Q6_K        d_w d_a (sum_s sc_s (u_s . q_s)  -  32 sum_s sc_s bsums_s)
 *
 * u the unsigned quants (quant_dot_simd.h's unpackers), sc / mn the 6-bit (Q4_K, Q5_K) or signed
 * 8-bit (Q6_K) sub-block scales. Each is the weights exactly as dequantized times the
 * activation rounded to 8 bits; every integer fits int32 (at most a few times 2^27).
 */

/* a Q4_K / Q5_K super-block's eight 6-bit scales and minimums (quant_gemm.c's k_scales, as
 * integers) */
static inline void k_scale_ints(const uint8_t *packed, int32_t scales[8], int32_t mins[8]) {
    for (int s = 0; s < 8; s++) {
        const int j = s % 4;
        scales[s] = s < 4 ? packed[j] & 63 : (packed[j + 8] & 15) | (packed[j] >> 6) << 4;
        mins[s] = s < 4 ? packed[j + 4] & 63 : (packed[j + 8] >> 4) | (packed[j + 4] >> 6) << 4;
    }
}

static inline void prefetch_block(const void *block, int64_t bytes) {
    for (int64_t p = 0; p < bytes; p += 64) __builtin_prefetch((const char *)block + p + Q8_PREFETCH_BYTES);
}

/* Q4_K (five = 0) or Q5_K (five = 1) rows n0 .. n0 + width against M activation rows */
static inline __attribute__((always_inline)) void k45_rows(const ActQ8_K *act, const void *w, int five, int64_t K,
                                                          int64_t M, int64_t n0, int64_t width, float *out,
                                                          int64_t ld) {
    const int64_t blocks = K / QK_K, bytes = five ? sizeof(BlockQ5_K) : sizeof(BlockQ4_K);
    for (int64_t j = 0; j < width; j++) {
        const char *row = (const char *)w + (n0 + j) * blocks * bytes;
        floats8 acc[Q8_GROUP];
        float offset[Q8_GROUP];
        for (int64_t m = 0; m < M; m++) {
            acc[m] = (floats8){0};
            offset[m] = 0.0f;
        }
        for (int64_t i = 0; i < blocks; i++) {
            const BlockQ4_K *b4 = (const BlockQ4_K *)(row + i * bytes);
            const BlockQ5_K *b5 = (const BlockQ5_K *)(row + i * bytes);
            prefetch_block(b4, bytes);
            const float d = half_to_float(b4->d), dmin = half_to_float(b4->dmin); /* the same fields in both */
            int32_t scales[8], mins[8];
            k_scale_ints(b4->scales, scales, mins);
            bytes32 u[8];
            for (int s = 0; s < 8; s++) u[s] = five ? unpack_k5(b5->qs, b5->qh, s) : unpack_k4(b4->qs, s);
            for (int64_t m = 0; m < M; m++) {
                const ActQ8_K *a = act + m * blocks + i;
                lanes8 sums = {0};
                int32_t minimums = 0;
                for (int s = 0; s < 8; s++) {
                    sums += dot_us((lanes8){0}, u[s], load32(a->qs + 32 * s)) * scales[s];
                    minimums += mins[s] * (a->bsums[2 * s] + a->bsums[2 * s + 1]);
                }
                acc[m] += (d * a->d) * __builtin_convertvector(sums, floats8);
                offset[m] -= (dmin * a->d) * (float)minimums;
            }
        }
        for (int64_t m = 0; m < M; m++) out[m * ld + j] = sum8(acc[m]) + offset[m];
    }
}

static inline __attribute__((always_inline)) void q6_k_rows(const ActQ8_K *act, const BlockQ6_K *w, int64_t K,
                                                           int64_t M, int64_t n0, int64_t width, float *out,
                                                           int64_t ld) {
    const int64_t blocks = K / QK_K;
    for (int64_t j = 0; j < width; j++) {
        const BlockQ6_K *row = w + (n0 + j) * blocks;
        floats8 acc[Q8_GROUP];
        for (int64_t m = 0; m < M; m++) acc[m] = (floats8){0};
        for (int64_t i = 0; i < blocks; i++) {
            const BlockQ6_K *b = row + i;
            prefetch_block(b, sizeof *b);
            const float d = half_to_float(b->d);
            bytes32 u[8];
            lanes8 scales[8]; /* chunk c's lanes 0..3 are sub-block 2c's sums, 4..7 sub-block 2c + 1's */
            for (int c = 0; c < 8; c++) {
                u[c] = unpack_k6(b, c);
                for (int l = 0; l < 8; l++) scales[c][l] = b->scales[2 * c + l / 4];
            }
            for (int64_t m = 0; m < M; m++) {
                const ActQ8_K *a = act + m * blocks + i;
                lanes8 sums = {0};
                int32_t offsets = 0;
                for (int c = 0; c < 8; c++) sums += dot_us((lanes8){0}, u[c], load32(a->qs + 32 * c)) * scales[c];
                for (int s = 0; s < 16; s++) offsets += b->scales[s] * a->bsums[s];
                sums[0] -= 32 * offsets;
                acc[m] += (d * a->d) * __builtin_convertvector(sums, floats8);
            }
        }
        for (int64_t m = 0; m < M; m++) out[m * ld + j] = sum8(acc[m]);
    }
}

static void q4_k_q8_columns(const void *act, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width,
                            float *out, int64_t ld) {
#define ROWS(rows) k45_rows(act, w, 0, K, rows, n0, width, out, ld)
    BY_ROWS(M, ROWS)
#undef ROWS
}

static void q5_k_q8_columns(const void *act, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width,
                            float *out, int64_t ld) {
#define ROWS(rows) k45_rows(act, w, 1, K, rows, n0, width, out, ld)
    BY_ROWS(M, ROWS)
#undef ROWS
}

static void q6_k_q8_columns(const void *act, const void *w, int64_t K, int64_t M, int64_t n0, int64_t width,
                            float *out, int64_t ld) {
#define ROWS(rows) q6_k_rows(act, w, K, rows, n0, width, out, ld)
    BY_ROWS(M, ROWS)
#undef ROWS
}
