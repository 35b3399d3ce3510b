/* y = x W^T on the CPU with W kept in its GGUF storage type: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0.
 *
 * Arithmetic: activations stay float32 (never quantized, unlike llama.cpp) and every product is accumulated in
 * float32. Dequantization (pagellm_dequantize_rows, and the tile path below) reproduces ggml's float weights bit for
 * bit (compiled with -ffp-contract=off, so `d * q + m` is rounded twice as there). The small-M path regroups each
 * block's products around its scales, d * sum(q x) + m * sum(x): the same sum up to float32 rounding.
 *
 * Work split: for up to FUSED_MAX_M activation rows each block is decoded in registers and multiplied at once,
 * streaming the packed weights once. For more rows, output rows go in tiles of TILE_ROWS: each tile is
 * dequantized into a small float buffer that stays in L1/L2 and multiplied with every activation row by a
 * register-blocked micro-kernel (3 activation rows x 4 weight rows, 12 accumulators), so each dequantized tile
 * is reused M times; float32 weights are read in place. Rows are spread over OpenMP threads (the process's
 * libgomp: the same pool PyTorch uses).
 *
 * Each function has an AVX2+FMA+F16C version (target attribute) and a portable scalar version; the caller picks
 * with `use_avx2`, after asking pagellm_cpu_has_avx2().
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_X86 1
#else
#define HAVE_X86 0
#endif

/* ggml's type ids (GGMLQuantizationType). */
enum { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_BF16 = 30 };

#define TILE_ROWS 4
#define MR 3 /* activation rows per micro-kernel call */

/* ---- portable scalar dequantization ------------------------------------------------------------------- */

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
        while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t load_u16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* Bytes per block and elements per block of each type; 0 for types this file does not handle. */
static int type_layout(int type, int64_t *block_bytes, int64_t *block_elems) {
    switch (type) {
    case T_F32: *block_bytes = 4; *block_elems = 1; return 1;
    case T_F16: case T_BF16: *block_bytes = 2; *block_elems = 1; return 1;
    case T_Q4_0: *block_bytes = 18; *block_elems = 32; return 1;
    case T_Q4_1: *block_bytes = 20; *block_elems = 32; return 1;
    case T_Q5_0: *block_bytes = 22; *block_elems = 32; return 1;
    case T_Q5_1: *block_bytes = 24; *block_elems = 32; return 1;
    case T_Q8_0: *block_bytes = 34; *block_elems = 32; return 1;
    default: return 0;
    }
}

