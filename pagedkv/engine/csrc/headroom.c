/*
 * The decode-headroom peak of pagedkv/engine/headroom.py (peak_new_blocks), in C.
 *
 * Why: admission asks it for every request it considers while the pool is full, right after
 * the model's step has pushed NumPy out of the caches; its dozen whole-array calls on a few
 * dozen sequences then cost ~80-140 us a call in the engine loop (36 us warm). The same
 * arithmetic as one double loop over the sequences takes a few microseconds. NumPy remains the
 * fallback where no C compiler is found; the tests hold both to a step-by-step replay.
 *
 * rows: n x 6 int64, per sequence (slots, remaining, delay, held, copies, copy_on_write), all
 * >= 0 (see Growth). At each step k that ends some sequence (delay + remaining > 0), the
 * sequences still alive (delay + remaining >= k) hold copies * (blocks for slots + appended -
 * blocks for slots) + copy_on_write (once they appended anything) more blocks than now, with
 * appended = clamp(k - delay, 0, remaining); the others have given back their held blocks.
 * Returns the largest such total, and 0 when none is positive.
 */
#include <stdint.h>

/* Blocks for `tokens` slots: a shift for the usual power-of-two block sizes (an integer
 * division costs ~15-40 cycles here, and this runs n * n of them). */
static inline int64_t blocks_for(int64_t tokens, int64_t block_size, int shift) {
    return shift >= 0 ? (tokens + block_size - 1) >> shift : (tokens + block_size - 1) / block_size;
}

int64_t headroom_peak_new_blocks(const int64_t *rows, int64_t n, int64_t block_size) {
    int shift = -1;
    for (int s = 0; s < 63; s++)
        if ((int64_t)1 << s == block_size) shift = s;
    int64_t peak = 0;
    for (int64_t j = 0; j < n; j++) {
        const int64_t k = rows[6 * j + 2] + rows[6 * j + 1];
        if (k <= 0) continue;
        int64_t total = 0;
        for (int64_t i = 0; i < n; i++) {
            const int64_t *g = rows + 6 * i;
            const int64_t slots = g[0], remaining = g[1], delay = g[2];
            if (delay + remaining < k) {
                total -= g[3];
                continue;
            }
            int64_t appended = k - delay;
            if (appended <= 0) continue;
            if (appended > remaining) appended = remaining;
            const int64_t grown = blocks_for(slots + appended, block_size, shift) - blocks_for(slots, block_size, shift);
            total += g[4] * grown + g[5];
        }
        if (total > peak) peak = total;
    }
    return peak;
}
