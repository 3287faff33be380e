/*
 * paged_attention.c's row kernel for one query dtype and one pool dtype, included once per pair
 * (the `#include`-template idiom: plain C, so a debugger steps through these lines and coverage
 * counts them). Entry points and arguments: kernels.h; how it works: paged_attention.c.
 *
 * The includer defines, and this file undefines at its end:
 *   SUFFIX(name)  name with the entry's suffix: paged_attention_rows -> paged_attention_rows_bf16_fp8
 *   QT, QS        the query and output element type and its load/store suffix (f32, bf16, f16)
 *   KT, KS        the pools' element type and its load suffix (f32, bf16, f16, fp8, i8)
 *   SCALED        1 when the pools are quantized (their scales are read), else 0 (scales are NULL)
 * An unquantized pair also gets the prefill entry: paged_attention_prefill_body.h.
 */

#define PA_PASTE_(a, b) a##b
#define PA_PASTE(a, b) PA_PASTE_(a, b)
#define Q_LOAD PA_PASTE(load_, QS)    /* one query element as float32 */
#define Q_STORE PA_PASTE(store_, QS)  /* one float32 to an output element */
#define KV_LOAD PA_PASTE(load_, KS)   /* one pool element as float32 */
#define KV_VLOAD PA_PASTE(vload_, KS) /* VL pool elements as float32 lanes */

static inline int64_t SUFFIX(slot)(const Shape *s, const int32_t *table, int64_t t) {
    if (s->block_shift >= 0)
        return ((int64_t)table[t >> s->block_shift] << s->block_shift) | (t & (s->block_size - 1));
    return (int64_t)table[t / s->block_size] * s->block_size + t % s->block_size;
}

#ifdef PAIRS
#include "paged_attention_pairs_body.h"
#endif

/* Pass 1's inner step: the scores of TOKENS keys k[u] (KV head h) for gn query heads whose
 * float32 queries start at q (D apart), into rows[g * ld + u] for positions i0 + u < n. Each key
 * vector is loaded (and converted) once for all gn heads. Called with a constant gn where it
 * can be (gn <= GROUPS). */
static inline __attribute__((always_inline)) void SUFFIX(keys)(
    const KT *const k[TOKENS], const float *const ks[TOKENS], const float *q, float *rows,
    int64_t h, int64_t i0, int64_t n, int64_t ld, int64_t D, int64_t vec_d, int64_t gn) {
    vf acc_g[GROUPS][TOKENS]; /* only the gn heads' (a constant here): zeroing all would be a memset */
    for (int g = 0; g < GROUPS; g++)
        if (g < gn)
            for (int u = 0; u < TOKENS; u++) acc_g[g][u] = (vf){0};
    for (int64_t d = 0; d < vec_d; d += VL) {
        vf kv[TOKENS];
        for (int u = 0; u < TOKENS; u++) kv[u] = KV_VLOAD(k[u] + h * D + d);
        for (int g = 0; g < GROUPS; g++)
            if (g < gn) {
                const vf qv = vload_f32(q + g * D + d);
                for (int u = 0; u < TOKENS; u++) acc_g[g][u] += qv * kv[u];
            }
    }
    for (int g = 0; g < gn; g++) {
        float dots[TOKENS];
        hsum4(acc_g[g][0], acc_g[g][1], acc_g[g][2], acc_g[g][3], dots);
        if (vec_d == D && !SCALED) { /* rows has room past n (ld): the padding is reset later */
            memcpy(rows + g * ld, dots, sizeof dots);
            continue;
        }
        for (int u = 0; u < TOKENS && i0 + u < n; u++) {
            for (int64_t d = vec_d; d < D; d++) dots[u] += q[g * D + d] * KV_LOAD(k[u] + h * D + d);
            rows[g * ld + u] = SCALED ? dots[u] * ks[u][h] : dots[u];
        }
    }
}

/* Pass 2's inner run over one segment: len positions (scores columns i0...) in consecutive slots
 * from slot0, so the walk follows a pointer, no block table. out[g * D + e * VL ...] (+)=
 * sum_i p[head0 + g, i0 + i] * v[slot0 + i][dim0 + e * VL] for g < gj query heads and e < nd
 * vectors, the sums in registers over the segment (first: from zero, else from out, which the
 * previous segment left: the same adds in the same order as one run). Each position pulls its
 * share of the next segment's lines (*owed / *pulled, `lines` over `total` positions of all walks).
 * Called with constant gj and nd where it can be, so the loop over positions has no tests in it. */
