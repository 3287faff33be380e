/*
 * pagedkv's CPU kernels: every entry point, declared once, and (simd.h) what every source shares.
 *
 * The sources in this folder are compiled together into one shared library on first use, for
 * the machine that runs them (-march=native, OpenMP; see pagedkv/kernels/library.py), so every
 * entry point below can call any other directly. Every header here is part of the library's
 * cache key and ships with the package:
 *   - simd.h: the vector types and the small vector API, for the instruction set it picks, in
 *     that set's own file (simd_avx512.h, simd_avx2.h, simd_portable.h);
 *   - <source>_body.h: a source's per-dtype functions as plain C, included by the source once
 *     per dtype with a few names defined (T, SUFFIX(name), LOAD...: the `#include`-template
 *     idiom), so a debugger steps through their lines and coverage counts them;
 *   - gemm_<set>.h: the tiled GEMM's loops for one instruction set (tiled_gemm.c).
 * Each definition is checked against its prototype below by the compiler. A family of per-dtype
 * entry points has its prototype written once, as a macro of the element types, and each entry
 * point is declared with it under its full name (so a search for the name finds it);
 * pagedkv/kernels/signatures.py declares the ones Python calls for ctypes, and
 * tests/kernels/test_signatures.py checks that table against these prototypes.
 *
 * Suffixes name the element type of the tensors: f32 (float), bf16 (bfloat16, as uint16_t
 * bits), f16 (_Float16; left out when the compiler lacks it: PAGEDKV_NO_F16), and for a
 * quantized KV pool the query's type then the pool's: fp8 (e4m3, uint8_t bits) or i8.
 * Every tensor is contiguous and row-major.
 */
#ifndef PAGEDKV_KERNELS_H
#define PAGEDKV_KERNELS_H

#include "simd.h" /* VL, the vector types and the small vector API, for the target */

/* ---- layer_ops.c: the decoder layer's element-wise ops, fused --------------------------- *
 *   rms_norm_<S>(x, out, w, rows, n, eps)            out = rmsnorm(x) * w       ([rows, n])
 *   add_rms_norm_<S>(x, residual, w, rows, n, eps)   residual += x; x = rmsnorm(residual) * w
 *   silu_and_mul_<S>(gate_up, out, rows, n)          out = silu(gate_up[:, :n]) * gate_up[:, n:]
 *   silu_and_mul_rows_<S>(gate_up, out, rows, n, out_stride)   the same on one thread, out's
 *       rows out_stride apart: the tiled gate/up product applies it to each block it makes
 *   rotary_write_kv_<S>(qkv, q_out, cos, sin, q_w, k_w, eps, key_pool, value_pool, slots,
 *                       tokens, nq, nkv, d)
 *       qkv [tokens, (nq + 2 nkv) d] is the packed projection: each q and k head is optionally
 *       RMS-normalised over d with q_w / k_w (Qwen3; NULL for none), rotated with cos / sin
 *       [tokens, d] (rotate_half convention, sign folded into sin's first half), q written to
 *       q_out [tokens, nq, d], k and v to KV slot slots[t] of the pools [slots, nkv, d]; a
 *       negative slot is padding and writes nothing. d <= layer_ops_max_head_dim(), even.
 *       offset: the q/k norms are Gemma's (below; Gemma 3)
 * Gemma's (layer_ops_gemma_body.h):
 *   offset_rms_norm_<S>(x, out, w, rows, n, eps)     out = rmsnorm(x) * (1 + w), rounded once
 *   add_offset_rms_norm_<S>(x, residual, w, rows, n, eps)
 *       residual += x; x = rmsnorm(residual) * (1 + w), rounded once
 *   gelu_tanh_and_mul_<S>(gate_up, out, rows, n)    out = gelu_tanh(gate_up[:, :n]) * gate_up[:, n:]
 */
