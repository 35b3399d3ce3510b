/* ggml's K-quants as the packed-weight kernel reads them: super-blocks of 256 weights, stored plain (no
 * interleaving), decoded bit for bit as ggml dequantizes (scalar, and AVX2 under ggml_blocks.h's target attribute),
 * plus their levels as bytes for integer dot products.
 *
 * - Q4_K, Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums for eight sub-blocks of 32, (Q5_K) 32 bytes of
 *   fifth bits, 128 bytes of nibbles; weight = (d sc) q - (dmin m).
 * - Q6_K: 128 bytes of low nibbles, 64 of bit pairs, 16 int8 scales for sub-blocks of 16, d; (d sc) (q - 32).
 * - Q3_K: 32 bytes of high bits (hmask), 64 of bit pairs, 12 bytes of 6-bit scales for sub-blocks of 16, d;
 *   weight = (d (sc - 32)) (q - 4 (high bit clear)).
 * - Q2_K: 16 bytes of 4-bit scales and minimums for sub-blocks of 16, 64 of bit pairs, d, dmin;
 *   weight = (d sc) q - (dmin m).
 * - IQ4_XS: d, 16 bits and 4 bytes of 6-bit scales for eight sub-blocks of 32 (two high bits, a nibble each),
 *   128 bytes of nibbles laid out as IQ4_NL's; weight = (d (sc - 32)) level[q] (ggml_blocks.h's iq4_levels).
 * Q2_K, Q3_K and Q6_K share a shape: 128-weight halves whose quarters j take bits of the same 32 (or 64) bytes.
 */
#ifndef PAGELLM_GGML_K_QUANTS_H
#define PAGELLM_GGML_K_QUANTS_H
#include "ggml_blocks.h"

static inline int64_t super_block_bytes(int t) {
    return t == T_Q2_K ? 84 : t == T_Q3_K ? 110 : t == T_Q4_K ? 144 : t == T_Q5_K ? 176 : t == T_IQ4_XS ? 136 : 210;
}
static inline int is_k_nibble_type(int t) { return t == T_Q4_K || t == T_Q5_K; } /* scales and minimums */
static inline int k_nibbles_at(int t) { return t == T_Q5_K ? 48 : 16; } /* where Q4_K / Q5_K keep their nibbles */

/* Q4_K: scale and minimum (6 bits each) of sub-block j (0..7) from the super-block's 12 packed bytes. */
static inline void q4k_scale_min(const uint8_t *scales, int j, int *sc, int *m) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *m = scales[j + 4] & 63;
    } else {
        *sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        *m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
    }
}

/* Q3_K: the sixteen 6-bit sub-block scales less 32, from the 12 packed bytes at sb + 96 (ggml's word shuffle). */
static inline void q3k_scales(const uint8_t *sb, int8_t scales[16]) {
    uint32_t aux[4];
    memcpy(aux, sb + 96, 12);
    const uint32_t tmp = aux[2], low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    aux[2] = ((aux[0] >> 4) & low4) | (((tmp >> 4) & top2) << 4);
    aux[3] = ((aux[1] >> 4) & low4) | (((tmp >> 6) & top2) << 4);
    aux[0] = (aux[0] & low4) | ((tmp & top2) << 4);
    aux[1] = (aux[1] & low4) | (((tmp >> 2) & top2) << 4);
    memcpy(scales, aux, 16);
    for (int j = 0; j < 16; j++) scales[j] = (int8_t)(scales[j] - 32);
}

/* IQ4_XS: the scale of sub-block j (0..7) less 32: a nibble of the 4 bytes at sb + 4, two bits of the word at 2. */
static inline int iq4xs_scale(const uint8_t *sb, int j) {
    return (((sb[4 + j / 2] >> (4 * (j & 1))) & 0x0f) | (((load_u16(sb + 2) >> (2 * j)) & 3) << 4)) - 32;
}

/* A K-quant super-block as 256 floats, ggml's arithmetic: Q4_K and Q5_K (d sc) q - (dmin m), Q6_K (d sc) (q - 32),
 * Q3_K (d sc) q with q = (two bits) - 4 unless the high bit is set, IQ4_XS (d sc) level[q]. */
