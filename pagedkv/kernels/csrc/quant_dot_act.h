/*
 * quant_dot.c's activation blocks and the quantizers that make them, as ggml's reference code
 * rounds (see quant_dot.c's header for the two formats). Every build rounds alike: the AVX2
 * forms below make the same quants as the plain C after them (tested against gguf-py and ggml's
 * reference), only faster: a decode step rounds every projection input once.
 */

typedef struct {
    float d, t;          /* the block's scale (a half's value) and d times its quants' sum */
    int32_t neg8, neg16; /* -8 and -16 times its quants' sum: Q4_0's and Q5_0's offsets */
    int8_t qs[QK_SMALL];
} ActQ8_0;

typedef struct {
    float d;
    int16_t bsums[QK_K / 16];
    int8_t qs[QK_K];
} ActQ8_K;

/* float32 to a half's bits, rounded to nearest even (gguf-py's astype(float16)) */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return (uint16_t)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u); /* NaN */
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* at least 65520: infinity */
    if (a < 0x38800000u) { /* below 2^-14: a subnormal half, rounded at 2^-24 by adding 0.5 */
        float magnitude, sum;
        memcpy(&magnitude, &a, sizeof magnitude);
        sum = magnitude + 0.5f;
        uint32_t bits;
        memcpy(&bits, &sum, sizeof bits);
        return (uint16_t)(sign | (bits - 0x3F000000u));
    }
    return (uint16_t)(sign | ((a - (112u << 23) + 0xFFFu + ((a >> 13) & 1u)) >> 13));
#endif
}

/* a block's scale d = amax / 127 as its half's value, with its quants' sum */
static inline void finish_q8_0(ActQ8_0 *out, float d, int32_t sum) {
    out->d = half_to_float(float_to_half(d));
    out->t = out->d * (float)sum; /* exact: 11 significant bits times at most 12 */
    out->neg8 = -8 * sum;
    out->neg16 = -16 * sum;
}

#if defined(__AVX2__)
static inline __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }
static inline float max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
static inline int32_t sum8_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
/* v rounded half away from zero: to nearest even, then exact ties moved away (v is only
 * compared and rounded, so no multiply-add can fuse with the product that made it) */
static inline __m256i round_away8(__m256 v) {
    const __m256 t = _mm256_round_ps(v, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 away = _mm256_or_ps(_mm256_and_ps(v, _mm256_set1_ps(-0.0f)), _mm256_set1_ps(0.5f));
    const __m256 tie = _mm256_cmp_ps(v, _mm256_add_ps(t, away), _CMP_EQ_OQ);
    const __m256 even = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_cvtps_epi32(_mm256_blendv_ps(even, _mm256_add_ps(t, _mm256_add_ps(away, away)), tie));
}
/* four vectors of int32 lanes (elements 0..31 in order, each within int8) as 32 bytes at q: the
 * packs interleave 128-bit halves, leaving the 4-byte groups in the order 0 4 1 5 2 6 3 7 */
static inline void store_bytes32(__m256i a, __m256i b, __m256i c, __m256i d, int8_t *q) {
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif

/* gguf-py's Q8_0: d = amax / 127, q = round-half-away(x * (1 / d)), x * (1 / d) a float32 */
static void quantize_q8_0(const float *x, ActQ8_0 *out, int64_t blocks) {
    for (int64_t i = 0; i < blocks; i++, x += QK_SMALL) {
#if defined(__AVX2__)
        __m256 v[4];
        for (int k = 0; k < 4; k++) v[k] = _mm256_loadu_ps(x + 8 * k);
        const float amax =
            max8(_mm256_max_ps(_mm256_max_ps(abs8(v[0]), abs8(v[1])), _mm256_max_ps(abs8(v[2]), abs8(v[3]))));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256i q[4];
        for (int k = 0; k < 4; k++) q[k] = round_away8(_mm256_mul_ps(v[k], _mm256_set1_ps(id)));
        store_bytes32(q[0], q[1], q[2], q[3], out[i].qs);
        finish_q8_0(&out[i], d, sum8_i32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
#else
        float amax = 0.0f;
        for (int j = 0; j < QK_SMALL; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int32_t sum = 0;
        for (int j = 0; j < QK_SMALL; j++) {
            out[i].qs[j] = (int8_t)roundf(x[j] * id);
            sum += out[i].qs[j];
        }
        finish_q8_0(&out[i], d, sum);
#endif
    }
}

/* ggml's quantize_row_q8_K_ref: m the first element of the largest magnitude, q =
 * round-half-even(x * (-127 / m)) at most 127, d = 1 / (-127 / m); zeros for a block of zeros */
static void quantize_q8_k(const float *x, ActQ8_K *out, int64_t blocks) {
    for (int64_t i = 0; i < blocks; i++, x += QK_K) {
        float amax = 0.0f, max = 0.0f;
#if defined(__AVX2__)
        __m256 peak = _mm256_setzero_ps();
        for (int j = 0; j < QK_K; j += 8) peak = _mm256_max_ps(peak, abs8(_mm256_loadu_ps(x + j)));
        amax = max8(peak);
        for (int j = 0; j < QK_K; j += 8) { /* the first element of that magnitude */
            const __m256 magnitude = abs8(_mm256_loadu_ps(x + j));
            const int hits = _mm256_movemask_ps(_mm256_cmp_ps(magnitude, _mm256_set1_ps(amax), _CMP_EQ_OQ));
            if (hits) {
                max = x[j + __builtin_ctz((unsigned)hits)];
                break;
            }
        }
#else
        for (int j = 0; j < QK_K; j++)
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
#endif
        if (amax == 0.0f) {
            memset(&out[i], 0, sizeof out[i]);
            continue;
        }
        const float iscale = -127.0f / max;
#if defined(__AVX2__)
        for (int j = 0; j < QK_K; j += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), _mm256_set1_ps(iscale));
                const __m256 even = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_min_epi32(_mm256_cvtps_epi32(even), _mm256_set1_epi32(127));
            }
            store_bytes32(q[0], q[1], q[2], q[3], out[i].qs + j);
            out[i].bsums[j / 16] = (int16_t)sum8_i32(_mm256_add_epi32(q[0], q[1]));
            out[i].bsums[j / 16 + 1] = (int16_t)sum8_i32(_mm256_add_epi32(q[2], q[3]));
        }
#else
        for (int j = 0; j < QK_K; j++) {
            const int v = (int)rintf(iscale * x[j]);
            out[i].qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int s = 0; s < QK_K / 16; s++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += out[i].qs[16 * s + j];
            out[i].bsums[s] = (int16_t)sum;
        }
#endif
        out[i].d = 1.0f / iscale;
    }
}
