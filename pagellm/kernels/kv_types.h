/* The KV cache's element types (`--kv-cache-dtype`): float32, float16, bfloat16 and the 8-bit floats e4m3 and e5m2,
 * read as floats (one at a time, or eight with AVX2) and written from floats, rounding to nearest even as torch
 * does. Included by paged_attention_cpu.c. */
#ifndef PAGELLM_KV_TYPES_H
#define PAGELLM_KV_TYPES_H

#include <math.h>
#include <stdint.h>
#include <string.h>

enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };
#define ALWAYS_INLINE static inline __attribute__((always_inline))
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define VECTOR_KV 1
#else
#define VECTOR_KV 0
#endif

static inline size_t kv_size(int kind) { return kind == KV_F32 ? 4 : kind >= KV_E4M3 ? 1 : 2; }

/* IEEE half <-> float, rounding to nearest even: F16C's instructions where the CPU has them, else the compiler's
 * _Float16 (GCC 12+, Clang). With neither the build fails and the attention layer uses its PyTorch path. */
#if defined(__F16C__)
#include <immintrin.h>
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
static inline uint16_t float_to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
#else
static inline float half_to_float(uint16_t h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}
static inline uint16_t float_to_half(float x) {
    const _Float16 h = (_Float16)x;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
}
#endif

/* bfloat16 is float32's upper half. */
static inline float bf16_to_float(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, sizeof x);
    return x;
}

/* Round to nearest even, as torch's .to(torch.bfloat16) does; NaN stays NaN. */
static inline uint16_t float_to_bf16(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

/* 8-bit floats (torch's float8_e4m3fn and float8_e5m2, unscaled as in vLLM without calibrated scales) widen
 * through half precision. e5m2 is a half's upper byte. e4m3's seven magnitude bits, placed where a half's exponent
 * and mantissa start, make a half 2^-8 times its value, sub-normals included; e4m3fn's NaN (0x7f) reads as 480. */
static inline uint16_t e4m3_as_scaled_half(uint8_t b) { return (uint16_t)(((b & 0x80) << 8) | ((b & 0x7f) << 7)); }
#define E4M3_HALF_SCALE 256.0f

/* Round to nearest even into an 8-bit float with `mbits` mantissa bits and exponent bias `bias`, saturating at its
 * largest finite value `max` (as vLLM's cache writes do; torch's e5m2 conversion would give infinity); NaN -> 0x7f
 * (torch's NaN for both types). Below the smallest normal, adding 2^(24 - bias - mbits) lets the FPU round at the
 * sub-normal spacing; above it, torch's integer rounding of the float's bits. */
static inline uint8_t float_to_fp8(float x, const int mbits, const int bias, const float max) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)(bits >> 24) & 0x80;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return sign | 0x7f;
    float a = fabsf(x);
    if (a >= max) a = max;
    memcpy(&bits, &a, sizeof bits);
    if (bits < (uint32_t)(128 - bias) << 23) { /* below the smallest normal, 2^(1 - bias) */
        const uint32_t magic_bits = (uint32_t)(127 + 24 - bias - mbits) << 23;
        float magic;
        memcpy(&magic, &magic_bits, sizeof magic);
        const float sum = a + magic;
        memcpy(&bits, &sum, sizeof bits);
        return sign | (uint8_t)(bits - magic_bits);
    }
    const int shift = 23 - mbits;
    bits += ((uint32_t)(bias - 127) << 23) + ((1u << (shift - 1)) - 1) + ((bits >> shift) & 1u);
    return sign | (uint8_t)(bits >> shift);
}
static inline uint8_t float_to_e4m3(float x) { return float_to_fp8(x, 3, 7, 448.0f); }
static inline uint8_t float_to_e5m2(float x) { return float_to_fp8(x, 2, 15, 57344.0f); }

/* Element i of a row of the cache, as a float. */
ALWAYS_INLINE float load1(const void *row, int64_t i, int kind) {
    if (kind == KV_E4M3) return half_to_float(e4m3_as_scaled_half(((const uint8_t *)row)[i])) * E4M3_HALF_SCALE;
    if (kind == KV_E5M2) return half_to_float((uint16_t)(((const uint8_t *)row)[i] << 8));
    if (kind == KV_F16) return half_to_float(((const uint16_t *)row)[i]);
    if (kind == KV_BF16) return bf16_to_float(((const uint16_t *)row)[i]);
    return ((const float *)row)[i];
}

#if VECTOR_KV
/* Elements i..i+7 of a row of the cache, as floats. */
ALWAYS_INLINE __m256 load8(const void *row, int64_t i, int kind) {
    if (kind == KV_E4M3 || kind == KV_E5M2) {
        const __m128i bytes = _mm_loadl_epi64((const __m128i *)((const uint8_t *)row + i));
        if (kind == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(bytes), 8));
        /* sign-extended, shifted by 7: the sign lands in bit 15 (and 14, cleared), the magnitude in bits 7-13 */
        const __m128i half = _mm_and_si128(_mm_slli_epi16(_mm_cvtepi8_epi16(bytes), 7), _mm_set1_epi16((short)0xbf80));
        return _mm256_mul_ps(_mm256_cvtph_ps(half), _mm256_set1_ps(E4M3_HALF_SCALE));
    }
    if (kind == KV_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + i)));
    if (kind == KV_BF16) {
        const __m128i half = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
    }
    return _mm256_loadu_ps((const float *)row + i);
}
#endif

/* One row of head_dim floats into the cache's type (round to nearest even; 8-bit floats saturate). */
static void store_row(void *dst, const float *src, int64_t n, int kind) {
    if (kind == KV_F32) {
        memcpy(dst, src, sizeof(float) * (size_t)n);
    } else if (kind == KV_F16) {
        uint16_t *h = dst;
        for (int64_t i = 0; i < n; i++) h[i] = float_to_half(src[i]);
    } else if (kind == KV_BF16) {
        uint16_t *h = dst;
        for (int64_t i = 0; i < n; i++) h[i] = float_to_bf16(src[i]);
    } else {
        uint8_t *b = dst;
        for (int64_t i = 0; i < n; i++) b[i] = kind == KV_E4M3 ? float_to_e4m3(src[i]) : float_to_e5m2(src[i]);
    }
}

#endif
