/*
 * decode_stack.c's entry point for one dtype, included once per dtype (the `#include`-template
 * idiom: plain C a debugger steps through). The includer defines, and this file undefines at
 * its end: T, the element type, and SUFFIX(name), name with the dtype's suffix
 * (rms_norm -> rms_norm_bf16), which also names the kernels it calls.
 */

int SUFFIX(decode_stack)(const DecodeLayer *layers, int64_t num_layers, const T *final_norm, float final_eps,
                         const DecodeBuffers *b, const T *x, T *out, int64_t tokens, int64_t hidden,
                         const T *cos, const T *sin, const int64_t *slots, const int32_t *tables,
                         int64_t max_blocks, const int32_t *row_seq, const int32_t *row_pos,
                         const int64_t *chunks, const int64_t *threads) {
    const int64_t H = hidden;
    T *residual = b->residual, *y = b->y, *qkv = b->qkv, *q = b->q, *att = b->att, *act = b->act;
    /* layer 0 normalises the embedding, which is also the first residual */
    memcpy(residual, x, sizeof(T) * (size_t)(tokens * H));
    for (int64_t i = 0; i < num_layers; i++) {
        const DecodeLayer *l = &layers[i];
        T *key_pool = l->key_pool, *value_pool = l->value_pool;
        if (i == 0)
            SUFFIX(rms_norm)(x, y, l->input_norm, tokens, H, l->input_eps);
        else
            SUFFIX(add_rms_norm)(y, residual, l->input_norm, tokens, H, l->input_eps);
        if (SUFFIX(tiled_linear)(y, l->qkv, l->qkv_bias, qkv, tokens, H, l->qkv_width)) return 1;
        SUFFIX(rotary_write_kv)(qkv, q, cos, sin, l->q_norm, l->k_norm, l->qk_eps, key_pool, value_pool, slots,
                                tokens, l->heads, l->kv_heads, l->head_dim);
        if (SUFFIX(paged_attention_rows)(q, key_pool, value_pool, NULL, NULL, tables, row_seq, row_pos, att,
                                         tokens, l->heads, l->kv_heads, l->head_dim, l->block_size, max_blocks,
                                         l->scale, l->window, l->soft_cap, chunks[i], (int)threads[i]))
            return 1;
        if (SUFFIX(tiled_linear)(att, l->o, l->o_bias, y, tokens, l->heads * l->head_dim, H)) return 1;
        SUFFIX(add_rms_norm)(y, residual, l->post_norm, tokens, H, l->post_eps);
        if (SUFFIX(tiled_gate_up)(y, l->gate_up, act, tokens, H, l->intermediate, 1)) return 1;
        if (SUFFIX(tiled_linear)(act, l->down, l->down_bias, y, tokens, l->intermediate, H)) return 1;
    }
    SUFFIX(add_rms_norm)(y, residual, final_norm, tokens, H, final_eps);
    memcpy(out, y, sizeof(T) * (size_t)(tokens * H));
    return 0;
}


#undef T
#undef SUFFIX