static void dequant_row_scalar(int type, const uint8_t *src, float *dst, int64_t k) {
    switch (type) {
    case T_F32:
        memcpy(dst, src, (size_t)k * 4);
        return;
    case T_F16:
        for (int64_t i = 0; i < k; i++) dst[i] = fp16_to_fp32(load_u16(src + 2 * i));
        return;
    case T_BF16:
        for (int64_t i = 0; i < k; i++) {
            const uint32_t bits = (uint32_t)load_u16(src + 2 * i) << 16;
            memcpy(dst + i, &bits, 4);
        }
        return;
    default:
        break;
    }
    for (int64_t b = 0; b < k / 32; b++, dst += 32) {
        switch (type) {
        case T_Q4_0: {
            const uint8_t *blk = src + b * 18;
            const float d = fp16_to_fp32(load_u16(blk));
            for (int j = 0; j < 16; j++) {
                dst[j] = d * (float)((blk[2 + j] & 0x0f) - 8);
                dst[j + 16] = d * (float)((blk[2 + j] >> 4) - 8);
            }
            break;
        }
        case T_Q4_1: {
            const uint8_t *blk = src + b * 20;
            const float d = fp16_to_fp32(load_u16(blk)), m = fp16_to_fp32(load_u16(blk + 2));
            for (int j = 0; j < 16; j++) {
                dst[j] = d * (float)(blk[4 + j] & 0x0f) + m;
                dst[j + 16] = d * (float)(blk[4 + j] >> 4) + m;
            }
            break;
        }
        case T_Q5_0: case T_Q5_1: {
            const int has_min = type == T_Q5_1;
            const uint8_t *blk = src + b * (has_min ? 24 : 22);
            const float d = fp16_to_fp32(load_u16(blk)), m = has_min ? fp16_to_fp32(load_u16(blk + 2)) : 0.0f;
            const uint32_t qh = load_u32(blk + (has_min ? 4 : 2));
            const uint8_t *qs = blk + (has_min ? 8 : 6);
            for (int j = 0; j < 16; j++) {
                const int lo = (qs[j] & 0x0f) | (int)(((qh >> j) & 1) << 4);
                const int hi = (qs[j] >> 4) | (int)(((qh >> (j + 16)) & 1) << 4);
                if (has_min) {
                    dst[j] = d * (float)lo + m;
                    dst[j + 16] = d * (float)hi + m;
                } else {
                    dst[j] = d * (float)(lo - 16);
                    dst[j + 16] = d * (float)(hi - 16);
                }
            }
            break;
        }
        case T_Q8_0: {
            const uint8_t *blk = src + b * 34;
            const float d = fp16_to_fp32(load_u16(blk));
            for (int j = 0; j < 32; j++) dst[j] = (float)(int8_t)blk[2 + j] * d;
            break;
        }
        }
    }
}

/* out[m * ldo + r] = sum_k x[m * ldx + k] * w[r * ldw + k] for m < mb, r < rb. */
static void tile_gemm_scalar(const float *x, int64_t mb, int64_t ldx, const float *w, int64_t rb, int64_t ldw,
                             int64_t k, float *out, int64_t ldo) {
    for (int64_t m = 0; m < mb; m++)
        for (int64_t r = 0; r < rb; r++) {
            float acc = 0.0f;
            for (int64_t i = 0; i < k; i++) acc += x[m * ldx + i] * w[r * ldw + i];
            out[m * ldo + r] = acc;
        }
}

/* ---- AVX2 + FMA + F16C ------------------------------------------------------------------------------ */
#if HAVE_X86
#define AVX2 __attribute__((target("avx2,fma,f16c")))

AVX2 static inline float half_avx2(const uint8_t *p) { return _cvtsh_ss(load_u16(p)); }

/* 8 bytes at the low half of v as 8 floats, signed or unsigned. */
AVX2 static inline __m256 i8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
AVX2 static inline __m256 u8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

/* Byte j of the result is 0x10 where bit j of qh is set. */
AVX2 static inline __m256i high_bits(uint32_t qh) {
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    __m256i v = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh), spread);
    v = _mm256_cmpeq_epi8(_mm256_and_si256(v, select), select);
    return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/* Store 32 weights given as 32 bytes (elements 0..31 in order) times d (plus m), as ggml rounds them. */
AVX2 static inline void store_block(__m256i q, int is_signed, __m256 d, const __m256 *m, float *dst) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int p = 0; p < 4; p++) {
        const __m256 f = is_signed ? i8_to_ps(parts[p]) : u8_to_ps(parts[p]);
        __m256 w = _mm256_mul_ps(d, f);
        if (m) w = _mm256_add_ps(w, *m);
        _mm256_storeu_ps(dst + 8 * p, w);
    }
}

