/*
 * A mixture of experts' routed MLP for one storage dtype with a tiled GEMM (float32, bfloat16),
 * included by layer_ops_body.h when the includer defines MOE (the names it is given -- T,
 * SUFFIX, LOAD, STORE, ROUND -- and layer_ops.c's helpers are its). Entry point and arguments:
 * kernels.h.
 *
 * It computes what pagedkv/models/moe.py's RouteExperts.grouped does, in its order: the router's
 * logits (tiled_linear), per row a softmax over every expert in float32, the top_k largest
 * (the lower expert first on a tie), divided by their sum when renormalising, rounded to T unless
 * the weights stay float32; then the (row, expert) pairs grouped by expert, rows in order, and
 * each expert with rows runs once over them (tiled_gate_up with the fused SiLU, tiled_linear),
 * its products rounded to T after the weight and added into their rows (rounded), expert after
 * expert in increasing order, from zeros: out[r] = round(out[r] + round(y * w)); then the
 * shared expert over every row, scaled by round(sigmoid(its gate logit)) and added alike.
 */

int SUFFIX(moe_experts)(const T *x, const void *const *weights, T *out, int64_t tokens, int64_t hidden,
                        int64_t num_experts, int64_t top_k, int64_t rows, int64_t shared_rows, int64_t flags) {
    const int64_t E = num_experts;
    T *logits = malloc(sizeof(T) * (size_t)(tokens * E));
    int64_t *chosen = malloc(sizeof(int64_t) * (size_t)(tokens * top_k));
    float *chosen_w = malloc(sizeof(float) * (size_t)(tokens * top_k));
    int64_t *counts = calloc((size_t)E + 1, sizeof(int64_t));
    int64_t *order = malloc(sizeof(int64_t) * (size_t)(tokens * top_k)); /* pair index t * top_k + j */
    const int64_t widest = rows > shared_rows ? rows : shared_rows;
    T *xs = malloc(sizeof(T) * (size_t)(tokens * (2 * hidden + widest)));
    int status = !(logits && chosen && chosen_w && counts && order && xs);
    if (!status) status = SUFFIX(tiled_linear)(x, weights[0], NULL, logits, tokens, hidden, E);
    for (int64_t t = 0; t < tokens && !status; t++) {
        float p[E];
        float max = -__builtin_inff(), sum = 0.0f;
        for (int64_t e = 0; e < E; e++) {
            vf v = LOAD(logits + t * E + e, 1);
            p[e] = v[0];
            if (p[e] > max) max = p[e];
        }
        for (int64_t e = 0; e < E; e++) sum += (p[e] = expf(p[e] - max));
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        float picked = 0.0f;
        for (int64_t j = 0; j < top_k; j++) {
            int64_t best = -1;
            for (int64_t e = 0; e < E; e++)
                if (p[e] >= 0.0f && (best < 0 || p[e] > p[best])) best = e;
            chosen[t * top_k + j] = best;
            chosen_w[t * top_k + j] = p[best];
            picked += p[best];
            p[best] = -1.0f; /* taken */
            counts[best + 1]++;
        }
        for (int64_t j = 0; j < top_k; j++) {
            float w = chosen_w[t * top_k + j];
            if (flags & MOE_RENORMALIZE) w /= picked;
            if (!(flags & MOE_FLOAT32_WEIGHTS)) {
                vf v = {0};
                v[0] = w;
                w = ROUND(v)[0];
            }
            chosen_w[t * top_k + j] = w;
        }
    }
    if (!status) {
        for (int64_t e = 0; e < E; e++) counts[e + 1] += counts[e]; /* counts[e]: expert e's first pair */
        int64_t *next = calloc((size_t)E, sizeof(int64_t));
        if (!next) status = 1;
        for (int64_t p = 0; p < tokens * top_k && !status; p++) {
            const int64_t e = chosen[p];
            order[counts[e] + next[e]++] = p;
        }
        free(next);
        memset(out, 0, sizeof(T) * (size_t)(tokens * hidden));
    }
    T *hs = xs + tokens * hidden, *ys = hs + tokens * widest;
    for (int64_t e = 0; e < E && !status; e++) {
        const int64_t first = counts[e], count = counts[e + 1] - first;
        if (!count) continue;
        for (int64_t i = 0; i < count; i++)
            memcpy(xs + i * hidden, x + order[first + i] / top_k * hidden, sizeof(T) * (size_t)hidden);
        status = SUFFIX(tiled_gate_up)(xs, weights[1 + 2 * e], hs, count, hidden, rows, 1);
        if (!status) status = SUFFIX(tiled_linear)(hs, weights[2 + 2 * e], NULL, ys, count, rows, hidden);
        for (int64_t i = 0; i < count && !status; i++) {
            const int64_t pair = order[first + i];
            T *row = out + pair / top_k * hidden;
            const float w = chosen_w[pair];
            for (int64_t c = 0; c < hidden; c += VL) {
                const int64_t m = chunk(hidden, c);
                STORE(row + c, ROUND(LOAD(row + c, m) + ROUND(LOAD(ys + i * hidden + c, m) * w)), m);
            }
        }
    }
    if (!status && shared_rows) { /* out += round(round(sigmoid(gate)) * shared(x)), gate in logits */
        const void *const *shared = weights + 1 + 2 * E;
        status = SUFFIX(tiled_linear)(x, shared[0], NULL, logits, tokens, hidden, 1);
        if (!status) status = SUFFIX(tiled_gate_up)(x, shared[1], hs, tokens, hidden, shared_rows, 1);
        if (!status) status = SUFFIX(tiled_linear)(hs, shared[2], NULL, ys, tokens, shared_rows, hidden);
        for (int64_t t = 0; t < tokens && !status; t++) {
            const vf g = LOAD(logits + t, 1);
            const float scale = ROUND((vf){0} + 1.0f / (1.0f + expf(-g[0])))[0];
            T *row = out + t * hidden;
            for (int64_t c = 0; c < hidden; c += VL) {
                const int64_t m = chunk(hidden, c);
                STORE(row + c, ROUND(LOAD(row + c, m) + ROUND(LOAD(ys + t * hidden + c, m) * scale)), m);
            }
        }
    }
    free(logits);
    free(chosen);
    free(chosen_w);
    free(counts);
    free(order);
    free(xs);
    return status;
}
