/* ggml's storage types as the packed-weight kernel (linear_cpu.c) reads them: type ids, block layouts, where a
 * block's fields lie, and decoding a block, bit for bit as ggml dequantizes (scalar, and AVX2+FMA+F16C under a
 * target attribute, chosen at run time).
 *
 * A block holds 32 weights: a float16 scale d, a float16 minimum m (Q4_1, Q5_1), a 32-bit word of fifth bits qh
 * (Q5_0, Q5_1), then the quants qs (16 bytes of nibbles, or 32 int8 for Q8_0). IQ4_NL stores Q4_0's fields, but
 * a nibble indexes a fixed table of 16 non-uniform levels (kvalues_iq4nl) instead of being q - 8.
 *
 * K-quants and IQ4_XS (256 weights per super-block, read plain) are decoded in ggml_k_quants.h.
 *
 * Two layouts of a matrix of 32-weight blocks, both rows x row_bytes bytes in all:
 * - plain: each row a run of blocks, exactly as in the GGUF file;
 * - interleaved (`pagellm_interleave`): rows [0, grouped_rows) go in groups of four, and for each block index a
 *   group stores its four blocks field by field: the four d, the four m, the four qh, then the four runs of qs.
 *   One 8- or 16-byte load then gives the scales of four rows, and the batch-1 kernel streams one sequence of
 *   bytes instead of four rows. Rows from grouped_rows on (n % 4 of them) stay plain, at r * row_bytes.
 */
#ifndef PAGELLM_GGML_BLOCKS_H
#define PAGELLM_GGML_BLOCKS_H
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* ggml's type ids (GGMLQuantizationType). */
enum {
    T_F32 = 0,
    T_F16 = 1,
    T_Q4_0 = 2,
    T_Q4_1 = 3,
    T_Q5_0 = 6,
    T_Q5_1 = 7,
    T_Q8_0 = 8,
    T_Q2_K = 10,
    T_Q3_K = 11,
    T_Q4_K = 12,
    T_Q5_K = 13,
    T_Q6_K = 14,
    T_IQ4_NL = 20,
    T_IQ4_XS = 23,
    T_BF16 = 30
};

/* IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl): a weight is its scale times the level its nibble picks.
 * The float32 dot products take them plus IQ4_OFFSET, unsigned, and subtract the offset times the activations'
 * sums (as Q4_0's q - 8): an unsigned byte widens with a mask where a signed one takes two shifts. */
static const int8_t iq4_levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#define IQ4_OFFSET 128
static const uint8_t iq4_levels_unsigned[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                129, 141, 153, 166, 181, 197, 217, 241};

static inline int is_block_type(int t) {
    return t == T_Q4_0 || t == T_Q4_1 || t == T_Q5_0 || t == T_Q5_1 || t == T_Q8_0 || t == T_IQ4_NL;
}
static inline int signed_levels(int t) { return t == T_Q8_0 || t == T_IQ4_NL || t == T_IQ4_XS; } /* levels < 0 */
/* Types whose float32 dot products decode levels as bytes and widen them strided (widen_strided): all but Q8_0
 * and the plain nibbles of Q4_0, Q4_1 and Q4_K, which widen as fast per 8 bytes from memory (measured 2.3 against
 * 2.5 ns per 32 weights for Q4_K; Q3_K, Q5_K and Q6_K went from 4.1-4.5 to 2.9-3.3, Q5_0 and Q5_1 from 3.7-3.9
 * to 3.4-3.5). */
static inline int strided_levels(int t) {
    return t == T_IQ4_NL || t == T_IQ4_XS || t == T_Q2_K || t == T_Q3_K || t == T_Q5_K || t == T_Q6_K || t == T_Q5_0 ||
           t == T_Q5_1;
}
static inline int is_float_type(int t) { return t == T_F32 || t == T_F16 || t == T_BF16; }
static inline int has_min(int t) { return t == T_Q4_1 || t == T_Q5_1; }
static inline int five_bit(int t) { return t == T_Q5_0 || t == T_Q5_1; }
static inline int quant_bytes(int t) { return t == T_Q8_0 ? 32 : 16; }
static inline int64_t block_bytes(int t) { return 2 + 2 * has_min(t) + 4 * five_bit(t) + quant_bytes(t); }
static inline int element_bytes(int t) { return t == T_F32 ? 4 : 2; }                        /* float types */
static inline int is_k_type(int t) { return (t >= T_Q2_K && t <= T_Q6_K) || t == T_IQ4_XS; } /* super-blocks */

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static inline uint32_t load_u32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* Where one block's fields are; for float types every field points at its 32 values. */
typedef struct {
    const uint8_t *d, *m, *qh, *qs;
} block_ref;

/* Block i (0..3) of an interleaved group's run for one block index, starting at `group`. */
static inline block_ref group_block(int type, const uint8_t *group, int i) {
    const int hm = has_min(type), fb = five_bit(type);
    block_ref ref = {group + 2 * i, group + 8 + 2 * i, group + 8 + 8 * hm + 4 * i,
                     group + 8 + 8 * hm + 16 * fb + quant_bytes(type) * i};
    return ref;
}