/* 16 packed bytes of nibbles as 32 bytes: low nibbles (elements 0..15), then high nibbles (16..31). */
AVX2 static inline __m256i unpack_nibbles(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

AVX2 static void dequant_row_avx2(int type, const uint8_t *src, float *dst, int64_t k) {
    if (type == T_F16) {
        int64_t i = 0;
        for (; i + 8 <= k; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
        for (; i < k; i++) dst[i] = fp16_to_fp32(load_u16(src + 2 * i));
        return;
    }
    if (type != T_Q4_0 && type != T_Q4_1 && type != T_Q5_0 && type != T_Q5_1 && type != T_Q8_0) {
        dequant_row_scalar(type, src, dst, k);
        return;
    }
    for (int64_t b = 0; b < k / 32; b++, dst += 32) {
        switch (type) {
        case T_Q4_0: {
            const uint8_t *blk = src + b * 18;
            const __m256i q = _mm256_sub_epi8(unpack_nibbles(blk + 2), _mm256_set1_epi8(8));
            store_block(q, 1, _mm256_set1_ps(half_avx2(blk)), NULL, dst);
            break;
        }
        case T_Q4_1: {
            const uint8_t *blk = src + b * 20;
            const __m256 m = _mm256_set1_ps(half_avx2(blk + 2));
            store_block(unpack_nibbles(blk + 4), 0, _mm256_set1_ps(half_avx2(blk)), &m, dst);
            break;
        }
        case T_Q5_0: {
            const uint8_t *blk = src + b * 22;
            __m256i q = _mm256_or_si256(unpack_nibbles(blk + 6), high_bits(load_u32(blk + 2)));
            q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            store_block(q, 1, _mm256_set1_ps(half_avx2(blk)), NULL, dst);
            break;
        }
        case T_Q5_1: {
            const uint8_t *blk = src + b * 24;
            const __m256i q = _mm256_or_si256(unpack_nibbles(blk + 8), high_bits(load_u32(blk + 4)));
            const __m256 m = _mm256_set1_ps(half_avx2(blk + 2));
            store_block(q, 0, _mm256_set1_ps(half_avx2(blk)), &m, dst);
            break;
        }
        case T_Q8_0: {
            const uint8_t *blk = src + b * 34;
            const __m256 d = _mm256_set1_ps(half_avx2(blk));
            for (int p = 0; p < 4; p++) /* ggml: x * d */
                _mm256_storeu_ps(dst + 8 * p, _mm256_mul_ps(i8_to_ps(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * p))), d));
            break;
        }
        }
    }
}

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Same contract as tile_gemm_scalar, rb <= TILE_ROWS. Activation rows go MR at a time; missing rows of the last
 * group repeat row 0 (computed, not stored), so the inner loop has no branches. */
AVX2 static void tile_gemm_avx2(const float *x, int64_t mb, int64_t ldx, const float *w, int64_t rb, int64_t ldw,
                                int64_t k, float *out, int64_t ldo) {
    const int64_t k8 = k & ~(int64_t)7;
    const float *wr[TILE_ROWS];
    for (int r = 0; r < TILE_ROWS; r++) wr[r] = w + (r < rb ? r : 0) * ldw;
    for (int64_t m0 = 0; m0 < mb; m0 += MR) {
        const int64_t rows = mb - m0 < MR ? mb - m0 : MR;
        const float *x0 = x + m0 * ldx, *x1 = rows > 1 ? x0 + ldx : x0, *x2 = rows > 2 ? x0 + 2 * ldx : x0;
        __m256 acc[MR][TILE_ROWS];
        for (int i = 0; i < MR; i++)
            for (int r = 0; r < TILE_ROWS; r++) acc[i][r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < k8; i += 8) {
            const __m256 a0 = _mm256_loadu_ps(x0 + i), a1 = _mm256_loadu_ps(x1 + i), a2 = _mm256_loadu_ps(x2 + i);
            for (int r = 0; r < TILE_ROWS; r++) {
                const __m256 b = _mm256_loadu_ps(wr[r] + i);
                acc[0][r] = _mm256_fmadd_ps(a0, b, acc[0][r]);
                acc[1][r] = _mm256_fmadd_ps(a1, b, acc[1][r]);
                acc[2][r] = _mm256_fmadd_ps(a2, b, acc[2][r]);
            }
        }
        const float *xs[MR] = {x0, x1, x2};
        for (int64_t i = 0; i < rows; i++)
            for (int64_t r = 0; r < rb; r++) {
                float s = hsum(acc[i][r]);
                for (int64_t j = k8; j < k; j++) s += xs[i][j] * wr[r][j];
                out[(m0 + i) * ldo + r] = s;
            }
    }
}