/* each op's prototype for element type T, named in full where it is declared below */
#define RMS_NORM(name, T) void name(const T *x, T *out, const T *w, int64_t rows, int64_t n, float eps)
#define ADD_RMS_NORM(name, T) void name(T *x, T *residual, const T *w, int64_t rows, int64_t n, float eps)
#define SILU_AND_MUL(name, T) void name(const T *gate_up, T *out, int64_t rows, int64_t n)
#define SILU_AND_MUL_ROWS(name, T) \
    void name(const T *gate_up, T *out, int64_t rows, int64_t n, int64_t out_stride)
#define ROTARY_WRITE_KV(name, T)                                                                         \
    void name(const T *qkv, T *q_out, const T *cos, const T *sin, const T *q_w, const T *k_w, float eps, \
              T *key_pool, T *value_pool, const int64_t *slots, int64_t tokens, int64_t nq, int64_t nkv,  \
              int64_t d, int64_t offset)
#define GELU_TANH_AND_MUL(name, T) void name(const T *gate_up, T *out, int64_t rows, int64_t n)
RMS_NORM(rms_norm_f32, float);
ADD_RMS_NORM(add_rms_norm_f32, float);
SILU_AND_MUL(silu_and_mul_f32, float);
SILU_AND_MUL_ROWS(silu_and_mul_rows_f32, float);
ROTARY_WRITE_KV(rotary_write_kv_f32, float);
RMS_NORM(offset_rms_norm_f32, float);
ADD_RMS_NORM(add_offset_rms_norm_f32, float);
GELU_TANH_AND_MUL(gelu_tanh_and_mul_f32, float);
RMS_NORM(rms_norm_bf16, uint16_t);
ADD_RMS_NORM(add_rms_norm_bf16, uint16_t);
SILU_AND_MUL(silu_and_mul_bf16, uint16_t);
SILU_AND_MUL_ROWS(silu_and_mul_rows_bf16, uint16_t);
ROTARY_WRITE_KV(rotary_write_kv_bf16, uint16_t);
RMS_NORM(offset_rms_norm_bf16, uint16_t);
ADD_RMS_NORM(add_offset_rms_norm_bf16, uint16_t);
GELU_TANH_AND_MUL(gelu_tanh_and_mul_bf16, uint16_t);
#ifndef PAGEDKV_NO_F16
RMS_NORM(rms_norm_f16, _Float16);
ADD_RMS_NORM(add_rms_norm_f16, _Float16);
SILU_AND_MUL(silu_and_mul_f16, _Float16);
SILU_AND_MUL_ROWS(silu_and_mul_rows_f16, _Float16);
ROTARY_WRITE_KV(rotary_write_kv_f16, _Float16);
RMS_NORM(offset_rms_norm_f16, _Float16);
ADD_RMS_NORM(add_offset_rms_norm_f16, _Float16);
GELU_TANH_AND_MUL(gelu_tanh_and_mul_f16, _Float16);
#endif
int64_t layer_ops_max_head_dim(void);
/* A mixture of experts' routed MLP (layer_ops_moe_body.h), float32 and bfloat16:
 *   moe_experts_<f32|bf16>(x, weights, out, tokens, hidden, num_experts, top_k, rows, shared_rows,
 *                          flags)
 *       -> 0, or 1 without memory
 *       out [tokens, hidden] = sum over each row's top_k experts of weight * expert(x [tokens,
 *       hidden]); weights: the router's tiled [num_experts, hidden] weight, then each expert's
 *       paired tiled gate/up [2 rows, hidden] and tiled down [hidden, rows]; with shared_rows > 0
 *       the shared expert's one-logit gate [1, hidden], gate/up and down, its output scaled by
 *       sigmoid(gate) and added to every row; flags:
 *       MOE_RENORMALIZE (the top-k weights divided by their sum), MOE_FLOAT32_WEIGHTS (not
 *       rounded to the storage dtype)
 */
#define MOE_RENORMALIZE 1
#define MOE_FLOAT32_WEIGHTS 2
#define MOE_EXPERTS(name, T)                                                                            \
    int name(const T *x, const void *const *weights, T *out, int64_t tokens, int64_t hidden,            \
             int64_t num_experts, int64_t top_k, int64_t rows, int64_t shared_rows, int64_t flags)
