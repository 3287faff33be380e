/*
 * Gemma's element-wise ops for one storage dtype, included by layer_ops_body.h (the names it is
 * given -- T, SUFFIX, LOAD, STORE, ROUND -- and the helpers of layer_ops.c are its): the row of
 * its RMSNorm, which layer_ops_body.h's norm entries run, and GeGLU. Entry points and
 * arguments: kernels.h.
 *
 * Gemma's RMSNorm multiplies by 1 + weight in float32 and rounds once (transformers'
 * Gemma2RMSNorm), where Llama's rounds the normed row before the weight; its MLP is GeGLU with
 * transformers' gelu_pytorch_tanh, torch's formula 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715
 * x^3))) in float32, rounded, then times up and rounded again.
 */

/* out = round(x * scale * (1 + w)) */
static inline void SUFFIX(offset_norm_row)(const float *x, T *out, const T *w, int64_t n, float eps) {
    const float scale = rms_scale(x, n, eps);
    for (int64_t i = 0; i < n; i += VL) {
        const int64_t m = chunk(n, i);
        STORE(out + i, ROUND(load_f32(x + i, m) * scale * (1.0f + LOAD(w + i, m))), m);
    }
}

void SUFFIX(gelu_tanh_and_mul)(const T *gate_up, T *out, int64_t rows, int64_t n) {
    const float beta = (float)(1.4142135623730951 * 1.1283791670955126 * 0.5), kappa = 0.044715f; /* torch's */
#pragma omp parallel for if (rows * n >= GRAIN)
    for (int64_t r = 0; r < rows; r++) {
        const T *gate = gate_up + r * 2 * n, *up = gate + n;
        for (int64_t i = 0; i < n; i += VL) {
            const int64_t m = chunk(n, i);
            const vf x = LOAD(gate + i, m);
            const vf inner = beta * (x + kappa * (x * x * x));
            vf t;
            for (int j = 0; j < VL; j++) t[j] = tanhf(inner[j]);
            const vf gelu = ROUND(0.5f * x * (1.0f + t));
            STORE(out + r * n + i, ROUND(gelu * LOAD(up + i, m)), m);
        }
    }
}
