/*
 * lora_bgmv.c's functions for one storage dtype, included once per dtype (the `#include`-template
 * idiom). The includer defines, and this file undefines at its end: T, the element type;
 * SUFFIX(name), name with the dtype's suffix; VLOAD(p), VL elements at p as float32 lanes;
 * TO_F32(v) and FROM_F32(v), one element to float32 and back (rounded to nearest even).
 */

/* low[j] = scaling * (x . a_j) for the R rows a_j of a, each n_in long */
static void SUFFIX(shrink)(const T *x, const T *a, float scaling, float *low, int64_t R, int64_t n_in) {
    for (int64_t j = 0; j < R; j++) {
        const T *w = a + j * n_in;
        vf acc[WIDE];
        for (int q = 0; q < WIDE; q++) acc[q] = (vf){0};
        int64_t k = 0;
        for (; k + WIDE * VL <= n_in; k += WIDE * VL)
            for (int q = 0; q < WIDE; q++) acc[q] += VLOAD(x + k + q * VL) * VLOAD(w + k + q * VL);
        for (; k + VL <= n_in; k += VL) acc[0] += VLOAD(x + k) * VLOAD(w + k);
        float sum = hsum((acc[0] + acc[1]) + (acc[2] + acc[3]));
        for (; k < n_in; k++) sum += TO_F32(x[k]) * TO_F32(w[k]);
        low[j] = sum * scaling;
    }
}

/* y[c] += sum_j low[j] * b_j[c], for each block p of `rank` rows over its columns
 * [columns[p], columns[p + 1]) only; a zero low[j] (a padded rank row) is skipped */
static void SUFFIX(expand)(const float *low, const T *b, const int64_t *columns, T *y, int64_t rank,
                           int64_t shards, int64_t n_out) {
    for (int64_t p = 0; p < shards; p++) {
        const float *l = low + p * rank;
        const T *block = b + p * rank * n_out;
        const int64_t end = columns[p + 1];
        int64_t c = columns[p];
        for (; c + WIDE * VL <= end; c += WIDE * VL) {
            vf acc[WIDE];
            for (int q = 0; q < WIDE; q++) acc[q] = (vf){0};
            for (int64_t j = 0; j < rank; j++) {
                if (l[j] == 0.0f) continue;
                const T *row = block + j * n_out + c;
                for (int q = 0; q < WIDE; q++) acc[q] += l[j] * VLOAD(row + q * VL);
            }
            for (int q = 0; q < WIDE; q++)
                for (int i = 0; i < VL; i++) y[c + q * VL + i] = FROM_F32(TO_F32(y[c + q * VL + i]) + acc[q][i]);
        }
        for (; c + VL <= end; c += VL) {
            vf acc = {0};
            for (int64_t j = 0; j < rank; j++)
                if (l[j] != 0.0f) acc += l[j] * VLOAD(block + j * n_out + c);
            for (int i = 0; i < VL; i++) y[c + i] = FROM_F32(TO_F32(y[c + i]) + acc[i]);
        }
        for (; c < end; c++) {
            float acc = 0.0f;
            for (int64_t j = 0; j < rank; j++)
                if (l[j] != 0.0f) acc += l[j] * TO_F32(block[j * n_out + c]);
            y[c] = FROM_F32(TO_F32(y[c]) + acc);
        }
    }
}

LORA_BGMV(SUFFIX(lora_bgmv), T) {
    if (rows <= 0) return 0;
    const int64_t R = shards * rank;
    int64_t *order = malloc(sizeof *order * (size_t)rows);
    if (order == NULL) return 1;
    const int64_t count = group_rows(row_slot, rows, slots, order);
    if (count < 0) {
        free(order);
        return count == -1 ? 2 : 1;
    }
#pragma omp parallel for schedule(static) if (count * R * (n_in + n_out) >= 65536)
    for (int64_t i = 0; i < count; i++) {
        const int64_t r = order[i], s = row_slot[r];
        float low[R];
        SUFFIX(shrink)(x + r * n_in, a + s * R * n_in, scaling[s], low, R, n_in);
        SUFFIX(expand)(low, b + s * R * n_out, columns, y + r * n_out, rank, shards, n_out);
    }
    free(order);
    return 0;
}

#undef T
#undef SUFFIX
#undef VLOAD
#undef TO_F32
#undef FROM_F32