static inline __attribute__((always_inline)) void SUFFIX(values)(
    const Shape *s, const KT *value, const float *value_scale, int64_t slot0, int64_t i0, int64_t len,
    const float *scores, int64_t ld, int64_t h, int64_t head0, int64_t dim0, float *out, int64_t D,
    int64_t gj, int64_t nd, int first, const char *next, int64_t lines, int64_t total, int64_t *owed_at,
    int64_t *pulled_at) {
    const int64_t HD = s->kv_heads * D;
    vf av[VGROUP][VDIMS] = {{{0}}};
    if (!first)
        for (int g = 0; g < VGROUP; g++)
            for (int e = 0; e < VDIMS; e++)
                if (g < gj && e < nd) av[g][e] = vload_f32(out + g * D + e * VL);
    int64_t owed = *owed_at, pulled = *pulled_at;
    const KT *vp = value + slot0 * HD + dim0;
    for (int64_t i = 0; i < len; i++, vp += HD) {
        if (next != NULL)
            for (owed += lines; owed >= total; owed -= total) PREFETCH_L2(next + 64 * pulled++);
        vf vv[VDIMS];
        for (int e = 0; e < VDIMS; e++)
            if (e < nd) vv[e] = SCALED ? KV_VLOAD(vp + e * VL) * value_scale[(slot0 + i) * s->kv_heads + h]
                                       : KV_VLOAD(vp + e * VL);
        for (int g = 0; g < VGROUP; g++)
            if (g < gj) {
                const float p = scores[(head0 + g) * ld + i0 + i];
                for (int e = 0; e < VDIMS; e++)
                    if (e < nd) av[g][e] += p * vv[e];
            }
    }
    *owed_at = owed, *pulled_at = pulled;
    for (int g = 0; g < gj; g++)
        for (int e = 0; e < nd; e++) vstore(out + g * D + e * VL, av[g][e]);
}

/* One piece: positions [t0, t1] of one row; writes its partial max/sum/acc for every head.
 * scores is head-major, [H][chunk rounded up to VL]: the softmax runs along tokens, VL at once. */