/* ---- small M: dequantize in registers, no buffer ---------------------------------------------------------
 * For decode-sized batches the tile buffer's store and reload cost more than the arithmetic, so each block is
 * decoded in registers and used straight away. A block's products are regrouped around its scales:
 *     sum_j (d q_j + m) x_j  =  d (sum_j q_j x_j) + m (sum_j x_j)
 * with sum_j x_j computed once per call. That removes the multiply and add per weight that rebuilding ggml's
 * float weights costs, and keeps float32 activations and float32 accumulation (no activation quantization);
 * the result differs from the tile path only by float32 rounding. Specialised per type and per M
 * (always_inline with constants). */
#define FUSED_MAX_M 4

static inline int is_block_type(int type) { return type != T_F32 && type != T_F16 && type != T_BF16; }

/* Block `blk` as four vectors of 8: float types give their values; block types give the integer levels (with
 * ggml's offset: q - 8 for Q4_0, q - 16 for Q5_0) and their scale d and minimum m (0 when the type has none). */
AVX2 static inline __attribute__((always_inline)) void decode_block(const int type, const uint8_t *blk, __m256 f[4],
                                                                    float *d, float *m) {
    switch (type) {
    case T_F32:
        for (int p = 0; p < 4; p++) f[p] = _mm256_loadu_ps((const float *)blk + 8 * p);
        return;
    case T_F16:
        for (int p = 0; p < 4; p++) f[p] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + 16 * p)));
        return;
    case T_BF16:
        for (int p = 0; p < 4; p++)
            f[p] = _mm256_castsi256_ps(_mm256_slli_epi32(
                _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(blk + 16 * p))), 16));
        return;
    case T_Q8_0:
        *d = half_avx2(blk);
        *m = 0.0f;
        for (int p = 0; p < 4; p++) f[p] = i8_to_ps(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * p)));
        return;
    default:
        break;
    }
    /* 4- and 5-bit types. Two loads of 8 bytes widened to int32 lanes give elements 0..7 and 8..15 (low
     * nibbles) and 16..23 and 24..31 (high nibbles) with one AND or shift each: fewer shuffles than unpacking
     * bytes first. */
    const int has_min = type == T_Q4_1 || type == T_Q5_1, five_bit = type == T_Q5_0 || type == T_Q5_1;
    const uint8_t *qs = blk + 2 + 2 * has_min + 4 * five_bit;
    const __m256i low = _mm256_set1_epi32(0x0f);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8)));
    __m256i q[4] = {_mm256_and_si256(a, low), _mm256_and_si256(b, low), _mm256_srli_epi32(a, 4), _mm256_srli_epi32(b, 4)};
    if (five_bit) { /* bit e of qh is the fifth bit of element e */
        const __m256i qh = _mm256_set1_epi32((int)load_u32(blk + 2 + 2 * has_min));
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), one = _mm256_set1_epi32(1);
        for (int p = 0; p < 4; p++) {
            const __m256i bit = _mm256_and_si256(_mm256_srlv_epi32(qh, _mm256_add_epi32(lane, _mm256_set1_epi32(8 * p))), one);
            q[p] = _mm256_or_si256(q[p], _mm256_slli_epi32(bit, 4));
        }
    }
    *d = half_avx2(blk);
    *m = has_min ? half_avx2(blk + 2) : 0.0f;
    const __m256i offset = _mm256_set1_epi32(five_bit ? 16 : 8);
    for (int p = 0; p < 4; p++) f[p] = _mm256_cvtepi32_ps(has_min ? q[p] : _mm256_sub_epi32(q[p], offset));
}

