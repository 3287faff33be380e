/*
 * paged_attention.c's prefill entry for one unquantized dtype, included by
 * paged_attention_body.h after that dtype's row kernel (whose SUFFIX(slot) it uses), with the same
 * parameters (SUFFIX, QT, QS, KT, KS; Q_LOAD, Q_STORE, KV_VLOAD).
 *
 * Prefill tiles: one work item is a tile of up to VL / group consecutive query rows of one
 * sequence and one KV head, its VL lanes being those rows' query heads of that KV head. Keys
 * and values are read once per tile (the row kernel reads them once per row) and every loaded
 * element serves all VL lanes: a broadcast multiply-add, so scores and value sums need no
 * horizontal reduction. Pass 1 stores every score of the tile's range, lane-wise; the causal
 * mask only touches positions past the tile's first row; pass 2 sums the values.
 */

/* a key or value vector of one KV head as float32: in place for float32, else converted into stage */
static inline const float *SUFFIX(row)(const KT *src, float *stage, int64_t D) {
    if (sizeof(KT) == sizeof(float)) return (const float *)(const void *)src;
    for (int64_t d = 0; d < D; d += VL) vstore(stage + d, KV_VLOAD(src + d));
    return stage;
}

static void SUFFIX(prefill_tile)(const Shape *s, const QT *q, const KT *key, const KT *value,
                                const int32_t *table, int64_t row0, int64_t pos0, int64_t rows,
                                int64_t h, QT *out, float *qt, float *sc, float *ot, float *stage) {
    const int64_t H = s->num_heads, D = s->head_dim, HD = s->kv_heads * D, group = H / s->kv_heads;
    const int64_t n = pos0 + rows; /* key positions 0 .. the last row's */
    vi lane_pos;
    for (int64_t lane = 0; lane < VL; lane++) { /* padding lanes repeat the tile's last row */
        const int64_t r = lane / group < rows ? lane / group : rows - 1;
        lane_pos[lane] = (int32_t)(pos0 + r);
        const QT *qp = q + ((row0 + r) * H + h * group + lane % group) * D;
        for (int64_t d = 0; d < D; d++) qt[d * VL + lane] = Q_LOAD(qp + d);
    }
    vf mv = (vf){0} - INFINITY;
    for (int64_t t0 = 0; t0 < n; t0 += TILE_KEYS) {
        const int64_t cnt = n - t0 < TILE_KEYS ? n - t0 : TILE_KEYS;
        const float *k[TILE_KEYS];
        for (int u = 0; u < TILE_KEYS; u++) {
            const int64_t t = t0 + (u < cnt ? u : cnt - 1);
            k[u] = SUFFIX(row)(key + SUFFIX(slot)(s, table, t) * HD + h * D, stage + u * D, D);
        }
        vf acc[TILE_KEYS];
        lane_scores(qt, k, D, acc);
        for (int u = 0; u < cnt; u++) {
            const int64_t t = t0 + u;
            vf score = acc[u] * s->scale;
            if (t > pos0) score = vselect(lane_pos >= (vi){0} + (int32_t)t, score, (vf){0} - INFINITY);
            vstore(sc + t * VL, score);
            mv = vmax(mv, score);
        }
    }
    const vf lv = lane_softmax(sc, n, mv);
    for (int64_t d = 0; d < D * VL; d++) ot[d] = 0.0f;
    for (int64_t t0 = 0; t0 < n; t0 += TILE_VALUES) {
        const int64_t cnt = n - t0 < TILE_VALUES ? n - t0 : TILE_VALUES;
        const float *v[TILE_VALUES];
        for (int64_t u = 0; u < cnt; u++)
            v[u] = SUFFIX(row)(value + SUFFIX(slot)(s, table, t0 + u) * HD + h * D, stage + u * D, D);
        lane_values(ot, sc + t0 * VL, v, cnt, D);
    }
    for (int64_t lane = 0; lane < rows * group; lane++) {
        QT *o = out + ((row0 + lane / group) * H + h * group + lane % group) * D;
        for (int64_t d = 0; d < D; d++) Q_STORE(o + d, ot[d * VL + lane] / lv[lane]);
    }
}

int SUFFIX(paged_attention_prefill)(
    const QT *q, const KT *key, const KT *value, const int32_t *block_tables, const int32_t *tile_seq,
    const int32_t *tile_row, const int32_t *tile_pos, const int32_t *tile_rows, QT *out,
    int64_t num_tiles, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale, int num_threads) {
    const Shape s = {num_heads, kv_heads, head_dim, block_size, scale, 0.0f, block_shift_of(block_size)};
    const int64_t D = head_dim;
    if (D % TILE_DIMS || D % VL || VL % (num_heads / kv_heads)) return 2;
    int64_t longest = 0;
    for (int64_t i = 0; i < num_tiles; i++)
        if (tile_pos[i] + tile_rows[i] > longest) longest = tile_pos[i] + tile_rows[i];
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *qt = malloc(sizeof(float) * D * VL), *ot = malloc(sizeof(float) * D * VL);
        float *sc = malloc(sizeof(float) * (longest + TILE_KEYS) * VL);
        float *stage = malloc(sizeof(float) * D * TILE_VALUES);
        if (!qt || !ot || !sc || !stage) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_tiles * kv_heads; item++) {
            if (failed) continue;
            const int64_t i = item / kv_heads, h = item % kv_heads;
            SUFFIX(prefill_tile)(&s, q, key, value, block_tables + (int64_t)tile_seq[i] * max_blocks,
                                tile_row[i], tile_pos[i], tile_rows[i], h, out, qt, sc, ot, stage);
        }
        free(qt), free(ot), free(sc), free(stage);
    }
    return failed;
}