static void SUFFIX(attend_piece)(const Shape *s, const float *qf, const KT *key, const KT *value,
                                const float *key_scale, const float *value_scale,
                                const int32_t *table, int64_t t0, int64_t t1, float *scores,
                                int64_t ld, float *maxs, float *sums, float *acc) {
    const int64_t H = s->num_heads, D = s->head_dim, n = t1 - t0 + 1, HD = s->kv_heads * D;
    const int64_t group = H / s->kv_heads, vec_d = D - D % VL, padded = (n + VL - 1) / VL * VL;
    /* pass 1: scores[j * ld + i] for position t0 + i, TOKENS positions at a time; each key
     * vector is loaded (and converted) once for up to GROUPS query heads of its KV head (heads
     * past the group repeat its last one; their sums are dropped) */
#ifdef PAIRS
    if (D % PAIR_DIMS == 0)
        SUFFIX(pair_scores)(s, qf, key, table, t0, n, scores, ld);
    else
#endif
    for (int64_t i0 = 0; i0 < n; i0 += TOKENS) {
        const KT *k[TOKENS];
        const float *ks[TOKENS];
        for (int u = 0; u < TOKENS; u++) {
            const int64_t slot = SUFFIX(slot)(s, table, t0 + (i0 + u < n ? i0 + u : n - 1));
            k[u] = key + slot * HD;
            ks[u] = SCALED ? key_scale + slot * s->kv_heads : NULL;
        }
        /* the keys PREFETCH positions ahead, each KV head's turn pulling its share: issued at once,
         * the 64 lines would stall the loop on a full miss queue */
        const char *next = NULL;
        int64_t ahead = 0;
        if (i0 + PREFETCH < n) {
            next = (const char *)(key + SUFFIX(slot)(s, table, t0 + i0 + PREFETCH) * HD);
            ahead = (int64_t)sizeof(KT) * HD * (n - i0 - PREFETCH < TOKENS ? n - i0 - PREFETCH : TOKENS);
        }
        for (int64_t h = 0; h < s->kv_heads; h++) {
            for (int64_t b = h * ahead / s->kv_heads / 64 * 64; b < (h + 1) * ahead / s->kv_heads; b += 64)
                PREFETCH_L2(next + b);
            for (int64_t g0 = 0; g0 < group; g0 += GROUPS) {
                /* a constant head count compiles to a loop with no tests in it */
                const int64_t gn = group - g0 < GROUPS ? group - g0 : GROUPS;
                const float *q0 = qf + (h * group + g0) * D;
                float *row = scores + (h * group + g0) * ld + i0;
                if (gn == 2)
                    SUFFIX(keys)(k, ks, q0, row, h, i0, n, ld, D, vec_d, 2);
                else if (gn == 3 && GROUPS >= 3) /* 3 query heads per KV head: SmolLM2, Llama 3.2 3B */
                    SUFFIX(keys)(k, ks, q0, row, h, i0, n, ld, D, vec_d, 3);
                else if (gn == GROUPS)
                    SUFFIX(keys)(k, ks, q0, row, h, i0, n, ld, D, vec_d, GROUPS);
                else if (gn == 1)
                    SUFFIX(keys)(k, ks, q0, row, h, i0, n, ld, D, vec_d, 1);
                else
                    SUFFIX(keys)(k, ks, q0, row, h, i0, n, ld, D, vec_d, gn);
            }
        }
    }
    /* per head: scale, soft-cap, max and softmax numerators, VL positions at a time (padding
     * positions hold -inf, whose exponential is 0) */
    for (int64_t j = 0; j < H; j++) {
        float *row = scores + j * ld;
        for (int64_t i = 0; i < n; i++) row[i] *= s->scale;
        if (s->soft_cap > 0.0f)
            for (int64_t i = 0; i < n; i++) row[i] = s->soft_cap * tanhf(row[i] / s->soft_cap);
        for (int64_t i = n; i < padded; i++) row[i] = -INFINITY;
        vf mv = vload_f32(row);
        for (int64_t i = VL; i < padded; i += VL) {
            mv = vmax(mv, vload_f32(row + i));
        }
        float m = mv[0];
        for (int l = 1; l < VL; l++) m = mv[l] > m ? mv[l] : m;
        vf sv = {0};
        for (int64_t i = 0; i < padded; i += VL) {
            const vf p = vexp(vload_f32(row + i) - m);
            vstore(row + i, p);
            sv += p;
        }
        float sum = 0.0f;
        for (int l = 0; l < VL; l++) sum += sv[l];
        maxs[j] = m;
        sums[j] = sum;
    }
    /* pass 2: acc[j] = sum_i p[j, i] * v[t0 + i], one segment (the piece's part of one KV block)
     * at a time, within it one KV head, up to VGROUP of its query heads and VDIMS vectors of the
     * head dimension at a time, the partial sums in registers over the segment; each value vector
     * is loaded (converted and scaled) once per VGROUP query heads. The walks of a segment pull
     * the next segment's values into L2 between them: walked across all positions instead, each
     * walk would read a 128-byte slice of every position's values (1 KiB apart in float32). */
    const int64_t walks = s->kv_heads * ((group + VGROUP - 1) / VGROUP) * ((vec_d + VL * VDIMS - 1) / (VL * VDIMS));
    for (int64_t i0 = 0; i0 < n;) {
        const int64_t into = (t0 + i0) % s->block_size, slot0 = SUFFIX(slot)(s, table, t0 + i0);
        const int64_t len = n - i0 < s->block_size - into ? n - i0 : s->block_size - into, i1 = i0 + len;
        const char *next = NULL;
        int64_t lines = 0, owed = 0, pulled = 0, total = walks * len;
        if (i1 < n) {
            next = (const char *)(value + SUFFIX(slot)(s, table, t0 + i1) * HD);
            lines = ((n - i1 < s->block_size ? n - i1 : s->block_size) * HD * (int64_t)sizeof(KT) + 63) / 64;
        }
        for (int64_t h = 0; h < s->kv_heads; h++)
            for (int64_t j0 = h * group; j0 < (h + 1) * group; j0 += VGROUP) {
                const int64_t gj = (h + 1) * group - j0 < VGROUP ? (h + 1) * group - j0 : VGROUP;
                for (int64_t d0 = 0; d0 < vec_d; d0 += VL * VDIMS) {
                    const int64_t nd = (vec_d - d0) / VL < VDIMS ? (vec_d - d0) / VL : VDIMS;
                    float *o = acc + j0 * D + d0;
                    const int64_t dim0 = h * D + d0;
                    /* whole groups of VDIMS vectors with a fixed head count compile to a loop
                     * with no tests in it (D = 64, 128: every group; D = 32: one group of 2
                     * vectors); the general case tests per position */
                    if (nd == VDIMS && gj == 2)
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 2,
                                       VDIMS, i0 == 0, next, lines, total, &owed, &pulled);
                    else if (nd == VDIMS && gj == 1)
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 1,
                                       VDIMS, i0 == 0, next, lines, total, &owed, &pulled);
                    else if (nd == VDIMS && gj == 4)
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 4,
                                       VDIMS, i0 == 0, next, lines, total, &owed, &pulled);
                    else if (nd == VDIMS && gj == 3)
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 3,
                                       VDIMS, i0 == 0, next, lines, total, &owed, &pulled);
                    else if (nd == 2 && gj == 2) /* D = 32 (small models) */
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 2,
                                       2, i0 == 0, next, lines, total, &owed, &pulled);
                    else if (nd == 2 && gj == 1)
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 1,
                                       2, i0 == 0, next, lines, total, &owed, &pulled);
                    else if (nd == 2 && gj == 4)
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, 4,
                                       2, i0 == 0, next, lines, total, &owed, &pulled);
                    else
                        SUFFIX(values)(s, value, value_scale, slot0, i0, len, scores, ld, h, j0, dim0, o, D, gj,
                                       nd, i0 == 0, next, lines, total, &owed, &pulled);
                }
            }
        i0 = i1;
    }
    for (int64_t h = 0; h < s->kv_heads; h++) /* the head dimension's tail past its whole vectors */
        for (int64_t d = vec_d; d < D; d++)
            for (int64_t j = h * group; j < (h + 1) * group; j++) {
                float sum = 0.0f;
                for (int64_t i = 0; i < n; i++) {
                    const int64_t slot = SUFFIX(slot)(s, table, t0 + i);
                    const float x = KV_LOAD(value + slot * HD + h * D + d);
                    sum += scores[j * ld + i] * (SCALED ? x * value_scale[slot * s->kv_heads + h] : x);
                }
                acc[j * D + d] = sum;
            }
}

