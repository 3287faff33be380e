/*
 * A decode step's decoder layers in one call: the same compiled kernels the step program calls
 * from Python (layer_ops_cpu.c's norms and rotary + KV write, tiled_gemm_cpu.c's projections,
 * paged_attention_cpu.c's row entry), in the same order on the same buffers, so the hidden
 * states are bit for bit the program's. What it removes is the Python between them: ~50 calls a
 * step, each of which ran with cold caches (every projection streams its weights through L2 and
 * L3 and evicts the interpreter's working set). Replaying a step's C calls without that Python
 * took 32 rows from 25.3 to 22.8 ms, 8 rows 9.9 -> 7.9, 1 row 4.9 -> 3.6 (issue 12's model,
 * float32, 2 threads, a Zen 1 EPYC).
 *
 * The kernels live in their own libraries and are reached through the addresses Python passes
 * in (`Kernels`), so each stays in its own source. Entry point:
 *   decode_stack(kernels, layers, num_layers, final_norm, final_eps, buffers, x, out, tokens,
 *                cos, sin, slots, tables, max_blocks, row_seq, row_pos, chunks, threads)
 * returns 0, or 1 when a kernel could not allocate its workspace (nothing is half-written that
 * the step keeps: the caller raises and the step is not committed).
 */
#include <stdint.h>
#include <string.h>

typedef void (*norm_fn)(const void *x, void *out, const void *w, int64_t rows, int64_t n, float eps);
typedef void (*add_norm_fn)(void *x, void *residual, const void *w, int64_t rows, int64_t n, float eps);
typedef void (*rotary_fn)(const void *qkv, void *q_out, const void *cos, const void *sin, const void *q_w,
                          const void *k_w, float eps, void *key_pool, void *value_pool, const int64_t *slots,
                          int64_t tokens, int64_t nq, int64_t nkv, int64_t d);
typedef void (*linear_f32_fn)(const void *x, const void *tiles, const void *bias, void *y, int64_t M, int64_t K,
                              int64_t N);
typedef int (*linear_status_fn)(const void *x, const void *tiles, const void *bias, void *y, int64_t M, int64_t K,
                                int64_t N);
typedef int (*gate_up_fn)(const void *x, const void *tiles, void *y, int64_t M, int64_t K, int64_t I,
                          const void *epilogue);
typedef int (*attention_fn)(const void *q, const void *key, const void *value, const float *key_scale,
                            const float *value_scale, const int32_t *block_tables, const int32_t *row_seq,
                            const int32_t *row_pos, void *out, int64_t num_rows, int64_t num_heads,
                            int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale,
                            int64_t window, float soft_cap, int64_t chunk, int num_threads);

/* the kernels for one dtype; `linear_status`: 1 when `linear` returns a status (bfloat16, which
 * allocates a workspace), 0 when it returns nothing (float32) */
typedef struct {
    void *rms_norm, *add_rms_norm, *rotary_write_kv, *linear, *gate_up, *attention, *epilogue;
    int64_t linear_status, hidden, elem_size;
} Kernels;

/* one decoder layer: its weights (tiled projections, norm weights; NULL bias or q/k norm for
 * none), its KV pools and its attention shape */
typedef struct {
    const void *input_norm, *qkv, *qkv_bias, *q_norm, *k_norm, *o, *o_bias, *post_norm, *gate_up, *down, *down_bias;
    void *key_pool, *value_pool;
    float input_eps, qk_eps, post_eps, scale, soft_cap;
    int64_t qkv_width, heads, kv_heads, head_dim, block_size, window, intermediate;
} Layer;

/* the step's working rows, each room for the largest batch: residual and y [rows, hidden], qkv
 * [rows, qkv_width], q and att [rows, heads * head_dim], act [rows, intermediate] */
typedef struct {
    void *residual, *y, *qkv, *q, *att, *act;
} Buffers;

static int linear(const Kernels *k, const void *x, const void *tiles, const void *bias, void *y, int64_t M,
                  int64_t K, int64_t N) {
    if (k->linear_status) return ((linear_status_fn)k->linear)(x, tiles, bias, y, M, K, N);
    ((linear_f32_fn)k->linear)(x, tiles, bias, y, M, K, N);
    return 0;
}

int decode_stack(const Kernels *k, const Layer *layers, int64_t num_layers, const void *final_norm,
                 float final_eps, const Buffers *b, const void *x, void *out, int64_t tokens, const void *cos,
                 const void *sin, const int64_t *slots, const int32_t *tables, int64_t max_blocks,
                 const int32_t *row_seq, const int32_t *row_pos, const int64_t *chunks, const int64_t *threads) {
    const int64_t H = k->hidden;
    const add_norm_fn add_norm = (add_norm_fn)k->add_rms_norm;
    /* layer 0 normalises the embedding, which is also the first residual */
    memcpy(b->residual, x, (size_t)(tokens * H * k->elem_size));
    for (int64_t i = 0; i < num_layers; i++) {
        const Layer *l = &layers[i];
        const int64_t q_width = l->heads * l->head_dim;
        if (i == 0)
            ((norm_fn)k->rms_norm)(x, b->y, l->input_norm, tokens, H, l->input_eps);
        else
            add_norm(b->y, b->residual, l->input_norm, tokens, H, l->input_eps);
        if (linear(k, b->y, l->qkv, l->qkv_bias, b->qkv, tokens, H, l->qkv_width)) return 1;
        ((rotary_fn)k->rotary_write_kv)(b->qkv, b->q, cos, sin, l->q_norm, l->k_norm, l->qk_eps, l->key_pool,
                                        l->value_pool, slots, tokens, l->heads, l->kv_heads, l->head_dim);
        if (((attention_fn)k->attention)(b->q, l->key_pool, l->value_pool, NULL, NULL, tables, row_seq, row_pos,
                                         b->att, tokens, l->heads, l->kv_heads, l->head_dim, l->block_size,
                                         max_blocks, l->scale, l->window, l->soft_cap, chunks[i], (int)threads[i]))
            return 1;
        if (linear(k, b->att, l->o, l->o_bias, b->y, tokens, q_width, H)) return 1;
        add_norm(b->y, b->residual, l->post_norm, tokens, H, l->post_eps);
        if (((gate_up_fn)k->gate_up)(b->y, l->gate_up, b->act, tokens, H, l->intermediate, k->epilogue)) return 1;
        if (linear(k, b->act, l->down, l->down_bias, b->y, tokens, l->intermediate, H)) return 1;
    }
    add_norm(b->y, b->residual, final_norm, tokens, H, final_eps);
    memcpy(out, b->y, (size_t)(tokens * H * k->elem_size));
    return 0;
}
