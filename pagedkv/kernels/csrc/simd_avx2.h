/*
 * simd.h's vector API on AVX and AVX2 (VL = 8). Included by simd.h alone, which chooses it.
 */

/* a bfloat16 is a float32's upper half: widen each lane and shift it there */
static inline vf vload_bf16(const uint16_t *p) {
    vu16 x;
    memcpy(&x, p, sizeof x);
    return (vf)(__builtin_convertvector(x, vi) << 16);
}
