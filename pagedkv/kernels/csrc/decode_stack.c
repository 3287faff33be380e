/*
 * A decode step's decoder layers in one call: the same kernels the step program calls one by
 * one (layer_ops.c's norms and rotary + KV write, tiled_gemm.c's projections, paged_attention.c's
 * row entry), in the same order on the same buffers, so the hidden states are bit for bit the
 * program's. What it removes is the interpreter between them: a step makes about eight calls
 * per layer, and each projection streams its weights through L2 and L3, evicting whatever the
 * Python between two calls had in cache. Entry points and arguments: kernels.h.
 *
 * A kernel that cannot allocate its workspace makes the stack return 1 at once: nothing is
 * half-written that the step keeps, as the caller raises and the step is not committed.
 */
#include "kernels.h"

#define DECODE_STACK(T, S)                                                                         \
    int decode_stack_##S(const DecodeLayer *layers, int64_t num_layers, const T *final_norm, float final_eps, \
                         const DecodeBuffers *b, const T *x, T *out, int64_t tokens, int64_t hidden, \
                         const T *cos, const T *sin, const int64_t *slots, const int32_t *tables,  \
                         int64_t max_blocks, const int32_t *row_seq, const int32_t *row_pos,       \
                         const int64_t *chunks, const int64_t *threads) {                          \
        const int64_t H = hidden;                                                                  \
        T *residual = b->residual, *y = b->y, *qkv = b->qkv, *q = b->q, *att = b->att, *act = b->act; \
        /* layer 0 normalises the embedding, which is also the first residual */                  \
        memcpy(residual, x, sizeof(T) * (size_t)(tokens * H));                                     \
        for (int64_t i = 0; i < num_layers; i++) {                                                 \
            const DecodeLayer *l = &layers[i];                                                     \
            T *key_pool = l->key_pool, *value_pool = l->value_pool;                                \
            if (i == 0)                                                                            \
                rms_norm_##S(x, y, l->input_norm, tokens, H, l->input_eps);                        \
            else                                                                                   \
                add_rms_norm_##S(y, residual, l->input_norm, tokens, H, l->input_eps);             \
            if (tiled_linear_##S(y, l->qkv, l->qkv_bias, qkv, tokens, H, l->qkv_width)) return 1;  \
            rotary_write_kv_##S(qkv, q, cos, sin, l->q_norm, l->k_norm, l->qk_eps, key_pool, value_pool, \
                                slots, tokens, l->heads, l->kv_heads, l->head_dim);                \
            if (paged_attention_rows_##S(q, key_pool, value_pool, NULL, NULL, tables, row_seq, row_pos, att, \
                                         tokens, l->heads, l->kv_heads, l->head_dim, l->block_size, \
                                         max_blocks, l->scale, l->window, l->soft_cap, chunks[i],  \
                                         (int)threads[i]))                                         \
                return 1;                                                                          \
            if (tiled_linear_##S(att, l->o, l->o_bias, y, tokens, l->heads * l->head_dim, H)) return 1; \
            add_rms_norm_##S(y, residual, l->post_norm, tokens, H, l->post_eps);                   \
            if (tiled_gate_up_##S(y, l->gate_up, act, tokens, H, l->intermediate, 1)) return 1;    \
            if (tiled_linear_##S(act, l->down, l->down_bias, y, tokens, l->intermediate, H)) return 1; \
        }                                                                                          \
        add_rms_norm_##S(y, residual, final_norm, tokens, H, final_eps);                           \
        memcpy(out, y, sizeof(T) * (size_t)(tokens * H));                                         \
        return 0;                                                                                  \
    }

DECODE_STACK(float, f32)
DECODE_STACK(uint16_t, bf16)
