/*
 * lora_bgmv.c's functions for one storage dtype, included once per dtype (the `#include`-template
 * idiom). The includer defines, and this file undefines at its end: T, the element type;
 * SUFFIX(name), name with the dtype's suffix; VLOAD(p), VL elements at p as float32 lanes;
 * VADD(p, v), p[0..VL) += v rounded to T once; TO_F32(v) and FROM_F32(v), one element to float32
 * and back (rounded to nearest even).
 *
 * Every sum has one accumulator per (row, output) summed in one fixed order, whichever of the
 * constant-shaped blocks below computes it: a row's result is the same alone or in a group.
 */

/* low[r][j0 + q] = scaling * (x[r] . a_{j0 + q}) for nr rows and nj rank rows (a: rows of n_in) */
static inline __attribute__((always_inline)) void SUFFIX(dots)(const T *const *x, const T *a, int64_t j0, int nr,
                                                               int nj, int64_t n_in, float scaling,
                                                               float *const *low) {
    vf acc[GROUP][SHRINK_ONE_J];
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nj; q++) acc[r][q] = (vf){0};
    int64_t k = 0;
    for (; k + VL <= n_in; k += VL) {
        vf xv[GROUP];
        for (int r = 0; r < nr; r++) xv[r] = VLOAD(x[r] + k);
        for (int q = 0; q < nj; q++) {
            const vf w = VLOAD(a + (j0 + q) * n_in + k);
            for (int r = 0; r < nr; r++) acc[r][q] += w * xv[r];
        }
    }
    float sums[GROUP * SHRINK_ONE_J];
    if (nr * nj == 8) {
        vf flat[8];
        for (int r = 0; r < nr; r++)
            for (int q = 0; q < nj; q++) flat[r * nj + q] = acc[r][q];
        hsum8(flat, sums);
    } else {
        for (int r = 0; r < nr; r++)
            for (int q = 0; q < nj; q++) sums[r * nj + q] = hsum(acc[r][q]);
    }
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nj; q++) {
            float sum = sums[r * nj + q];
            for (int64_t t = k; t < n_in; t++) sum += TO_F32(x[r][t]) * TO_F32(a[(j0 + q) * n_in + t]);
            low[r][j0 + q] = sum * scaling;
        }
}

/* low[r][j] = scaling * (x[r] . a_j) for the R rank rows of a and nr <= GROUP rows */
static void SUFFIX(shrink)(const T *const *x, int nr, const T *a, float scaling, float *const *low, int64_t R,
                           int64_t n_in) {
    if (nr == GROUP) {
        int64_t j = 0;
        for (; j + SHRINK_ROWS_J <= R; j += SHRINK_ROWS_J) SUFFIX(dots)(x, a, j, GROUP, SHRINK_ROWS_J, n_in, scaling, low);
        for (; j < R; j++) SUFFIX(dots)(x, a, j, GROUP, 1, n_in, scaling, low);
        return;
    }
    for (int r = 0; r < nr; r++) {
        int64_t j = 0;
        for (; j + SHRINK_ONE_J <= R; j += SHRINK_ONE_J) SUFFIX(dots)(x + r, a, j, 1, SHRINK_ONE_J, n_in, scaling, low + r);
        for (; j < R; j++) SUFFIX(dots)(x + r, a, j, 1, 1, n_in, scaling, low + r);
    }
}

/* y[r][c + i] += sum_j l[r][j] * block_j[c + i] for nr rows and nv vectors of columns; a rank row
 * whose l is zero in every row (a padded rank) is skipped */
static inline __attribute__((always_inline)) void SUFFIX(expand_cols)(const float *const *l, const T *block,
                                                                  T *const *y, int nr, int nv, int64_t c,
                                                                  int64_t rank, int64_t n_out) {
    vf acc[GROUP][WIDE];
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nv; q++) acc[r][q] = (vf){0};
    for (int64_t j = 0; j < rank; j++) {
        int used = 0;
        for (int r = 0; r < nr; r++) used |= l[r][j] != 0.0f;
        if (!used) continue;
        for (int q = 0; q < nv; q++) {
            const vf w = VLOAD(block + j * n_out + c + q * VL);
            for (int r = 0; r < nr; r++) acc[r][q] += l[r][j] * w;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nv; q++) VADD(y[r] + c + q * VL, acc[r][q]);
}