AVX2 static inline __attribute__((always_inline)) void fused_rows(
    const int type, const int m, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1, const float *x,
    int64_t ldx, const float *xsum, int64_t k, float *out, int64_t ldo) {
    int64_t block_bytes, block_elems;
    type_layout(type, &block_bytes, &block_elems);
    const int64_t step = 32 * block_bytes / block_elems, blocks = k / 32; /* bytes per 32 weights */
    const int scaled = is_block_type(type), has_min = type == T_Q4_1 || type == T_Q5_1;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * row_bytes;
        __m256 acc[FUSED_MAX_M][4];
        float min_acc[FUSED_MAX_M];
        for (int i = 0; i < m; i++) {
            min_acc[i] = 0.0f;
            for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
        }
        for (int64_t b = 0; b < blocks; b++) {
            __m256 f[4];
            float d = 1.0f, mn = 0.0f;
            decode_block(type, row + b * step, f, &d, &mn);
            const float *xb = x + b * 32;
            if (!scaled) { /* four independent chains per row hide the FMA latency */
                for (int i = 0; i < m; i++)
                    for (int p = 0; p < 4; p++)
                        acc[i][p] = _mm256_fmadd_ps(f[p], _mm256_loadu_ps(xb + i * ldx + 8 * p), acc[i][p]);
                continue;
            }
            const __m256 dv = _mm256_set1_ps(d);
            for (int i = 0; i < m; i++) {
                /* The block's dot product is independent of the accumulator, so only one FMA per block sits on
                 * the loop-carried chain. */
                const float *xi = xb + i * ldx;
                const __m256 v01 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xi + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xi)));
                const __m256 v23 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xi + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xi + 16)));
                acc[i][0] = _mm256_fmadd_ps(_mm256_add_ps(v01, v23), dv, acc[i][0]);
                if (has_min) min_acc[i] += mn * xsum[i * blocks + b];
            }
        }
        for (int i = 0; i < m; i++) {
            const __m256 total = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
            out[i * ldo + r] = hsum(total) + min_acc[i];
        }
    }
}

#define FUSED_CASE(TYPE)                                                                                        \
    case TYPE:                                                                                                  \
        switch (m) {                                                                                            \
        case 1: fused_rows(TYPE, 1, w, row_bytes, r0, r1, x, ldx, xsum, k, out, ldo); return;                         \
        case 2: fused_rows(TYPE, 2, w, row_bytes, r0, r1, x, ldx, xsum, k, out, ldo); return;                         \
        case 3: fused_rows(TYPE, 3, w, row_bytes, r0, r1, x, ldx, xsum, k, out, ldo); return;                         \
        default: fused_rows(TYPE, 4, w, row_bytes, r0, r1, x, ldx, xsum, k, out, ldo); return;                        \
        }

/* Rows [r0, r1) of out for m <= FUSED_MAX_M activation rows; k a multiple of 32; xsum [m, k / 32] holds each
 * activation row's sum over every block of 32. */
AVX2 static void fused_avx2(int type, int64_t m, const uint8_t *w, int64_t row_bytes, int64_t r0, int64_t r1,
                            const float *x, int64_t ldx, const float *xsum, int64_t k, float *out, int64_t ldo) {
    switch (type) {
        FUSED_CASE(T_F32) FUSED_CASE(T_F16) FUSED_CASE(T_BF16) FUSED_CASE(T_Q4_0) FUSED_CASE(T_Q4_1)
        FUSED_CASE(T_Q5_0) FUSED_CASE(T_Q5_1) FUSED_CASE(T_Q8_0)
    }
}

int pagellm_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}
#else
int pagellm_cpu_has_avx2(void) { return 0; }
#endif

/* ---- entry points ------------------------------------------------------------------------------------- */

