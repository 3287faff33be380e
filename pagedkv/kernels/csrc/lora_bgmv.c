/*
 * LoRA adapters' outputs for a batch of rows of mixed adapters (Punica's and S-LoRA's BGMV): each
 * row is multiplied by its own adapter's matrices only, gathered by its slot, and a row of no
 * adapter costs nothing. Entry points and arguments: kernels.h.
 *
 * A projection's slot tensors hold every resident adapter: a [slots, shards * rank, in] and b
 * [slots, shards * rank, out] (B transposed: a rank row's output columns are contiguous). A
 * packed projection (q/k/v, gate/up) holds one block of `rank` rows per checkpoint projection,
 * and block p's B is zero outside its own output columns [columns[p], columns[p + 1]): the
 * expand reads only those, so a packed product costs what its separate ones would. A rank below
 * the slots' is zero-padded; a zero rank row's expand is skipped (it adds nothing).
 *
 * The paged form (S-LoRA's unified paging) reads the same rows where an adapter's one copy
 * lives, in its pages of the KV cache: a table of element offsets from the cache's base gives
 * each slot's A rows and B rows (block p's B row holds only its own columns), a negative offset a
 * padded rank's zero row, which is neither read nor computed. Both forms hand the row bodies one
 * pointer per rank row, so a row's sums are the same, in the same order, from either.
 *
 * For each adapted row r of slot s: low = scaling[s] * (x_r . A_s^T) into float32 (the shrink,
 * `shards * rank` dot products over `in`), then y_r[c] += sum_j low[j] * B_s[j][c] over the rank
 * rows j of c's block (the expand), in float32, rounded to the storage dtype once when added to
 * y. The rows are grouped by slot (a counting sort) and computed up to GROUP rows of one slot at
 * a time, each load of the adapter's weights shared by the group's rows (the adapters of a step
 * can hold as many bytes as the base model: their reads, not their arithmetic, are the cost). Each
 * (row, output) sum has its own accumulator, summed in one fixed order whatever the group, so a
 * row's result does not depend on the batch it is in, nor on the thread count.
 */
#include <stdlib.h>

#include "kernels.h"

#define WIDE 4 /* vectors of output columns per step of an expand */
#define GROUP 4 /* rows of one adapter computed together, sharing each load of its weights */
#define SHRINK_ROWS_J 2 /* rank rows per step of a shrink of GROUP rows (8 independent sums) */
#define SHRINK_ONE_J 8  /* rank rows per step of a shrink of one row */

static inline vf vload_f32(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}
/* p[0..VL) += v, rounded to the storage dtype once */
static inline void vadd_f32(float *p, vf v) {
    v += vload_f32(p);
    memcpy(p, &v, sizeof v);
}
static inline void vadd_bf16(uint16_t *p, vf v) {
    v += vload_bf16(p);
    const vu u = (vu)v;
    const vu rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16; /* to nearest even, NaN to 0x7FC0 */
    const vu16 h = __builtin_convertvector((vu)vselect(v != v, (vf)((vu){0} + 0x7FC0u), (vf)rounded), vu16);
    memcpy(p, &h, sizeof h);
}
/* the lanes' sum, folded in halves (lane i plus lane i + w, w = VL / 2, ..., 1) */
static inline float hsum(vf v) {
    float lanes[VL];
    memcpy(lanes, &v, sizeof lanes);
    for (int w = VL / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) lanes[i] += lanes[i + w];
    return lanes[0];
}

/* out[i] = hsum(v[i]) for 8 vectors, bit for bit: on AVX-512 the same folds of all 8 at once, two
 * vectors' halves side by side per add (a transposing reduction: 15 adds instead of 32) */
static inline void hsum8(const vf v[8], float out[8]) {
#if VL == 16
    vf half[4], quarter[2];
    for (int i = 0; i < 4; i++)
        half[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                          22, 23) +
                  __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                          29, 30, 31);
    for (int i = 0; i < 2; i++)
        quarter[i] = __builtin_shufflevector(half[2 * i], half[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                             19, 24, 25, 26, 27) +
                     __builtin_shufflevector(half[2 * i], half[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                             23, 28, 29, 30, 31);
    const vf pairs = __builtin_shufflevector(quarter[0], quarter[1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24,
                                             25, 28, 29) +
                     __builtin_shufflevector(quarter[0], quarter[1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26,
                                             27, 30, 31);
    const vf sums = __builtin_shufflevector(pairs, pairs, 0, 2, 4, 6, 8, 10, 12, 14, 0, 2, 4, 6, 8, 10, 12, 14) +
                    __builtin_shufflevector(pairs, pairs, 1, 3, 5, 7, 9, 11, 13, 15, 1, 3, 5, 7, 9, 11, 13, 15);
    memcpy(out, &sums, 8 * sizeof *out);
#else
    for (int i = 0; i < 8; i++) out[i] = hsum(v[i]);
#endif
}

/* rows with an adapter, grouped by slot in increasing order (order[0..count)), or -1 for a slot
 * outside [0, slots) */
static int64_t group_rows(const int32_t *row_slot, int64_t rows, int64_t slots, int64_t *order) {
    int64_t *start = calloc((size_t)slots + 1, sizeof *start);
    if (start == NULL) return -2;
    for (int64_t r = 0; r < rows; r++) {
        if (row_slot[r] >= slots) {
            free(start);
            return -1;
        }
        if (row_slot[r] >= 0) start[row_slot[r] + 1]++;
    }
    for (int64_t s = 0; s < slots; s++) start[s + 1] += start[s];
    const int64_t count = start[slots];
    for (int64_t r = 0; r < rows; r++)
        if (row_slot[r] >= 0) order[start[row_slot[r]]++] = r;
    free(start);
    return count;
}

#define T float
#define SUFFIX(name) name##_f32
#define VLOAD(p) vload_f32(p)
#define TO_F32(v) (v)
#define FROM_F32(v) (v)
#define VADD(p, v) vadd_f32(p, v)
#include "lora_bgmv_body.h"

#define T uint16_t
#define SUFFIX(name) name##_bf16
#define VLOAD(p) vload_bf16(p)
#define TO_F32(v) bf16_to_f32(v)
#define FROM_F32(v) f32_to_bf16(v)
#define VADD(p, v) vadd_bf16(p, v)
#include "lora_bgmv_body.h"