MOE_EXPERTS(moe_experts_f32, float);
MOE_EXPERTS(moe_experts_bf16, uint16_t);

/* ---- tiled_gemm.c: y = x . W^T + b on weights stored in column tiles --------------------- *
 * x [M, K], y [M, N]; bias [N] or NULL; tiles: W [N, K] in the tiled layout (see the source).
 *   tiled_linear_<f32|bf16>(x, tiles, bias, y, M, K, N) -> 0, or 1 without memory
 *   tiled_gate_up_<f32|bf16>(x, tiles, y, M, K, I, fused) -> 0, or 1 without memory
 *       the MLP's [2 I, K] gate/up weight in the paired layout: y [M, I] = silu(gate) * up
 *       (silu_and_mul_rows_<S>, so the arithmetic is the unfused op's) when fused, else the plain
 *       product y [M, 2 I]
 *   tiled_rows(tiles, ids, out, n, K, N, elem, group) -> 0, or 1 for an id outside [0, N)
 *       out[r] = W[ids[r]] (an embedding lookup on a tied head's tiles): elements of `elem`
 *       bytes, k stored in groups of `group`
 *   tiled_gemm_tile_width() -> output columns per tile
 *   tiled_gemm_bf16_loop() -> 2: AVX512-BF16's dot products, 1: AVX2 widening, 0: portable
 *   tiled_gemm_amx_rows() -> rows from which bfloat16 runs on AMX tiles here, 0: never
 *   tiled_tile_f32(x, tile, width, y, ldy, M, K)   (C callers: quant_gemm.c)
 *       y [M, width] (row stride ldy) = x . T for one tile T of width <= tile width columns
 */
int tiled_linear_f32(const float *x, const float *tiles, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N);
int tiled_linear_bf16(const uint16_t *x, const uint16_t *tiles, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t K, int64_t N);
int tiled_gate_up_f32(const float *x, const float *tiles, float *y, int64_t M, int64_t K, int64_t I, int fused);
int tiled_gate_up_bf16(const uint16_t *x, const uint16_t *tiles, uint16_t *y, int64_t M, int64_t K, int64_t I,
                       int fused);
int tiled_rows(const char *tiles, const int64_t *ids, char *out, int64_t n, int64_t K, int64_t N, int64_t elem,
               int64_t group);
int64_t tiled_gemm_tile_width(void);
int64_t tiled_gemm_bf16_loop(void);
int64_t tiled_gemm_amx_rows(void);
void tiled_tile_f32(const float *x, const float *tile, int64_t width, float *y, int64_t ldy, int64_t M, int64_t K);

/* ---- quant_gemm.c: weights kept in GGUF's quantized blocks (quant_types.h) ---------------- *
 * w: a [N, K] weight as GGUF stores it, each row K / elements blocks of the ggml type `type`
 * (QuantType: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), K a whole number of blocks.
 *   quant_dequantize_<f32|bf16>(w, type, out, rows, K) -> 0; 1 without memory; 2 for a type
 *       or K it does not take. out [rows, K] = the dequantized weight (bfloat16: rounded to
 *       nearest even)
 *   quant_linear_<f32|bf16>(x, w, type, bias, y, M, K, N, ldy) -> 0, 1 or 2 as above
 *       y [M, N] (row stride ldy >= N, so a part of a packed projection writes its columns of
 *       the packed output in place) = x [M, K] . W^T + bias [N] (or NULL)
 */
int quant_dequantize_f32(const void *w, int64_t type, float *out, int64_t rows, int64_t K);
int quant_dequantize_bf16(const void *w, int64_t type, uint16_t *out, int64_t rows, int64_t K);
int quant_linear_f32(const float *x, const void *w, int64_t type, const float *bias, float *y, int64_t M, int64_t K,
                     int64_t N, int64_t ldy);
int quant_linear_bf16(const uint16_t *x, const void *w, int64_t type, const uint16_t *bias, uint16_t *y, int64_t M,
                      int64_t K, int64_t N, int64_t ldy);