/* A key or value vector of one KV head as float32 (scaled by `scale`): in place for a float32
 * pool, else converted into `stage`. */
static inline const float *SUFFIX(lane_row)(const KT *src, float *stage, int64_t D, float scale) {
    if (sizeof(KT) == sizeof(float) && !SCALED) return (const float *)(const void *)src;
    for (int64_t d = 0; d < D; d++) stage[d] = KV_LOAD(src + d) * scale;
    return stage;
}

/* One piece of a run of m rows of one sequence at consecutive positions (m * group <= VL), for KV
 * head h: lane r * group + g is row r's query head h * group + g (lanes past m * group repeat the
 * last row), row r covering positions [t0, t1[r]]. Every key or value element is loaded (and
 * converted) once for all lanes and broadcast against them, so a position's scores come out
 * lane-wise, ready for a lane-wise softmax with no horizontal sums: the k + 1 rows of a
 * speculative verification cost about what one row does. Writes each row's partial max, sum and
 * weighted values for its query heads of h at outs[r], in the row kernel's layout. */
static void SUFFIX(attend_lanes)(const Shape *s, const float *qf, const KT *key, const KT *value,
                                const float *key_scale, const float *value_scale, const int32_t *table,
                                int64_t h, int64_t t0, const int64_t *t1, int64_t m, float *qt, float *sc,
                                float *ot, float *stage, float *const *outs) {
    const int64_t H = s->num_heads, D = s->head_dim, HD = s->kv_heads * D, group = H / s->kv_heads;
    const int64_t n = t1[m - 1] - t0 + 1;
    vi lane_end; /* each lane's last position, from t0 */
    for (int64_t lane = 0; lane < VL; lane++) {
        const int64_t r = lane / group < m ? lane / group : m - 1;
        lane_end[lane] = (int32_t)(t1[r] - t0);
        const float *qp = qf + r * H * D + (h * group + lane % group) * D;
        for (int64_t d = 0; d < D; d++) qt[d * VL + lane] = qp[d];
    }
    vf mv = (vf){0} - INFINITY;
    for (int64_t i0 = 0; i0 < n; i0 += TILE_KEYS) {
        const int64_t cnt = n - i0 < TILE_KEYS ? n - i0 : TILE_KEYS;
        const float *k[TILE_KEYS];
        float kscale[TILE_KEYS];
        for (int u = 0; u < TILE_KEYS; u++) {
            const int64_t slot = SUFFIX(slot)(s, table, t0 + i0 + (u < cnt ? u : cnt - 1));
            k[u] = SUFFIX(lane_row)(key + slot * HD + h * D, stage + u * D, D, 1.0f);
            kscale[u] = SCALED ? key_scale[slot * s->kv_heads + h] : 1.0f;
        }
        vf acc[TILE_KEYS];
        lane_scores(qt, k, D, acc);
        for (int u = 0; u < cnt; u++) {
            vf score = (SCALED ? acc[u] * kscale[u] : acc[u]) * s->scale;
            if (s->soft_cap > 0.0f)
                for (int l = 0; l < VL; l++) score[l] = s->soft_cap * tanhf(score[l] / s->soft_cap);
            score = vselect(lane_end >= (vi){0} + (int32_t)(i0 + u), score, (vf){0} - INFINITY);
            vstore(sc + (i0 + u) * VL, score);
            mv = vmax(mv, score);
        }
    }
    const vf lv = lane_softmax(sc, n, mv);
    for (int64_t d = 0; d < D * VL; d++) ot[d] = 0.0f;
    for (int64_t i0 = 0; i0 < n; i0 += TILE_VALUES) {
        const int64_t cnt = n - i0 < TILE_VALUES ? n - i0 : TILE_VALUES;
        const float *v[TILE_VALUES];
        for (int64_t u = 0; u < cnt; u++) {
            const int64_t slot = SUFFIX(slot)(s, table, t0 + i0 + u);
            const float vscale = SCALED ? value_scale[slot * s->kv_heads + h] : 1.0f;
            v[u] = SUFFIX(lane_row)(value + slot * HD + h * D, stage + u * D, D, vscale);
        }
        lane_values(ot, sc + i0 * VL, v, cnt, D);
    }
    for (int64_t lane = 0; lane < m * group; lane++) {
        float *o = outs[lane / group];
        const int64_t j = h * group + lane % group;
        o[j] = mv[lane];
        o[H + j] = lv[lane];
        for (int64_t d = 0; d < D; d++) o[2 * H + j * D + d] = ot[d * VL + lane];
    }
}

