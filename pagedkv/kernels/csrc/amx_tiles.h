/*
 * What every AMX product shares (gemm_amx.h's dense one, quant_amx.h's quantized one): whether
 * this process may use the tiles, and the one tile shape they all run with, every tile 16 rows of
 * 64 bytes (an A tile 16 rows of 32 bfloat16 k, a B tile 16 k pairs of 16 columns, a C tile 16 x
 * 16 float32 sums). Included only where simd.h's GEMM_AMX is 1.
 */
#ifndef PAGEDKV_AMX_TILES_H
#define PAGEDKV_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_K 32   /* k per A tile row: 16 pairs of bfloat16, 64 bytes */
#define AMX_N 16   /* columns per B tile */

/* whether this process may use the AMX tiles: asked of the kernel once (arch_prctl's
 * ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA), the answer kept; PAGEDKV_TILED_AMX=0 in the
 * environment keeps every product off the tiles (dense ones on the AVX512-BF16 loop, quantized ones
 * on their float32 loop: those bits, or an A/B of the two) */
static int amx_usable(void) {
    static int state = -1; /* -1: not asked yet; a race asks twice, with the same answer */
    int usable = __atomic_load_n(&state, __ATOMIC_ACQUIRE);
    if (usable < 0) {
        const char *off = getenv("PAGEDKV_TILED_AMX");
        usable = !(off != NULL && strcmp(off, "0") == 0) &&
                 syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
        __atomic_store_n(&state, usable, __ATOMIC_RELEASE);
    }
    return usable;
}

/* every tile 16 rows of 64 bytes (the callers name their own use of tmm0-7) */
static void amx_configure(void) {
    struct {
        uint8_t palette, start_row, reserved[14];
        uint16_t colsb[16];
        uint8_t rows[16];
    } config = {.palette = 1};
    for (int i = 0; i < 8; i++) config.colsb[i] = 64, config.rows[i] = 16;
    _tile_loadconfig(&config);
}

#endif
