/* The small per-token operations of a decoder layer, float32, CPU: RMSNorm (optionally fused with the residual
 * add), SiLU-and-multiply, tanh-GELU-and-multiply (Gemma), and rotate-half RoPE applied in place. In PyTorch each is
 * several operators of a few microseconds of dispatch apiece, which at decode batch sizes cost more than the
 * arithmetic. Arithmetic follows the Hugging Face reference operation by operation (compiled with -ffp-contract=off: no
 * fused multiply-adds), except the order of the RMSNorm sum of squares, a vectorised exp in SiLU and GELU (within 2
 * ulp, as PyTorch's own) and GELU's tanh taken as the sigmoid it equals. Rows are spread over OpenMP threads when there
 * are many.
 */
#include <math.h>
#include <stdint.h>

#include "simd_exp.h"

/* out = weight * (x / sqrt(mean(x^2) + eps)), row by row. With residual != NULL: residual += x first, and the
 * norm is taken of the updated residual (vLLM's fused_add_rms_norm). x, residual and out: [rows, dim]. */
void rms_norm_f32(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                  float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 64)
    for (int64_t r = 0; r < rows; r++) {
        const float *in = x + r * dim;
        if (residual) {
            float *res = residual + r * dim;
            for (int64_t i = 0; i < dim; i++) res[i] += in[i];
            in = res;
        }
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < dim; i++) sum += in[i] * in[i];
        const float inv = 1.0f / sqrtf(sum / (float)dim + eps);
        float *o = out + r * dim;
        for (int64_t i = 0; i < dim; i++) o[i] = weight[i] * (in[i] * inv);
    }
}

/* out [rows, d] = silu(x[:, :d]) * x[:, d:], x [rows, 2d]. */
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * d, *up = gate + d;
        float *o = out + r * d;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= d; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_setzero_ps(), g));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < d; i++) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
}

/* out [rows, d] = gelu_tanh(x[:, :d]) * x[:, d:], x [rows, 2d]: PyTorch's gelu(approximate="tanh"),
 * 0.5 g (1 + tanh(u)) with u = sqrt(2/pi) (g + 0.044715 g^3), computed as g / (1 + exp(-2u)), the same function
 * without the cancellation of 1 + tanh(u) for negative g. */
void gelu_tanh_and_mul_f32(const float *x, float *out, int64_t rows, int64_t d, int nthreads) {
    const float beta = 2.0f * 0.7978845608028654f, kappa = 0.044715f; /* beta: 2 sqrt(2/pi) */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows > 16)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = x + r * 2 * d, *up = gate + d;
        float *o = out + r * d;
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        const __m256 one = _mm256_set1_ps(1.0f), minus_beta = _mm256_set1_ps(-beta), k = _mm256_set1_ps(kappa);
        for (; i + 8 <= d; i += 8) {
            const __m256 g = _mm256_loadu_ps(gate + i);
            const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
            const __m256 e = exp256_ps(_mm256_mul_ps(minus_beta, _mm256_add_ps(g, _mm256_mul_ps(k, cube))));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < d; i++) {
            const float g = gate[i];
            o[i] = g / (1.0f + expf(-beta * (g + kappa * (g * g * g)))) * up[i];
        }
    }
}

/* Rotate-half RoPE in place on `heads` heads of each token: head h of token t at x + t * token_stride + h * dim.
 * cos_table / sin_table rows are full width ([cos, cos] and [-sin, sin] per position), as RotaryEmbedding keeps
 * them: out1 = x1 * cos - x2 * sin, out2 = x2 * cos + x1 * sin. */
void rope_f32(float *x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t dim, const int64_t *positions,
              const float *cos_table, const float *sin_table) {
    const int64_t half = dim / 2;
    for (int64_t t = 0; t < tokens; t++) {
        const float *c = cos_table + positions[t] * dim, *s = sin_table + positions[t] * dim + half;
        for (int64_t h = 0; h < heads; h++) {
            float *x1 = x + t * token_stride + h * dim, *x2 = x1 + half;
            for (int64_t i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}