/* Rows `ids[0..n)` of a [*, k] matrix stored as `type` (row stride row_bytes) as float32 into out [n, k]. */
int pagellm_dequantize_rows(int type, const uint8_t *w, int64_t row_bytes, const int64_t *ids, int64_t n, int64_t k,
                            float *out, int nthreads, int use_avx2) {
    int64_t block_bytes, block_elems;
    if (!type_layout(type, &block_bytes, &block_elems) || k % block_elems) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (n > 16)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *src = w + ids[i] * row_bytes;
#if HAVE_X86
        if (use_avx2) { dequant_row_avx2(type, src, out + i * k, k); continue; }
#endif
        dequant_row_scalar(type, src, out + i * k, k);
    }
    return 0;
}

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) times W^T, W [n, k] stored as `type` (row stride
 * row_bytes). Returns 0, -1 for an unsupported type or shape, -2 when a buffer cannot be allocated. */
int pagellm_linear(int type, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *w, int64_t row_bytes,
                   int64_t n, float *out, int64_t ldo, int nthreads, int use_avx2) {
    int64_t block_bytes, block_elems;
    if (!type_layout(type, &block_bytes, &block_elems) || k % block_elems) return -1;
#if HAVE_X86
    if (use_avx2 && m <= FUSED_MAX_M && k % 32 == 0) {
        float *xsum = malloc((size_t)(m * (k / 32)) * sizeof(float));
        if (xsum == NULL) return -2;
        for (int64_t i = 0; i < m; i++)
            for (int64_t b = 0; b < k / 32; b++) {
                float s = 0.0f;
                for (int j = 0; j < 32; j++) s += x[i * ldx + b * 32 + j];
                xsum[i * (k / 32) + b] = s;
            }
        const int64_t chunk = 16; /* rows per scheduling unit: keeps the split even on small matrices */
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t r0 = 0; r0 < n; r0 += chunk)
            fused_avx2(type, m, w, row_bytes, r0, r0 + chunk < n ? r0 + chunk : n, x, ldx, xsum, k, out, ldo);
        free(xsum);
        return 0;
    }
#endif
    const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    int status = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buffer = type == T_F32 ? NULL : malloc((size_t)(TILE_ROWS * k) * sizeof(float));
        if (type != T_F32 && buffer == NULL) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (type != T_F32 && buffer == NULL) continue;
            const int64_t r0 = t * TILE_ROWS, rb = n - r0 < TILE_ROWS ? n - r0 : TILE_ROWS;
            const float *tile;
            int64_t ldw;
            if (type == T_F32) {
                tile = (const float *)(w + r0 * row_bytes);
                ldw = row_bytes / 4;
            } else {
                for (int64_t r = 0; r < rb; r++) {
#if HAVE_X86
                    if (use_avx2) { dequant_row_avx2(type, w + (r0 + r) * row_bytes, buffer + r * k, k); continue; }
#endif
                    dequant_row_scalar(type, w + (r0 + r) * row_bytes, buffer + r * k, k);
                }
                tile = buffer;
                ldw = k;
            }
#if HAVE_X86
            if (use_avx2) { tile_gemm_avx2(x, m, ldx, tile, rb, ldw, k, out + r0, ldo); continue; }
#endif
            tile_gemm_scalar(x, m, ldx, tile, rb, ldw, k, out + r0, ldo);
        }
        free(buffer);
    }
    return status;
}

/* The same product for a weight described once (the per-call argument list stays short: this is called ~100
 * times per decode step from Python, where every argument costs). out is [m, n], contiguous. */
typedef struct {
    int32_t type, use_avx2;
    const uint8_t *w;
    int64_t row_bytes, n, k;
} pagellm_matrix;

int pagellm_matmul(const pagellm_matrix *w, const float *x, int64_t m, int64_t ldx, float *out, int nthreads) {
    return pagellm_linear(w->type, x, m, w->k, ldx, w->w, w->row_bytes, w->n, out, w->n, nthreads, w->use_avx2);
}