static void dequant_super_block_scalar(int type, const uint8_t *sb, float *dst) {
    if (type == T_IQ4_XS) {
        const float d = fp16_to_fp32(load_u16(sb));
        for (int j = 0; j < 8; j++, dst += 32) {
            const float dl = d * (float)iq4xs_scale(sb, j);
            const uint8_t *q = sb + 8 + 16 * j;
            for (int l = 0; l < 16; l++) {
                dst[l] = dl * (float)iq4_levels[q[l] & 0x0f];
                dst[l + 16] = dl * (float)iq4_levels[q[l] >> 4];
            }
        }
        return;
    }
    if (type == T_Q2_K) { /* as Q3_K: halves n, quarters j of bit pairs, two sub-blocks of 16 each */
        const float d = fp16_to_fp32(load_u16(sb + 80)), dmin = fp16_to_fp32(load_u16(sb + 82));
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++, dst += 16) {
                    const uint8_t packed = sb[8 * n + 2 * j + h], *q = sb + 16 + 32 * n + 16 * h;
                    const float dl = d * (float)(packed & 0x0f), ml = dmin * (float)(packed >> 4);
                    for (int l = 0; l < 16; l++) dst[l] = dl * (float)((q[l] >> (2 * j)) & 3) - ml;
                }
        return;
    }
    if (type == T_Q3_K) { /* 128-weight halves n; in each, quarter j takes bits 2j, 2j + 1 of 32 bytes */
        int8_t scales[16];
        q3k_scales(sb, scales);
        const float d = fp16_to_fp32(load_u16(sb + 108));
        for (int n = 0; n < 2; n++)
            for (int j = 0; j < 4; j++)
                for (int h = 0; h < 2; h++, dst += 16) { /* two sub-blocks of 16 */
                    const float dl = d * (float)scales[8 * n + 2 * j + h];
                    const uint8_t *q = sb + 32 + 32 * n + 16 * h, *high = sb + 16 * h;
                    for (int l = 0; l < 16; l++)
                        dst[l] = dl * (float)(((q[l] >> (2 * j)) & 3) - ((high[l] >> (4 * n + j)) & 1 ? 0 : 4));
                }
        return;
    }
    if (is_k_nibble_type(type)) {
        const float d = fp16_to_fp32(load_u16(sb)), dmin = fp16_to_fp32(load_u16(sb + 2));
        const uint8_t *qs = sb + k_nibbles_at(type), *qh = sb + 16;
        for (int j = 0; j < 8; j++) { /* sub-blocks 2c and 2c + 1 share 32 bytes: low, then high nibbles */
            int sc, m;
            q4k_scale_min(sb + 4, j, &sc, &m);
            const float d1 = d * (float)sc, m1 = dmin * (float)m;
            const uint8_t *q = qs + 32 * (j / 2);
            for (int l = 0; l < 32; l++) {
                const int fifth = type == T_Q5_K ? ((qh[l] >> j) & 1) << 4 : 0; /* Q5_K: bit j of qh[l] */
                dst[32 * j + l] = d1 * (float)(((j & 1) ? q[l] >> 4 : q[l] & 0x0f) | fifth) - m1;
            }
        }
        return;
    }
    const uint8_t *ql = sb, *qh = sb + 128;
    const int8_t *scales = (const int8_t *)(sb + 192);
    const float d = fp16_to_fp32(load_u16(sb + 208));
    for (int half = 0; half < 2; half++, ql += 64, qh += 32, scales += 8, dst += 128)
        for (int t = 0; t < 4; t++) /* 32 weights: low or high nibbles of ql, bits 2t, 2t + 1 of qh */
            for (int l = 0; l < 32; l++) {
                const int low = (t < 2 ? ql[l + 32 * t] & 0x0f : ql[l + 32 * (t - 2)] >> 4);
                const int q = (low | (((qh[l] >> (2 * t)) & 3) << 4)) - 32;
                dst[32 * t + l] = d * (float)scales[2 * t + l / 16] * (float)q;
            }
}

#if HAVE_X86
/* Bit b (0..7) of every lane of h, moved to bit 4 (the value 16 or 0). */
AVX2 static inline __attribute__((always_inline)) __m256i bit_at_4(__m256i h, const int b) {
    const __m256i moved = b <= 4 ? _mm256_slli_epi32(h, 4 - b) : _mm256_srli_epi32(h, b - 4);
    return _mm256_and_si256(moved, _mm256_set1_epi32(16));
}

