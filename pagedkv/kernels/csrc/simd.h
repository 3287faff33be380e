/*
 * The vector API every kernel source shares, for the instruction set the library is compiled
 * for: chosen here, and nowhere else, from the compiler's target macros (the library is built
 * with -march=native on the machine that runs it, so this is the machine's own set).
 *
 *   VL           float32 lanes per vector: 16 (AVX-512), 8 (AVX, AVX2), 4 (anything else)
 *   vf, vi, vu, vu16, vh   vectors of VL float32, int32, uint32, bfloat16 bits, _Float16
 *   vload_bf16(p)  VL bfloat16 elements at p widened to float32 lanes: the instruction set's own
 *                file, simd_avx512.h, simd_avx2.h or simd_portable.h, defines it
 *   vload_u8_i32(p), vload_i8_i32(p)  VL unsigned or signed bytes at p widened to int32 lanes (the
 *                same files)
 *   vpick16(table, index)  where SIMD_PICK16 is 1 (AVX-512): lane i of table at index[i] % 16, one
 *                instruction (the other sets would need two and a blend: they leave it undefined)
 *   vpick32(low, high, index)  where SIMD_PICK16 is 1: lane i of the 32 entries low then high at
 *                index[i] % 32, one instruction; vwith_bit4(index, lanes) index with 16 or'ed into
 *                the lanes whose bit is set in the 16-bit lanes
 *   GEMM_AVX512, GEMM_AVX512_BF16, GEMM_AMX, GEMM_AVX2 (1 or 0)  which of the tiled GEMM's inner
 *                loops the target can run (gemm_avx512.h, gemm_avx512bf16.h, gemm_amx.h, gemm_avx2.h;
 *                gemm_portable.h always)
 *
 * The rest is written once with GCC's vector extensions, which lower to the target's registers.
 */
#ifndef PAGEDKV_SIMD_H
#define PAGEDKV_SIMD_H

#include <stdint.h>
#include <string.h>

/* float32 lanes per vector, and the file of the instruction set's own vector code */
#if defined(__AVX512F__)
#define VL 16
#define SIMD_HEADER "simd_avx512.h"
#elif defined(__AVX__)
#define VL 8
#define SIMD_HEADER "simd_avx2.h"
#else
#define VL 4
#define SIMD_HEADER "simd_portable.h"
#endif

/* the tiled GEMM's loops the target can run (tiled_gemm.c includes their files) */
#if defined(__AVX512F__)
#define GEMM_AVX512 1
#else
#define GEMM_AVX512 0
#endif
#if defined(__AVX512BF16__)
#define GEMM_AVX512_BF16 1
#else
#define GEMM_AVX512_BF16 0
#endif
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__) /* arch_prctl */
#define GEMM_AMX 1
#else
#define GEMM_AMX 0
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define GEMM_AVX2 1
#else
#define GEMM_AVX2 0
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));
typedef uint32_t vu __attribute__((vector_size(VL * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VL * 2)));
#ifndef PAGEDKV_NO_F16
typedef _Float16 vh __attribute__((vector_size(VL * 2)));
#endif

/* a where mask is set, else b */
static inline vf vselect(vi mask, vf a, vf b) { return (vf)(((vi)a & mask) | ((vi)b & ~mask)); }

/* exp(x) = 2^n * p(r), Cephes-style: returns p(r), about 1 ulp for |r| <= ln2 / 2, and n =
 * round(x / ln2); the caller clamps x to its range first and scales by 2^n as that range allows.
 * Its arithmetic rounds as the including source compiles it (layer_ops.c: no fused multiply-add) */
static inline vf exp_reduced(vf x, vf *n_out) {
    const vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    vf y = 1.9875691500e-4f * r + 1.3981999507e-3f;
    y = y * r + 8.3334519073e-3f;
    y = y * r + 4.1665795894e-2f;
    y = y * r + 1.6666665459e-1f;
    y = y * r + 5.0000001201e-1f;
    y = y * r * r + r + 1.0f;
    *n_out = n;
    return y;
}

/* bfloat16 to float32 is exact: a bfloat16 is a float32's upper half */
static inline float bf16_to_f32(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* float32 to bfloat16, rounded to nearest even, NaN to 0x7FC0: c10::BFloat16's conversion */
static inline uint16_t f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if (x != x) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#include SIMD_HEADER

#ifndef SIMD_PICK16
#define SIMD_PICK16 0
#endif

#endif
