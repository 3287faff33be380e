/*
 * lora_bgmv.c's functions for one storage dtype, included once per dtype (the `#include`-template
 * idiom). The includer defines, and this file undefines at its end: T, the element type;
 * SUFFIX(name), name with the dtype's suffix; VLOAD(p), VL elements at p as float32 lanes;
 * VADD(p, v), p[0..VL) += v rounded to T once; TO_F32(v) and FROM_F32(v), one element to float32
 * and back (rounded to nearest even).
 *
 * The adapter's rank rows reach these functions as one pointer per row, whichever form holds
 * them (a slot tensor's rows, or rows at offsets in the KV cache's pages). Every sum has one
 * accumulator per (row, output) summed in one fixed order, whichever of the constant-shaped
 * blocks below computes it: a row's result is the same alone or in a group, and the same from
 * either form.
 */

/* low[r][dst[q]] = scaling * (x[r] . arow[q]) for nr rows and nj rank rows of n_in elements */
static inline __attribute__((always_inline)) void SUFFIX(dots)(const T *const *x, const T *const *arow,
                                                               const int64_t *dst, int nr, int nj, int64_t n_in,
                                                               float scaling, float *const *low) {
    vf acc[GROUP][SHRINK_ONE_J];
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nj; q++) acc[r][q] = (vf){0};
    int64_t k = 0;
    for (; k + VL <= n_in; k += VL) {
        vf xv[GROUP];
        for (int r = 0; r < nr; r++) xv[r] = VLOAD(x[r] + k);
        for (int q = 0; q < nj; q++) {
            const vf w = VLOAD(arow[q] + k);
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
            for (int64_t t = k; t < n_in; t++) sum += TO_F32(x[r][t]) * TO_F32(arow[q][t]);
            low[r][dst[q]] = sum * scaling;
        }
}

/* low[r][dst[j]] = scaling * (x[r] . arow[j]) for the n rank rows arow and nr <= GROUP rows */
static void SUFFIX(shrink)(const T *const *x, int nr, const T *const *arow, const int64_t *dst, int64_t n,
                           float scaling, float *const *low, int64_t n_in) {
    if (nr == GROUP) {
        int64_t j = 0;
        for (; j + SHRINK_ROWS_J <= n; j += SHRINK_ROWS_J)
            SUFFIX(dots)(x, arow + j, dst + j, GROUP, SHRINK_ROWS_J, n_in, scaling, low);
        for (; j < n; j++) SUFFIX(dots)(x, arow + j, dst + j, GROUP, 1, n_in, scaling, low);
        return;
    }
    for (int r = 0; r < nr; r++) {
        int64_t j = 0;
        for (; j + SHRINK_ONE_J <= n; j += SHRINK_ONE_J)
            SUFFIX(dots)(x + r, arow + j, dst + j, 1, SHRINK_ONE_J, n_in, scaling, low + r);
        for (; j < n; j++) SUFFIX(dots)(x + r, arow + j, dst + j, 1, 1, n_in, scaling, low + r);
    }
}

/* y[r][c + i] += sum_j l[r][j] * brow[j][c + i] for nr rows and nv vectors of columns (y[r]
 * already at the block's first column); a rank row whose l is zero in every row (a padded rank)
 * is skipped, and never read */
static inline __attribute__((always_inline)) void SUFFIX(expand_cols)(const float *const *l,
                                                                  const T *const *brow, T *const *y, int nr,
                                                                  int nv, int64_t c, int64_t rank) {
    vf acc[GROUP][WIDE];
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nv; q++) acc[r][q] = (vf){0};
    for (int64_t j = 0; j < rank; j++) {
        int used = 0;
        for (int r = 0; r < nr; r++) used |= l[r][j] != 0.0f;
        if (!used) continue;
        for (int q = 0; q < nv; q++) {
            const vf w = VLOAD(brow[j] + c + q * VL);
            for (int r = 0; r < nr; r++) acc[r][q] += l[r][j] * w;
        }
    }
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < nv; q++) VADD(y[r] + c + q * VL, acc[r][q]);
}