/* ---- quant_dot.c: the same products in llama.cpp's arithmetic (8-bit activations) ----------- *
 *   quant_linear_q8_<f32|bf16>(x, w, type, bias, y, M, K, N, ldy) -> 0, 1 or 2 as quant_linear's
 *       y as quant_linear's, each row of x rounded to 8-bit blocks (Q8_0 for the 32-element
 *       types, Q8_K for the K types) and multiplied by integer dot products
 *   quant_activations_f32(x, format, out, rows, K) -> 0, 1, or 2 for a format or K it does not take
 *       out = x [rows, K] rounded to blocks of ggml type `format` as the product rounds it:
 *       Q8_0 (8: GGUF's 34-byte blocks) or Q8_K (15: ggml's block_q8_K, float d, 256 quants,
 *       16 int16 sums of 16)
 *   quant_dot_isa() -> the instruction set of the integer products ("avx512-vnni", "avx-vnni",
 *       "avx2" or "portable")
 * C callers: quant_linear_q8_shared_<f32|bf16>(..., shared) is quant_linear_q8 with the rounded
 * rows kept in *shared (zeroed at first; its blocks freed by the caller): a call with the same
 * x, rows and block format reuses them, so the caller sets shared->x to NULL once x may have
 * been written (decode_stack.c: after every other record).
 */
typedef struct {
    const void *x;                /* the input the blocks hold, or NULL */
    int64_t elements, rows, K;    /* its block size, rows and width */
    void *blocks;
    size_t capacity;              /* bytes at blocks */
} Q8Shared;
int quant_linear_q8_f32(const float *x, const void *w, int64_t type, const float *bias, float *y, int64_t M,
                        int64_t K, int64_t N, int64_t ldy);
int quant_linear_q8_bf16(const uint16_t *x, const void *w, int64_t type, const uint16_t *bias, uint16_t *y,
                         int64_t M, int64_t K, int64_t N, int64_t ldy);
int quant_linear_q8_shared_f32(const float *x, const void *w, int64_t type, const float *bias, float *y, int64_t M,
                               int64_t K, int64_t N, int64_t ldy, Q8Shared *shared);
int quant_linear_q8_shared_bf16(const uint16_t *x, const void *w, int64_t type, const uint16_t *bias, uint16_t *y,
                                int64_t M, int64_t K, int64_t N, int64_t ldy, Q8Shared *shared);
int quant_activations_f32(const float *x, int64_t format, void *out, int64_t rows, int64_t K);
const char *quant_dot_isa(void);

/* ---- paged_attention.c: attention reading keys and values in place from the block pool ---- *
 * q/out [R, Hq, D]; key/value pools [num_blocks, block_size, Hkv, D]; their float32 scales
 * [num_blocks, block_size, Hkv] (quantized pools only, else NULL); block_tables [num_seqs,
 * max_blocks]. Query head j reads KV head j / (Hq / Hkv), Hq / Hkv <= 64.
 *   paged_attention_rows_<Q>[_<KV>](q, key, value, key_scale, value_scale, block_tables, row_seq,
 *       row_pos, out, num_rows, num_heads, kv_heads, head_dim, block_size, max_blocks, scale,
 *       window, soft_cap, chunk, num_threads) -> 0, or 1 without memory
 *       row r of sequence row_seq[r] attends its positions <= row_pos[r] (and > row_pos[r] -
 *       window when window > 0), in pieces of at most `chunk` positions on num_threads threads
 *   paged_attention_prefill_<S>(q, key, value, block_tables, tile_seq, tile_row, tile_pos,
 *       tile_rows, out, num_tiles, num_heads, kv_heads, head_dim, block_size, max_blocks, scale,
 *       num_threads) -> 0, 1 without memory, 2 for a head shape it does not take
 *       tiles of consecutive prompt rows: each tile's sequence, first row in q, that row's
 *       position and its row count (at most paged_attention_prefill_lanes() / group)
 */
/* the two entries' prototypes for query and output elements QT and pool elements KT, named in
 * full where they are declared below */