/* Q4_K / Q5_K sub-blocks 2c and 2c + 1 of super-block sb: their 32 levels each, the low and the high nibbles of
 * the same 32 bytes (and, Q5_K, bits 2c and 2c + 1 of the 32 qh bytes as fifth bits). */
AVX2 static inline __attribute__((always_inline)) void k_nibble_levels(const int type, const uint8_t *sb, int c,
                                                                       __m256 low[4], __m256 high[4]) {
    const uint8_t *q = sb + k_nibbles_at(type) + 32 * c;
    for (int p = 0; p < 4; p++) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + 8 * p)));
        __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0x0f)), hi = _mm256_srli_epi32(v, 4);
        if (type == T_Q5_K) {
            const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 16 + 8 * p)));
            lo = _mm256_or_si256(lo, bit_at_4(h, 2 * c));
            hi = _mm256_or_si256(hi, bit_at_4(h, 2 * c + 1));
        }
        low[p] = _mm256_cvtepi32_ps(lo);
        high[p] = _mm256_cvtepi32_ps(hi);
    }
}

/* Q4_K / Q5_K sub-blocks 2c and 2c + 1 as bytes in element order (k_nibble_levels' levels): Q5_K's fifth bits,
 * bits 2c and 2c + 1 of the 32 qh bytes, moved to bit 4 by 16-bit shifts and masked. */
AVX2 static inline __attribute__((always_inline)) void k_nibble_level_bytes(const int type, const uint8_t *sb, int c,
                                                                            __m256i *low, __m256i *high) {
    const __m256i bytes = _mm256_loadu_si256((const __m256i *)(sb + k_nibbles_at(type) + 32 * c));
    const __m256i nibble = _mm256_set1_epi8(0x0f);
    *low = _mm256_and_si256(bytes, nibble);
    *high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibble);
    if (type == T_Q5_K) {
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(sb + 16)), bit4 = _mm256_set1_epi8(0x10);
        *low = _mm256_or_si256(
            *low,
            _mm256_and_si256(2 * c <= 4 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2 * c - 4), bit4));
        *high = _mm256_or_si256(*high, _mm256_and_si256(2 * c + 1 <= 4 ? _mm256_slli_epi16(qh, 3 - 2 * c)
                                                                       : _mm256_srli_epi16(qh, 2 * c - 3),
                                                        bit4));
    }
}

/* Q4_K, Q5_K: the eight 6-bit sub-block scales (bytes of *sc) and minimums (*m) from the super-block's 12 packed
 * bytes, all at once, four per 32-bit word. */
static inline void q4k_unpack(const uint8_t *sb, uint64_t *sc, uint64_t *m) {
    const uint32_t w0 = load_u32(sb + 4), w1 = load_u32(sb + 8), w2 = load_u32(sb + 12);
    *sc = (uint64_t)(w0 & 0x3f3f3f3fu) | (uint64_t)((w2 & 0x0f0f0f0fu) | ((w0 >> 2) & 0x30303030u)) << 32;
    *m = (uint64_t)(w1 & 0x3f3f3f3fu) | (uint64_t)(((w2 >> 4) & 0x0f0f0f0fu) | ((w1 >> 2) & 0x30303030u)) << 32;
}

/* Eight unsigned bytes (the low 64 bits) as eight floats. */
AVX2 static inline __m256 u8x8_to_ps(uint64_t v) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)v)));
}

/* Q4_K, Q5_K: the eight sub-block scales times d and minimums times dmin, as ggml rounds them (d * sc, dmin * m). */
AVX2 static inline __attribute__((always_inline)) void q4k_scales(const uint8_t *sb, __m256 *d_sc, __m256 *dmin_m) {
    uint64_t sc, m;
    q4k_unpack(sb, &sc, &m);
    *d_sc = _mm256_mul_ps(_mm256_set1_ps(half_avx2(sb)), u8x8_to_ps(sc));
    *dmin_m = _mm256_mul_ps(_mm256_set1_ps(half_avx2(sb + 2)), u8x8_to_ps(m));
}