/* y[r][c] += sum_j low[r][j] * b_j[c], for each block p of `rank` rows over its columns
 * [columns[p], columns[p + 1]) only */
static void SUFFIX(expand)(float *const *low, int nr, const T *b, const int64_t *columns, T *const *y,
                           int64_t rank, int64_t shards, int64_t n_out) {
    for (int64_t p = 0; p < shards; p++) {
        const float *l[GROUP];
        for (int r = 0; r < nr; r++) l[r] = low[r] + p * rank;
        const T *block = b + p * rank * n_out;
        const int64_t end = columns[p + 1];
        int64_t c = columns[p];
        if (nr == GROUP) {
            for (; c + WIDE * VL <= end; c += WIDE * VL) SUFFIX(expand_cols)(l, block, y, GROUP, WIDE, c, rank, n_out);
            for (; c + VL <= end; c += VL) SUFFIX(expand_cols)(l, block, y, GROUP, 1, c, rank, n_out);
        } else {
            for (int r = 0; r < nr; r++) {
                int64_t cr = c;
                for (; cr + WIDE * VL <= end; cr += WIDE * VL) SUFFIX(expand_cols)(l + r, block, y + r, 1, WIDE, cr, rank, n_out);
                for (; cr + VL <= end; cr += VL) SUFFIX(expand_cols)(l + r, block, y + r, 1, 1, cr, rank, n_out);
            }
            c += (end - c) / VL * VL;
        }
        for (; c < end; c++)
            for (int r = 0; r < nr; r++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < rank; j++)
                    if (l[r][j] != 0.0f) acc += l[r][j] * TO_F32(block[j * n_out + c]);
                y[r][c] = FROM_F32(TO_F32(y[r][c]) + acc);
            }
    }
}

LORA_BGMV(SUFFIX(lora_bgmv), T) {
    if (rows <= 0) return 0;
    const int64_t R = shards * rank;
    int64_t *order = malloc(sizeof *order * (size_t)(2 * rows + 1));
    if (order == NULL) return 1;
    const int64_t count = group_rows(row_slot, rows, slots, order);
    if (count < 0) {
        free(order);
        return count == -1 ? 2 : 1;
    }
    /* groups of up to GROUP consecutive rows of one slot: group g is order[first[g]..first[g + 1]) */
    int64_t *first = order + rows, groups = 0;
    for (int64_t i = 0; i < count; i++)
        if (i == 0 || row_slot[order[i]] != row_slot[order[i - 1]] || i - first[groups - 1] == GROUP)
            first[groups++] = i;
    first[groups] = count;
#pragma omp parallel for schedule(static) if (count * R * (n_in + n_out) >= 65536)
    for (int64_t g = 0; g < groups; g++) {
        const int nr = (int)(first[g + 1] - first[g]);
        const int64_t s = row_slot[order[first[g]]];
        const T *x_rows[GROUP];
        T *y_rows[GROUP];
        float low_rows[GROUP][R];
        float *low[GROUP];
        for (int r = 0; r < nr; r++) {
            x_rows[r] = x + order[first[g] + r] * n_in;
            y_rows[r] = y + order[first[g] + r] * n_out;
            low[r] = low_rows[r];
        }
        SUFFIX(shrink)(x_rows, nr, a + s * R * n_in, scaling[s], low, R, n_in);
        SUFFIX(expand)(low, nr, b + s * R * n_out, columns, y_rows, rank, shards, n_out);
    }
    free(order);
    return 0;
}

#undef T
#undef SUFFIX
#undef VLOAD
#undef VADD
#undef TO_F32
#undef FROM_F32