/* y[r][c] += sum_j low[r][j] * B_j[c], for each block p of `rank` rows over its columns
 * [columns[p], columns[p + 1]) only; brow[p * rank + j] is block p's row j from its first column */
static void SUFFIX(expand)(float *const *low, int nr, const T *const *brow, const int64_t *columns,
                           T *const *y_rows, int64_t rank, int64_t shards) {
    for (int64_t p = 0; p < shards; p++) {
        const float *l[GROUP];
        T *y[GROUP];
        for (int r = 0; r < nr; r++) {
            l[r] = low[r] + p * rank;
            y[r] = y_rows[r] + columns[p];
        }
        const T *const *block = brow + p * rank;
        const int64_t width = columns[p + 1] - columns[p];
        int64_t c = 0;
        if (nr == GROUP) {
            for (; c + WIDE * VL <= width; c += WIDE * VL) SUFFIX(expand_cols)(l, block, y, GROUP, WIDE, c, rank);
            for (; c + VL <= width; c += VL) SUFFIX(expand_cols)(l, block, y, GROUP, 1, c, rank);
        } else {
            for (int r = 0; r < nr; r++) {
                int64_t cr = c;
                for (; cr + WIDE * VL <= width; cr += WIDE * VL) SUFFIX(expand_cols)(l + r, block, y + r, 1, WIDE, cr, rank);
                for (; cr + VL <= width; cr += VL) SUFFIX(expand_cols)(l + r, block, y + r, 1, 1, cr, rank);
            }
            c += (width - c) / VL * VL;
        }
        for (; c < width; c++)
            for (int r = 0; r < nr; r++) {
                float acc = 0.0f;
                for (int64_t j = 0; j < rank; j++)
                    if (l[r][j] != 0.0f) acc += l[r][j] * TO_F32(block[j][c]);
                y[r][c] = FROM_F32(TO_F32(y[r][c]) + acc);
            }
    }
}

/* Both forms: rows grouped by slot, up to GROUP rows of one slot at a time. Slot form (offsets
 * NULL): slot s's rank rows are a + (s * R + j) * n_in and b + (s * R + j) * n_out. Paged form:
 * base + offsets[(s * 2 + 0) * R + j] (A) and base + offsets[(s * 2 + 1) * R + j] (B, from its
 * block's first column), a rank row with a negative offset a zero row (not read). */
static int SUFFIX(bgmv)(const T *x, const T *a, const T *b, const T *base, const int64_t *offsets,
                        const int32_t *row_slot, const float *scaling, const int64_t *columns, T *y, int64_t rows,
                        int64_t n_in, int64_t n_out, int64_t slots, int64_t rank, int64_t shards) {
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
            for (int64_t j = 0; j < R; j++) low_rows[r][j] = 0.0f;
        }
        const T *arow[R], *brow[R];
        int64_t dst[R], n = 0;
        for (int64_t j = 0; j < R; j++) {
            if (offsets == NULL) {
                arow[n] = a + (s * R + j) * n_in;
                brow[j] = b + (s * R + j) * n_out + columns[j / rank];
            } else {
                const int64_t at = offsets[s * 2 * R + j], bt = offsets[(s * 2 + 1) * R + j];
                if (at < 0 || bt < 0) {
                    brow[j] = NULL;
                    continue;
                }
                arow[n] = base + at;
                brow[j] = base + bt;
            }
            dst[n++] = j;
        }
        SUFFIX(shrink)(x_rows, nr, arow, dst, n, scaling[s], low, n_in);
        SUFFIX(expand)(low, nr, brow, columns, y_rows, rank, shards);
    }
    free(order);
    return 0;
}

LORA_BGMV(SUFFIX(lora_bgmv), T) {
    return SUFFIX(bgmv)(x, a, b, NULL, NULL, row_slot, scaling, columns, y, rows, n_in, n_out, slots, rank, shards);
}

LORA_BGMV_PAGED(SUFFIX(lora_bgmv_paged), T) {
    return SUFFIX(bgmv)(x, NULL, NULL, base, offsets, row_slot, scaling, columns, y, rows, n_in, n_out, slots,
                        rank, shards);
}

#undef T
#undef SUFFIX
#undef VLOAD
#undef VADD
#undef TO_F32
#undef FROM_F32