/* Q6_K: the 128 levels (q - 32) of a half super-block (ql: its 64 bytes, qh: its 32) as f[quarter][vector]: each
 * byte is loaded once for the quarters that share it (ql's low and high nibbles, qh's four bit pairs). */
AVX2 static inline __attribute__((always_inline)) void q6k_levels(const uint8_t *ql, const uint8_t *qh,
                                                                  __m256 f[4][4]) {
    const __m256i nibble = _mm256_set1_epi32(0x0f), bias = _mm256_set1_epi32(32);
    for (int p = 0; p < 4; p++) {
        const __m256i l0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 8 * p)));
        const __m256i l1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ql + 32 + 8 * p)));
        const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qh + 8 * p)));
        /* bits 2t, 2t + 1 of qh become bits 4, 5 of quarter t's levels */
        const __m256i q[4] = {_mm256_or_si256(_mm256_and_si256(l0, nibble),
                                              _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(3)), 4)),
                              _mm256_or_si256(_mm256_and_si256(l1, nibble),
                                              _mm256_slli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(12)), 2)),
                              _mm256_or_si256(_mm256_srli_epi32(l0, 4), _mm256_and_si256(h, _mm256_set1_epi32(48))),
                              _mm256_or_si256(_mm256_srli_epi32(l1, 4),
                                              _mm256_srli_epi32(_mm256_and_si256(h, _mm256_set1_epi32(192)), 2))};
        for (int t = 0; t < 4; t++) f[t][p] = _mm256_cvtepi32_ps(_mm256_sub_epi32(q[t], bias));
    }
}

/* Q6_K: the 128 levels of a half super-block (ql: its 64 bytes, qh: its 32) as unsigned bytes q (0..63, ggml's
 * -32 left to the caller), q[t] holding quarter t: bits 2t, 2t + 1 of qh become bits 4, 5 of quarter t. */
AVX2 static inline __attribute__((always_inline)) void q6k_level_bytes(const uint8_t *ql, const uint8_t *qh,
                                                                       __m256i q[4]) {
    const __m256i nibble = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30); /* 16-bit shifts, masked after */
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql), l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *)qh);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, nibble), _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), nibble), _mm256_and_si256(h, top));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), nibble),
                           _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
}

/* Q3_K: q3k_scales as sixteen int8 lanes, built in registers (a trip through memory as four words read back as one
 * vector stalls store forwarding, which cost more than the rest of the super-block). */
AVX2 static inline __m128i q3k_scales_avx2(const uint8_t *sb) {
    const uint32_t a0 = load_u32(sb + 96), a1 = load_u32(sb + 100), tmp = load_u32(sb + 104);
    const uint32_t low4 = 0x0f0f0f0fu, top2 = 0x03030303u;
    const __m128i words = _mm_setr_epi32(
        (int)((a0 & low4) | ((tmp & top2) << 4)), (int)((a1 & low4) | (((tmp >> 2) & top2) << 4)),
        (int)(((a0 >> 4) & low4) | (((tmp >> 4) & top2) << 4)), (int)(((a1 >> 4) & low4) | (((tmp >> 6) & top2) << 4)));
    return _mm_sub_epi8(words, _mm_set1_epi8(32));
}

/* Q3_K: the 128 levels of half n of the super-block as f[quarter][vector], as q6k_levels: bits 2j, 2j + 1 of the
 * half's 32 bytes, less 4 where bit 4n + j of the weight's hmask byte is clear. */
AVX2 static inline __attribute__((always_inline)) void q3k_levels(const uint8_t *sb, int n, __m256 f[4][4]) {
    const __m256i pair = _mm256_set1_epi32(3), four = _mm256_set1_epi32(4);
    for (int p = 0; p < 4; p++) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 32 + 32 * n + 8 * p)));
        /* the half's four hmask bits at bits 0..3, then each moved to bit 2 with one constant shift */
        const __m256i high =
            _mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 8 * p))), 4 * n);
        const __m256i set[4] = {_mm256_slli_epi32(high, 2), _mm256_slli_epi32(high, 1), high,
                                _mm256_srli_epi32(high, 1)};
        const __m256i two[4] = {_mm256_and_si256(q, pair), _mm256_and_si256(_mm256_srli_epi32(q, 2), pair),
                                _mm256_and_si256(_mm256_srli_epi32(q, 4), pair), _mm256_srli_epi32(q, 6)};
        for (int j = 0; j < 4; j++)
            f[j][p] =
                _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_or_si256(two[j], _mm256_and_si256(set[j], four)), four));
    }
}