#define PAGED_ATTENTION_ROWS(name, QT, KT)                                                                  \
    int name(const QT *q, const KT *key, const KT *value, const float *key_scale, const float *value_scale, \
             const int32_t *block_tables, const int32_t *row_seq, const int32_t *row_pos, QT *out,          \
             int64_t num_rows, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,   \
             int64_t max_blocks, float scale, int64_t window, float soft_cap, int64_t chunk, int num_threads)
#define PAGED_ATTENTION_PREFILL(name, T)                                                                    \
    int name(const T *q, const T *key, const T *value, const int32_t *block_tables, const int32_t *tile_seq, \
             const int32_t *tile_row, const int32_t *tile_pos, const int32_t *tile_rows, T *out,            \
             int64_t num_tiles, int64_t num_heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,  \
             int64_t max_blocks, float scale, int num_threads)
PAGED_ATTENTION_ROWS(paged_attention_rows_f32, float, float);
PAGED_ATTENTION_ROWS(paged_attention_rows_bf16, uint16_t, uint16_t);
PAGED_ATTENTION_ROWS(paged_attention_rows_f32_fp8, float, uint8_t);
PAGED_ATTENTION_ROWS(paged_attention_rows_f32_i8, float, int8_t);
PAGED_ATTENTION_ROWS(paged_attention_rows_bf16_fp8, uint16_t, uint8_t);
PAGED_ATTENTION_ROWS(paged_attention_rows_bf16_i8, uint16_t, int8_t);
PAGED_ATTENTION_PREFILL(paged_attention_prefill_f32, float);
PAGED_ATTENTION_PREFILL(paged_attention_prefill_bf16, uint16_t);
#ifndef PAGEDKV_NO_F16
PAGED_ATTENTION_ROWS(paged_attention_rows_f16, _Float16, _Float16);
PAGED_ATTENTION_ROWS(paged_attention_rows_f16_fp8, _Float16, uint8_t);
PAGED_ATTENTION_ROWS(paged_attention_rows_f16_i8, _Float16, int8_t);
PAGED_ATTENTION_PREFILL(paged_attention_prefill_f16, _Float16);
#endif
int64_t paged_attention_prefill_lanes(void);

/* ---- lora_bgmv.c: LoRA adapters' outputs for rows of mixed adapters (BGMV) -------------- *
 *   lora_bgmv_<f32|bf16>(x, a, b, row_slot, scaling, columns, y, rows, n_in, n_out, slots, rank,
 *       shards) -> 0; 1 without memory; 2 for a row_slot >= slots
 *       y [rows, n_out] += scaling[s] * B_s (A_s x) for each row r of slot s = row_slot[r] (-1: no
 *       adapter, the row is left as it is). x [rows, n_in]; a [slots, shards * rank, n_in]; b
 *       [slots, shards * rank, n_out] (B transposed); block p of `rank` rows writes only the
 *       columns [columns[p], columns[p + 1]) (columns [shards + 1]); scaling [slots] float32.
 *       Sums in float32, y rounded once.
 */
#define LORA_BGMV(name, T)                                                                                \
    int name(const T *x, const T *a, const T *b, const int32_t *row_slot, const float *scaling,          \
             const int64_t *columns, T *y, int64_t rows, int64_t n_in, int64_t n_out, int64_t slots,      \
             int64_t rank, int64_t shards)
LORA_BGMV(lora_bgmv_f32, float);
LORA_BGMV(lora_bgmv_bf16, uint16_t);
/*   lora_bgmv_paged_<f32|bf16>(x, base, offsets, row_slot, scaling, columns, y, rows, n_in, n_out,
 *       slots, rank, shards) -> as lora_bgmv's, the adapters read where they live, in pages of
 *       the KV cache: offsets [slots, 2, shards * rank] int64, the element offsets from base of
 *       each slot's A rows (n_in elements each) then its B rows (B transposed: block p's rows are
 *       columns[p + 1] - columns[p] elements, from its first column); a rank row whose A or B
 *       offset is negative is a zero row (a smaller rank's padding, never read). Bit for bit
 *       lora_bgmv's on slot tensors holding the same rows.
 */