/* Block b of row r of a matrix in either layout (grouped_rows = 0: plain). */
static inline block_ref block_at(int type, const uint8_t *w, int64_t row_bytes, int64_t grouped_rows, int64_t r,
                                 int64_t b) {
    if (is_float_type(type)) {
        const uint8_t *values = w + r * row_bytes + b * 32 * element_bytes(type);
        block_ref ref = {values, values, values, values};
        return ref;
    }
    if (r < grouped_rows)
        return group_block(type, w + (r & ~(int64_t)3) * row_bytes + b * 4 * block_bytes(type), (int)(r & 3));
    const uint8_t *blk = w + r * row_bytes + b * block_bytes(type);
    const int hm = has_min(type), fb = five_bit(type);
    block_ref ref = {blk, blk + 2, blk + 2 + 2 * hm, blk + 2 + 2 * hm + 4 * fb};
    return ref;
}

/* ---- portable scalar decoding -------------------------------------------------------------------------- */

static inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf / nan */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* A block of a block type as 32 floats, ggml's arithmetic (d * q + m rounded twice: built with -ffp-contract=off). */
static void dequant_block_scalar(int type, block_ref ref, float *dst) {
    const float d = fp16_to_fp32(load_u16(ref.d)), m = has_min(type) ? fp16_to_fp32(load_u16(ref.m)) : 0.0f;
    const uint8_t *qs = ref.qs;
    if (type == T_Q8_0) {
        for (int j = 0; j < 32; j++) dst[j] = (float)(int8_t)qs[j] * d;
        return;
    }
    if (type == T_IQ4_NL) {
        for (int j = 0; j < 16; j++) {
            dst[j] = d * (float)iq4_levels[qs[j] & 0x0f];
            dst[j + 16] = d * (float)iq4_levels[qs[j] >> 4];
        }
        return;
    }
    const uint32_t qh = five_bit(type) ? load_u32(ref.qh) : 0;
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 0x0f, hi = qs[j] >> 4;
        if (five_bit(type)) {
            lo |= (int)(((qh >> j) & 1) << 4);
            hi |= (int)(((qh >> (j + 16)) & 1) << 4);
        }
        if (has_min(type)) {
            dst[j] = d * (float)lo + m;
            dst[j + 16] = d * (float)hi + m;
        } else {
            const int offset = five_bit(type) ? 16 : 8;
            dst[j] = d * (float)(lo - offset);
            dst[j + 16] = d * (float)(hi - offset);
        }
    }
}

/* ---- AVX2 + FMA + F16C ------------------------------------------------------------------------------ */
#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))
/* the wider variants of the tiles and the small-M kernels, for CPUs with AVX-512F (runtime-checked:
 * pagellm_cpu_has_avx512) */
#define AVX512 __attribute__((target("avx512f,avx2,fma,f16c")))

AVX2 static inline float half_avx2(const uint8_t *p) { return _cvtsh_ss(load_u16(p)); }

/* 8 bytes at the low half of v as 8 floats, signed or unsigned. */
AVX2 static inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

/* IQ4_NL / IQ4_XS: 16 bytes of nibbles as their 32 entries of `table` (16 bytes) in element order (low nibbles,
 * then high): the bytes broadcast to both halves, the high half shifted, one in-lane lookup (vpshufb). */
AVX2 static inline __m256i iq4_lookup(const uint8_t *qs, const void *table) {
    const __m256i entries = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)table));
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i nibbles =
        _mm256_and_si256(_mm256_blend_epi32(q, _mm256_srli_epi16(q, 4), 0xf0), _mm256_set1_epi8(0x0f));
    return _mm256_shuffle_epi8(entries, nibbles);
}

/* The signed levels as bytes, in element order. */
AVX2 static inline __m256i iq4_level_bytes(const uint8_t *qs) { return iq4_lookup(qs, iq4_levels); }

/* 32 unsigned bytes as four vectors of 8 floats in a strided order: lane i of f[j] is byte 4i + j, each byte of a
 * 32-bit lane widened by a shift and a mask (a widening per 8 bytes would take the shuffle unit four more times per
 * 32 bytes). Dot products read activations permuted to match (permute_activations); bytes 0..15 land in lanes
 * 0..3 of every vector and bytes 16..31 in lanes 4..7, so two sub-blocks of 16 keep their own scales. */
AVX2 static inline __attribute__((always_inline)) void widen_strided(__m256i v, __m256 f[4]) {
    const __m256i byte = _mm256_set1_epi32(0xff);
    f[0] = _mm256_cvtepi32_ps(_mm256_and_si256(v, byte));
    f[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 8), byte));
    f[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 16), byte));
    f[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 24));
}

/* IQ4's levels plus IQ4_OFFSET, strided. */
AVX2 static inline __attribute__((always_inline)) void iq4_levels_strided(const uint8_t *qs, __m256 f[4]) {
    widen_strided(iq4_lookup(qs, iq4_levels_unsigned), f);
}

