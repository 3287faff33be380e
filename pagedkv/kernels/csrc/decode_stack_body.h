/*
 * decode_stack.c's entry point for one dtype, included once per dtype (the `#include`-template
 * idiom: plain C a debugger steps through). The includer defines, and this file undefines at
 * its end: T, the element type, and SUFFIX(name), name with the dtype's suffix
 * (rms_norm -> rms_norm_bf16), which also names the kernels it calls.
 */

/* the records in order; q8: the rounded input the DECODE_QUANT_LINEAR records in a row share
 * (forgotten after any other record, which may write it) */
static int SUFFIX(decode_ops)(const DecodeOp *ops, int64_t num_ops, void *const *buffers, int64_t tokens,
                              const T *const *cos, const T *const *sin, const int64_t *const *slots,
                              const int32_t *const *tables, const int64_t *max_blocks, const int32_t *row_seq,
                              const int32_t *row_pos, const int64_t *chunks, const int64_t *threads, Q8Shared *q8) {
    T *residual = buffers[DECODE_RESIDUAL];
    for (int64_t i = 0; i < num_ops; i++) {
        const DecodeOp *op = &ops[i];
        const T *src = buffers[op->src];
        T *dst = buffers[op->dst];
        if (op->code != DECODE_QUANT_LINEAR) q8->x = NULL;
        switch (op->code) {
        case DECODE_COPY:
            memcpy(dst, src, sizeof(T) * (size_t)(tokens * op->n_out));
            break;
        case DECODE_NORM:
            SUFFIX(rms_norm)(src, dst, op->weight, tokens, op->n_out, op->eps);
            break;
        case DECODE_ADD_NORM:
            SUFFIX(add_rms_norm)(dst, residual, op->weight, tokens, op->n_out, op->eps);
            break;
        case DECODE_LINEAR:
            if (SUFFIX(tiled_linear)(src, op->weight, op->bias, dst, tokens, op->n_in, op->n_out)) return 1;
            break;
        case DECODE_ROTARY_WRITE_KV:
            SUFFIX(rotary_write_kv)(src, dst, cos[op->rope], sin[op->rope], op->q_norm, op->k_norm, op->eps,
                                    op->key_pool, op->value_pool, slots[op->group], tokens, op->heads, op->kv_heads,
                                    op->head_dim, op->offset);
            break;
        case DECODE_ATTEND:
            if (SUFFIX(paged_attention_rows)(src, op->key_pool, op->value_pool, NULL, NULL, tables[op->group], row_seq,
                                             row_pos, dst, tokens, op->heads, op->kv_heads, op->head_dim,
                                             op->block_size, max_blocks[op->group], op->scale, op->window, op->soft_cap,
                                             chunks[op->split], (int)threads[op->split]))
                return 1;
            break;
        case DECODE_GATE_UP_SILU:
            if (SUFFIX(tiled_gate_up)(src, op->weight, dst, tokens, op->n_in, op->n_out, 1)) return 1;
            break;
        case DECODE_QUANT_LINEAR: {
            const int status =
                tokens <= op->q8_rows
                    ? SUFFIX(quant_linear_q8_shared)(src, op->weight, op->qtype, op->bias, dst + op->column, tokens,
                                                     op->n_in, op->columns, op->n_out, q8)
                    : SUFFIX(quant_linear)(src, op->weight, op->qtype, op->bias, dst + op->column, tokens, op->n_in,
                                           op->columns, op->n_out);
            if (status) return status;
            break;
        }
        case DECODE_SILU_AND_MUL:
            SUFFIX(silu_and_mul)(src, dst, tokens, op->n_out);
            break;
        case DECODE_OFFSET_NORM:
            SUFFIX(offset_rms_norm)(src, dst, op->weight, tokens, op->n_out, op->eps);
            break;
        case DECODE_ADD_OFFSET_NORM:
            SUFFIX(add_offset_rms_norm)(dst, residual, op->weight, tokens, op->n_out, op->eps);
            break;
        case DECODE_GATE_UP:
            if (SUFFIX(tiled_gate_up)(src, op->weight, dst, tokens, op->n_in, op->n_out / 2, 0)) return 1;
            break;
        case DECODE_GELU_TANH_AND_MUL:
            SUFFIX(gelu_tanh_and_mul)(src, dst, tokens, op->n_out);
            break;
        case DECODE_MOE_EXPERTS:
            if (SUFFIX(moe_experts)(src, op->weight, dst, tokens, op->n_in, op->experts, op->top_k, op->expert_rows,
                                    op->shared_rows, op->moe_flags))
                return 1;
            break;
        case DECODE_LORA: {
            const int status = SUFFIX(lora_bgmv)(src, op->weight, op->lora_b, op->lora_slot, op->lora_scaling,
                                                 op->lora_columns, dst, tokens, op->n_in, op->n_out, op->lora_slots,
                                                 op->lora_rank, op->lora_shards);
            if (status) return status;
            break;
        }
        case DECODE_LORA_PAGED: {
            const int status = SUFFIX(lora_bgmv_paged)(src, op->weight, op->lora_b, op->lora_slot, op->lora_scaling,
                                                       op->lora_columns, dst, tokens, op->n_in, op->n_out,
                                                       op->lora_slots, op->lora_rank, op->lora_shards);
            if (status) return status;
            break;
        }
        default:
            return 2;
        }
    }
    return 0;
}

int SUFFIX(decode_stack)(const DecodeOp *ops, int64_t num_ops, void *const *buffers, int64_t tokens,
                         const T *const *cos, const T *const *sin, const int64_t *const *slots,
                         const int32_t *const *tables, const int64_t *max_blocks, const int32_t *row_seq,
                         const int32_t *row_pos, const int64_t *chunks, const int64_t *threads) {
    Q8Shared q8 = {0};
    const int status = SUFFIX(decode_ops)(ops, num_ops, buffers, tokens, cos, sin, slots, tables, max_blocks,
                                          row_seq, row_pos, chunks, threads, &q8);
    free(q8.blocks);
    return status;
}


#undef T
#undef SUFFIX