int SUFFIX(paged_attention_rows)(
    const QT *q, const KT *key, const KT *value, const float *key_scale, const float *value_scale,
    const int32_t *block_tables,
    const int32_t *row_seq, const int32_t *row_pos, QT *out, int64_t num_rows, int64_t num_heads,
    int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
    int64_t window, float soft_cap, int64_t chunk, int num_threads) {
    const Shape s = {num_heads, kv_heads, head_dim, block_size, scale, soft_cap,
                     block_shift_of(block_size)};
    const int64_t H = num_heads, D = head_dim, stride = H * (D + 2), group = H / kv_heads;
    /* runs: 2 to MAX_RUN rows of one sequence at consecutive positions, and no other row of it
     * next to them (speculative decoding's k + 1 rows), are computed together, lanes across their
     * query heads, when the head shape allows it; any other row alone. Every row's pieces start
     * at the same positions either way (a window's rows never run together). */
    const int laned = window <= 0 && VL % group == 0 && D % TILE_DIMS == 0;
    int64_t *piece_start = malloc(sizeof(int64_t) * (num_rows + 1));
    int64_t *run_start = malloc(sizeof(int64_t) * (num_rows + 1));
    if (!piece_start || !run_start) {
        free(piece_start), free(run_start);
        return 1;
    }
    piece_start[0] = 0;
    int64_t num_runs = 0;
    for (int64_t r = 0, end; r < num_rows; r = end) {
        for (end = r + 1; end < num_rows && row_seq[end] == row_seq[r] && row_pos[end] == row_pos[end - 1] + 1;)
            end++;
        const int together = laned && end - r >= 2 && end - r <= MAX_RUN;
        for (int64_t i = r; i < end; i++) {
            const int64_t last = row_pos[i];
            const int64_t first = (window > 0 && last + 1 > window) ? last + 1 - window : 0;
            piece_start[i + 1] = piece_start[i] + (last - first + chunk) / chunk;
            if (i == r || !together) run_start[num_runs++] = i;
        }
    }
    run_start[num_runs] = num_rows;
    /* work items: (run, piece), a run having its last row's pieces, the most of its rows' */
    int64_t num_items = 0;
    for (int64_t u = 0; u < num_runs; u++)
        num_items += piece_start[run_start[u + 1]] - piece_start[run_start[u + 1] - 1];
    float *part = malloc(sizeof(float) * piece_start[num_rows] * stride);
    int64_t *item_run = malloc(sizeof(int64_t) * (num_items + 1));
    int64_t *item_piece = malloc(sizeof(int64_t) * (num_items + 1));
    int failed = part == NULL || item_run == NULL || item_piece == NULL;
    for (int64_t u = 0, i = 0; u < num_runs && !failed; u++) {
        const int64_t last = run_start[u + 1] - 1;
        for (int64_t p = 0; p < piece_start[last + 1] - piece_start[last]; p++, i++)
            item_run[i] = u, item_piece[i] = p;
    }
#pragma omp parallel num_threads(num_threads) if(!failed)
    {
        const int64_t ld = (chunk + VL - 1) / VL * VL + VL; /* +VL: rows off the 4 KiB stride */
        float *qf = malloc(sizeof(float) * MAX_RUN * H * D);
        float *scores = malloc(sizeof(float) * ld * (H > VL ? H : VL));
        float *lanes = malloc(sizeof(float) * (2 * D * VL + D * TILE_VALUES));
        if (!qf || !scores || !lanes) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; i++) {
            if (failed) continue;
            const int64_t u = item_run[i], p = item_piece[i], r1 = run_start[u + 1];
            const int64_t last = row_pos[r1 - 1];
            const int64_t first = (window > 0 && last + 1 > window) ? last + 1 - window : 0;
            const int64_t t0 = first + p * chunk;
            /* the run's rows that reach this piece: a suffix, as rows are in ascending positions */
            int64_t r0 = run_start[u];
            while (piece_start[r0 + 1] - piece_start[r0] <= p) r0++;
            int64_t t1[MAX_RUN];
            float *outs[MAX_RUN];
            for (int64_t r = r0; r < r1; r++) {
                t1[r - r0] = t0 + chunk - 1 < row_pos[r] ? t0 + chunk - 1 : row_pos[r];
                outs[r - r0] = part + (piece_start[r] + p) * stride;
                for (int64_t e = 0; e < H * D; e++) qf[(r - r0) * H * D + e] = Q_LOAD(q + r * H * D + e);
            }
            const int32_t *table = block_tables + (int64_t)row_seq[r1 - 1] * max_blocks;
            if (r1 - run_start[u] == 1) {
                float *pm = outs[0];
                SUFFIX(attend_piece)(&s, qf, key, value, key_scale, value_scale, table, t0, t1[0], scores,
                                    ld, pm, pm + H, pm + 2 * H);
                continue;
            }
            const int64_t per_tile = VL / group; /* rows whose query heads fill the lanes */
            for (int64_t r = r0; r < r1; r += per_tile) {
                const int64_t m = r1 - r < per_tile ? r1 - r : per_tile;
                for (int64_t h = 0; h < kv_heads; h++)
                    SUFFIX(attend_lanes)(&s, qf + (r - r0) * H * D, key, value, key_scale, value_scale, table, h,
                                        t0, t1 + (r - r0), m, lanes, scores, lanes + D * VL,
                                        lanes + 2 * D * VL, outs + (r - r0));
            }
        }
        /* merge a row's pieces, each rescaled by exp(its max - the row's max) */
#pragma omp for schedule(static)
        for (int64_t r = 0; r < num_rows; r++) {
            if (failed) continue;
            for (int64_t j = 0; j < H; j++) {
                float m = -INFINITY, l = 0.0f;
                for (int64_t p = piece_start[r]; p < piece_start[r + 1]; p++)
                    m = part[p * stride + j] > m ? part[p * stride + j] : m;
                float *o = qf; /* reused as one head's float32 accumulator */
                memset(o, 0, sizeof(float) * D);
                for (int64_t p = piece_start[r]; p < piece_start[r + 1]; p++) {
                    const float *pm = part + p * stride;
                    const float w = expf(pm[j] - m);
                    l += w * pm[H + j];
                    for (int64_t d = 0; d < D; d++) o[d] += w * pm[2 * H + j * D + d];
                }
                for (int64_t d = 0; d < D; d++) Q_STORE(out + (r * H + j) * D + d, o[d] / l);
            }
        }
        free(lanes);
        free(scores);
        free(qf);
    }
    free(part);
    free(item_run);
    free(item_piece);
    free(run_start);
    free(piece_start);
    return failed;
}

#if !SCALED
#include "paged_attention_prefill_body.h"
#endif

#undef PA_PASTE_
#undef PA_PASTE
#undef Q_LOAD
#undef Q_STORE
#undef KV_LOAD
#undef KV_VLOAD
#undef SUFFIX
#undef QT
#undef QS
#undef KT
#undef KS
#undef SCALED
#undef PAIRS