/* The levels in element order (for dequantization): elements 8p..8p + 7 in f[p]. */
AVX2 static inline __attribute__((always_inline)) void iq4_levels_in_order(const uint8_t *qs, __m256 f[4]) {
    const __m256i v = iq4_level_bytes(qs);
    const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
    f[0] = i8_to_ps(lo), f[1] = i8_to_ps(_mm_srli_si128(lo, 8)), f[2] = i8_to_ps(hi),
    f[3] = i8_to_ps(_mm_srli_si128(hi, 8));
}

/* Activations in widen_strided's order: within each 32, position 8j + i holds element 4i + j. */
static inline void permute_activations(const float *x, int64_t m, int64_t ldx, int64_t k, float *dst) {
    for (int64_t r = 0; r < m; r++)
        for (int64_t b = 0; b < k; b += 32)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 8; i++) dst[r * k + b + 8 * j + i] = x[r * ldx + b + 4 * i + j];
}

/* ggml's offset of a type without a minimum: its weights are d (q - offset). */
static inline int level_offset(int t) { return t == T_Q4_0 ? 8 : t == T_Q5_0 ? 16 : 0; }

/* The block's integer levels as four vectors of 8 floats (elements 0..31 in order), less ggml's offset when
 * `with_offset` (the products regroup it with the minimum instead); the scales are read apart. Two loads of 8
 * bytes widened to int32 lanes give elements 0..7 and 8..15 (low nibbles) and 16..23 and 24..31 (high nibbles)
 * with one AND or shift each. */
AVX2 static inline __attribute__((always_inline)) void block_levels(const int type, block_ref ref, __m256 f[4],
                                                                    const int with_offset) {
    if (type == T_Q8_0) {
        for (int p = 0; p < 4; p++) f[p] = i8_to_ps(_mm_loadl_epi64((const __m128i *)(ref.qs + 8 * p)));
        return;
    }
    if (type == T_IQ4_NL) { /* in element order, for dequantization (the dot products use the strided order) */
        iq4_levels_in_order(ref.qs, f);
        return;
    }
    const __m256i low = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)ref.qs));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(ref.qs + 8)));
    __m256i q[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low), _mm256_srli_epi32(a, 4),
                    _mm256_srli_epi32(b, 4)};
    if (five_bit(type)) {
        /* Bit e of qh is the fifth bit of element e: one shift per vector brings it to bit 4 of lane e, from qh << 4
         * for elements 0..15 and from qh >> 12 for 16..31. */
        const uint32_t qh = load_u32(ref.qh);
        const __m256i from_low = _mm256_set1_epi32((int)(qh << 4)), from_high = _mm256_set1_epi32((int)(qh >> 12));
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), bit4 = _mm256_set1_epi32(16);
        for (int p = 0; p < 4; p++) {
            const __m256i shift = _mm256_add_epi32(lane, _mm256_set1_epi32(8 * (p & 1)));
            q[p] =
                _mm256_or_si256(q[p], _mm256_and_si256(_mm256_srlv_epi32(p < 2 ? from_low : from_high, shift), bit4));
        }
    }
    const __m256i offset = _mm256_set1_epi32(level_offset(type));
    for (int p = 0; p < 4; p++)
        f[p] = _mm256_cvtepi32_ps(with_offset && level_offset(type) ? _mm256_sub_epi32(q[p], offset) : q[p]);
}

/* ---- levels as bytes, for integer dot products (int8 activations) ---- */

/* The block's 32 levels as bytes in element order: unsigned (without ggml's offset) for the nibble types, signed
 * for Q8_0 and IQ4_NL. Q5's fifth bits: every byte picks its qh byte, keeps its own bit, turns it into 0x10. */
AVX2 static inline __attribute__((always_inline)) __m256i block_level_bytes(const int type, block_ref ref) {
    if (type == T_Q8_0) return _mm256_loadu_si256((const __m256i *)ref.qs);
    if (type == T_IQ4_NL) return iq4_level_bytes(ref.qs);
    const __m128i qs = _mm_loadu_si128((const __m128i *)ref.qs);
    __m256i v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(qs, 4), qs), _mm256_set1_epi8(0x0f));
    if (five_bit(type)) {
        const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201);
        const __m256i qh = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load_u32(ref.qh)), pick);
        v = _mm256_or_si256(
            v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(0x10)));
    }
    return v;
}

/* A block of a block type as 32 floats, bit-identical to dequant_block_scalar. */
AVX2 static inline void dequant_block_avx2(int type, block_ref ref, float *dst) {
    __m256 f[4];
    block_levels(type, ref, f, 1);
    const __m256 d = _mm256_set1_ps(half_avx2(ref.d));
    const __m256 m = _mm256_set1_ps(has_min(type) ? half_avx2(ref.m) : 0.0f);
    for (int p = 0; p < 4; p++) /* ggml: d * q (+ m); Q8_0: q * d */
        _mm256_storeu_ps(dst + 8 * p,
                         has_min(type) ? _mm256_add_ps(_mm256_mul_ps(d, f[p]), m) : _mm256_mul_ps(f[p], d));
}
#endif
#endif