/* Q3_K: the 128 levels of half n as unsigned bytes (0..7, the -4 left to the caller), q[j] holding quarter j. */
AVX2 static inline __attribute__((always_inline)) void q3k_level_bytes(const uint8_t *sb, int n, __m256i q[4]) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(sb + 32 + 32 * n)), pair = _mm256_set1_epi8(3);
    /* 16-bit shifts, masked per byte after: the half's hmask bits 4n..4n + 3 moved to bit 2 one at a time (the
     * first shift may carry bits between bytes, but never into the bit 2 the mask keeps) */
    const __m256i high = _mm256_srli_epi16(_mm256_loadu_si256((const __m256i *)sb), 4 * n), four = _mm256_set1_epi8(4);
    const __m256i set[4] = {_mm256_slli_epi16(high, 2), _mm256_slli_epi16(high, 1), high, _mm256_srli_epi16(high, 1)};
    const __m256i two[4] = {bits, _mm256_srli_epi16(bits, 2), _mm256_srli_epi16(bits, 4), _mm256_srli_epi16(bits, 6)};
    for (int j = 0; j < 4; j++) q[j] = _mm256_or_si256(_mm256_and_si256(two[j], pair), _mm256_and_si256(set[j], four));
}

/* Q2_K: the 128 levels of half n (0..3, bits 2j, 2j + 1 of its 32 bytes) as f[quarter][vector]. */
AVX2 static inline __attribute__((always_inline)) void q2k_levels(const uint8_t *sb, int n, __m256 f[4][4]) {
    const __m256i pair = _mm256_set1_epi32(3);
    for (int p = 0; p < 4; p++) {
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 16 + 32 * n + 8 * p)));
        f[0][p] = _mm256_cvtepi32_ps(_mm256_and_si256(q, pair));
        f[1][p] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q, 2), pair));
        f[2][p] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(q, 4), pair));
        f[3][p] = _mm256_cvtepi32_ps(_mm256_srli_epi32(q, 6));
    }
}

/* Q2_K: the 128 levels of half n as bytes, q[j] holding quarter j (16-bit shifts, masked per byte). */
AVX2 static inline __attribute__((always_inline)) void q2k_level_bytes(const uint8_t *sb, int n, __m256i q[4]) {
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * n)), pair = _mm256_set1_epi8(3);
    q[0] = _mm256_and_si256(bits, pair);
    q[1] = _mm256_and_si256(_mm256_srli_epi16(bits, 2), pair);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(bits, 4), pair);
    q[3] = _mm256_and_si256(_mm256_srli_epi16(bits, 6), pair);
}

/* Q2_K: the sixteen sub-block scales times d and minimums times dmin, as ggml rounds them, as two vectors each. */
AVX2 static inline __attribute__((always_inline)) void q2k_scales(const uint8_t *sb, __m256 d_sc[2], __m256 dmin_m[2]) {
    const __m128i packed = _mm_loadu_si128((const __m128i *)sb), low = _mm_set1_epi8(0x0f);
    const __m128i sc = _mm_and_si128(packed, low), m = _mm_and_si128(_mm_srli_epi16(packed, 4), low);
    const __m256 d = _mm256_set1_ps(half_avx2(sb + 80)), dmin = _mm256_set1_ps(half_avx2(sb + 82));
    d_sc[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sc)));
    d_sc[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sc, 8))));
    dmin_m[0] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(m)));
    dmin_m[1] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(m, 8))));
}

