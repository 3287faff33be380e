/*
 * simd.h's vector API for any other target (VL = 4), in GCC's vector extensions alone. Included
 * by simd.h alone, which chooses it.
 */

/* a bfloat16 is a float32's upper half: widen each lane and shift it there */
static inline vf vload_bf16(const uint16_t *p) {
    vu16 x;
    memcpy(&x, p, sizeof x);
    return (vf)(__builtin_convertvector(x, vi) << 16);
}

/* VL bytes zero- or sign-extended into int32 lanes */
static inline vi vload_u8_i32(const uint8_t *p) {
    vi x;
    for (int i = 0; i < VL; i++) x[i] = p[i];
    return x;
}
static inline vi vload_i8_i32(const int8_t *p) {
    vi x;
    for (int i = 0; i < VL; i++) x[i] = p[i];
    return x;
}