#define LORA_BGMV_PAGED(name, T)                                                                          \
    int name(const T *x, const T *base, const int64_t *offsets, const int32_t *row_slot,                 \
             const float *scaling, const int64_t *columns, T *y, int64_t rows, int64_t n_in, int64_t n_out, \
             int64_t slots, int64_t rank, int64_t shards)
LORA_BGMV_PAGED(lora_bgmv_paged_f32, float);
LORA_BGMV_PAGED(lora_bgmv_paged_bf16, uint16_t);

/* ---- decode_stack.c: a decode step's decoder layers in one call ------------------------- *
 * The stack runs a list of DecodeOp records, lowered in Python from the model's op list
 * (pagedkv/models/decode_stack.py): each names its opcode, the buffers it reads (src) and
 * writes (dst), and its weights and shape. Buffers hold [tokens, width] rows; what each op reads
 * and writes, with the kernel it calls:
 *   DECODE_COPY            dst = src                                     (n_out wide)
 *   DECODE_NORM            dst = rmsnorm(src) * weight                   rms_norm_<S>
 *   DECODE_ADD_NORM        residual += src; src = rmsnorm(residual) * weight, in place (dst is
 *                          src, the residual buffer DECODE_RESIDUAL)       add_rms_norm_<S>
 *   DECODE_LINEAR          dst [n_out] = src [n_in] . weight^T + bias      tiled_linear_<S>
 *   DECODE_ROTARY_WRITE_KV src: packed q/k/v; dst: rotated q; k and v into key_pool /
 *                          value_pool at the step's slots (q_norm, k_norm, eps: Qwen3's norms)
 *                                                                         rotary_write_kv_<S>
 *   DECODE_ATTEND          src: q; dst: attention output; block_size, scale, window,
 *                          soft_cap as paged_attention_rows'; split: the entry of chunks /
 *                          threads it runs with                           paged_attention_rows_<S>
 *   DECODE_GATE_UP_SILU    dst [n_out] = silu(gate) * up of src [n_in] on the paired tiled
 *                          gate/up weight                                 tiled_gate_up_<S>
 *   DECODE_QUANT_LINEAR    columns [column, column + columns) of dst [n_out] = src [n_in] .
 *                          weight^T + bias, weight in GGUF blocks of ggml type qtype (one part
 *                          of a packed projection; bias: the part's)    quant_linear_<S>
 *                          a step of at most q8_rows rows rounds src to 8-bit blocks and sums
 *                          integer products instead, src rounded once for the records in a row
 *                          that read it                                   quant_linear_q8_<S>
 *   DECODE_SILU_AND_MUL    dst [n_out] = silu(src[:n_out]) * src[n_out:]  silu_and_mul_<S>
 *   DECODE_OFFSET_NORM     dst = rmsnorm(src) * (1 + weight)             offset_rms_norm_<S>
 *   DECODE_ADD_OFFSET_NORM residual += src; src = rmsnorm(residual) * (1 + weight), in place
 *                                                                         add_offset_rms_norm_<S>
 *   DECODE_GATE_UP         dst [n_out] = src [n_in] . weight^T on the paired tiled gate/up
 *                          weight, gate's n_out / 2 columns then up's     tiled_gate_up_<S>
 *   DECODE_GELU_TANH_AND_MUL  dst [n_out] = gelu_tanh(src[:n_out]) * src[n_out:]
 *                                                                         gelu_tanh_and_mul_<S>
 *   DECODE_MOE_EXPERTS     dst [n_out] = the routed experts of src [n_in]: weight, experts,
 *                          top_k, expert_rows, shared_rows, moe_flags as moe_experts_<S>'s
 *                                                                         moe_experts_<S>
 *   DECODE_LORA            dst [n_out] += each row's LoRA adapter output for src [n_in] (src: the
 *                          projection's input, dst: its output): weight = a, lora_b = b,
 *                          lora_columns, lora_slots, lora_rank, lora_shards as lora_bgmv's; the
 *                          step's row_slot and scaling at lora_slot / lora_scaling  lora_bgmv_<S>
 *   DECODE_LORA_PAGED      DECODE_LORA with the adapters in the KV cache's pages: weight = base,
 *                          lora_b = offsets as lora_bgmv_paged's          lora_bgmv_paged_<S>
 * DECODE_ROTARY_WRITE_KV's offset says its q/k norms are Gemma's, rope which rotary table
 * (cos / sin) it reads; a KV record's group, the KV group whose slots and tables it reads.
 * Weights are the model's dtype, projections in the tiled layout or GGUF blocks; NULL for no
 * bias or no q/k norm; the KV pools unquantized, of the model's dtype.
 */