/* IQ4_XS: the eight sub-block scales less 32 (iq4xs_scale), as int32 lanes. */
AVX2 static inline __m256i iq4xs_scales(const uint8_t *sb) {
    const __m256i low =
        _mm256_srlv_epi32(_mm256_set1_epi32((int)load_u32(sb + 4)), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    const __m256i high =
        _mm256_srlv_epi32(_mm256_set1_epi32(load_u16(sb + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
    const __m256i scales = _mm256_or_si256(_mm256_and_si256(low, _mm256_set1_epi32(0x0f)),
                                           _mm256_slli_epi32(_mm256_and_si256(high, _mm256_set1_epi32(3)), 4));
    return _mm256_sub_epi32(scales, _mm256_set1_epi32(32));
}

/* IQ4_XS: the eight sub-block scales times d, as ggml rounds them (d * sc). */
AVX2 static inline __m256 iq4xs_d_scales(const uint8_t *sb) {
    return _mm256_mul_ps(_mm256_set1_ps(half_avx2(sb)), _mm256_cvtepi32_ps(iq4xs_scales(sb)));
}

/* A K-quant super-block as 256 floats, bit-identical to dequant_super_block_scalar. */
AVX2 static inline void dequant_super_block_avx2(int type, const uint8_t *sb, float *dst) {
    if (type == T_IQ4_XS) {
        float scale[8];
        _mm256_storeu_ps(scale, iq4xs_d_scales(sb));
        for (int j = 0; j < 8; j++, dst += 32) {
            __m256 levels[4];
            iq4_levels_in_order(sb + 8 + 16 * j, levels);
            for (int p = 0; p < 4; p++)
                _mm256_storeu_ps(dst + 8 * p, _mm256_mul_ps(_mm256_set1_ps(scale[j]), levels[p]));
        }
        return;
    }
    if (type == T_Q2_K) {
        __m256 d_sc[2], dmin_m[2];
        q2k_scales(sb, d_sc, dmin_m);
        float dl[16], ml[16];
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(dl + 8 * i, d_sc[i]), _mm256_storeu_ps(ml + 8 * i, dmin_m[i]);
        for (int n = 0; n < 2; n++) {
            __m256 levels[4][4];
            q2k_levels(sb, n, levels);
            for (int j = 0; j < 4; j++, dst += 32)
                for (int p = 0; p < 4; p++) {
                    const int is = 8 * n + 2 * j + p / 2;
                    _mm256_storeu_ps(dst + 8 * p, _mm256_sub_ps(_mm256_mul_ps(_mm256_set1_ps(dl[is]), levels[j][p]),
                                                                _mm256_set1_ps(ml[is])));
                }
        }
        return;
    }
    if (type == T_Q3_K) {
        int8_t scales[16];
        _mm_storeu_si128((__m128i *)scales, q3k_scales_avx2(sb));
        const float d = half_avx2(sb + 108);
        for (int n = 0; n < 2; n++) {
            __m256 levels[4][4];
            q3k_levels(sb, n, levels);
            for (int j = 0; j < 4; j++, dst += 32)
                for (int p = 0; p < 4; p++)
                    _mm256_storeu_ps(
                        dst + 8 * p,
                        _mm256_mul_ps(_mm256_set1_ps(d * (float)scales[8 * n + 2 * j + p / 2]), levels[j][p]));
        }
        return;
    }
    if (is_k_nibble_type(type)) {
        const float d = half_avx2(sb), dmin = half_avx2(sb + 2);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c and 2c + 1 share their 32 bytes */
            __m256 levels[2][4];
            k_nibble_levels(type, sb, c, levels[0], levels[1]);
            for (int h = 0; h < 2; h++, dst += 32) {
                int sc, m;
                q4k_scale_min(sb + 4, 2 * c + h, &sc, &m);
                const __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)m);
                for (int p = 0; p < 4; p++)
                    _mm256_storeu_ps(dst + 8 * p, _mm256_sub_ps(_mm256_mul_ps(d1, levels[h][p]), m1));
            }
        }
        return;
    }
    const float d = half_avx2(sb + 208);
    const int8_t *scales = (const int8_t *)(sb + 192);
    for (int half = 0; half < 2; half++) {
        __m256 levels[4][4];
        q6k_levels(sb + 64 * half, sb + 128 + 32 * half, levels);
        for (int t = 0; t < 4; t++, dst += 32)
            for (int p = 0; p < 4; p++) {
                const __m256 scale = _mm256_set1_ps(d * (float)scales[8 * half + 2 * t + p / 2]);
                _mm256_storeu_ps(dst + 8 * p, _mm256_mul_ps(scale, levels[t][p]));
            }
    }
}

#endif
#endif