typedef enum {
    DECODE_COPY,
    DECODE_NORM,
    DECODE_ADD_NORM,
    DECODE_LINEAR,
    DECODE_ROTARY_WRITE_KV,
    DECODE_ATTEND,
    DECODE_GATE_UP_SILU,
    DECODE_QUANT_LINEAR,
    DECODE_SILU_AND_MUL,
    DECODE_OFFSET_NORM,
    DECODE_ADD_OFFSET_NORM,
    DECODE_GATE_UP,
    DECODE_GELU_TANH_AND_MUL,
    DECODE_MOE_EXPERTS,
    DECODE_LORA,
    DECODE_LORA_PAGED,
} DecodeCode;

/* the buffers every stack has: the embedded tokens (read only), the residual stream and the
 * final hidden states [tokens, hidden]; the working buffers follow from DECODE_WORK on */
typedef enum {
    DECODE_INPUT,
    DECODE_RESIDUAL,
    DECODE_OUTPUT,
    DECODE_WORK,
} DecodeBuffer;

typedef struct {
    int64_t code, src, dst;
    const void *weight, *bias, *q_norm, *k_norm;
    void *key_pool, *value_pool;
    float eps, scale, soft_cap;
    int64_t n_in, n_out, heads, kv_heads, head_dim, block_size, window, split, qtype, column, columns;
    int64_t group, offset, rope;
    int64_t experts, top_k, expert_rows, shared_rows, moe_flags;
    const void *lora_b, *lora_columns, *lora_slot, *lora_scaling; /* DECODE_LORA(_PAGED)'s */
    int64_t lora_slots, lora_rank, lora_shards;
    int64_t q8_rows; /* DECODE_QUANT_LINEAR's */
} DecodeOp;

/*   decode_stack_<f32|bf16>(ops, num_ops, buffers, tokens, cos, sin, slots, tables, max_blocks,
 *       row_seq, row_pos, chunks, threads)
 *       -> 0; 1 when a kernel could not allocate its workspace; 2 for an unknown opcode or
 *       quantized type
 *       runs ops[0..num_ops) in order on buffers (each room for `tokens` rows of its width);
 *       cos / sin per rotary table (a record reads its `rope`'s) as rotary_write_kv's; slots, tables and max_blocks per KV group (a record
 *       reads its `group`'s): the group's slots as rotary_write_kv's, its block tables
 *       [num_seqs, max_blocks] as paged_attention_rows'; row_seq / row_pos as
 *       paged_attention_rows' (one row per generated token, the same in every group);
 *       chunks / threads per split
 */
int decode_stack_f32(const DecodeOp *ops, int64_t num_ops, void *const *buffers, int64_t tokens,
                     const float *const *cos, const float *const *sin, const int64_t *const *slots,
                     const int32_t *const *tables, const int64_t *max_blocks, const int32_t *row_seq,
                     const int32_t *row_pos, const int64_t *chunks, const int64_t *threads);
int decode_stack_bf16(const DecodeOp *ops, int64_t num_ops, void *const *buffers, int64_t tokens,
                      const uint16_t *const *cos, const uint16_t *const *sin, const int64_t *const *slots,
                      const int32_t *const *tables, const int64_t *max_blocks, const int32_t *row_seq,
                      const int32_t *row_pos, const int64_t *chunks, const int64_t *threads);

#endif
