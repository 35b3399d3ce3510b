/* y = x W^T on the CPU with W kept in its GGUF storage type: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K,
 * Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS.
 *
 * Arithmetic: by default activations stay float32 (never quantized, unlike llama.cpp) and every product is
 * accumulated in float32. Dequantization (pagellm_dequantize_rows, and the tile path below) reproduces ggml's float
 * weights bit for bit (compiled with -ffp-contract=off, so `d * q + m` is rounded twice as there). The small-M path
 * regroups each block's products around its scales, d * sum(q x) + m * sum(x): the same sum up to float32
 * rounding. A matrix with `int8_activations` set takes llama.cpp's arithmetic on that path instead (linear_int8.inc).
 *
 * Work split: for a few activation rows (up to GROUP_FUSED_MAX_ROWS or SUPER_FUSED_MAX_ROWS, INT8_MAX_ROWS with int8
 * activations, FUSED_MAX_M for float weights) each block is decoded in registers, once for every FUSED_MAX_M of them
 * (WIDE_MAX_M for the 32-weight types with AVX-512), streaming the packed weights once; 32-weight block types go four
 * weight rows at a time through the interleaved layout (ggml_blocks.h), which kernels/linear.py gives them when they
 * are loaded. For more rows (prefill), the weight is dequantized once per call, a slice of a few rows at a time that
 * stays in cache while it meets every activation row in a register-blocked outer product (linear_tiles.inc). The
 * portable path dequantizes TILE_ROWS rows at a time into a buffer instead. Work is spread over OpenMP threads (the
 * process's libgomp: the same pool PyTorch uses).
 *
 * Each function has an AVX2+FMA+F16C version (target attribute) and a portable scalar version; the caller picks
 * with `use_avx2`, after asking pagellm_cpu_has_avx2(). The tile path and the small-M path's float32-activation
 * kernels of the float and 32-weight types also have an AVX-512F version, taken with `use_avx512`
 * (pagellm_cpu_has_avx512()), which computes the same floats twice as wide.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_blocks.h"
#include "ggml_k_quants.h"

#define TILE_ROWS 4 /* the portable path's weight rows per buffer */

/* The weight as Python describes it once (kernels/linear.py `_Matrix`); the fused decoder passes these around. A
 * stack (num_parts > 0) is several matrices of one input stacked along the output, each in its own storage type
 * (a fused q|k|v whose v the file stores in another type): `parts` describes them and the other fields but n and
 * k are unused. */
typedef struct pagellm_matrix {
    int32_t type, use_avx2, int8_activations; /* int8_activations: linear_int8.inc's arithmetic at small M */
    int32_t use_avx512;                       /* the AVX-512 variants (same floats) */
    const uint8_t *w;
    int64_t row_bytes, n, k, grouped_rows; /* grouped_rows: rows [0, grouped_rows) interleaved by four */
    int64_t num_parts;
    const struct pagellm_matrix *parts;
} pagellm_matrix;

/* The activation rows as the small-M kernels read them. */
typedef struct {
    const float *x; /* [m, k], row stride ldx */
    int64_t ldx;
    const float *sum;      /* [m, k / 32]: each row's exact sum over every block of 32 */
    const float *sum16;    /* [m, k / 16]: the same over every 16 (Q2_K's minimums), or NULL */
    const int8_t *q;       /* int8 activations [m, k] (linear_int8.inc), or NULL */
    const float *scale;    /* [m, k / q8_group(type)]: their scales */
    const int16_t *qsum16; /* [m, k / 16]: sums of q over each 16 */
} activations;

/* Rows [a0, ...) of `all`, k wide (group: q8_group of the type). */
static inline activations activation_rows(const activations *all, int64_t a0, int64_t k, int64_t group) {
    return (activations){.x = all->x + a0 * all->ldx,
                         .ldx = all->ldx,
                         .sum = all->sum + a0 * (k / 32),
                         .sum16 = all->sum16 + a0 * (k / 16),
                         .q = all->q ? all->q + a0 * k : NULL,
                         .scale = all->scale + a0 * (k / group),
                         .qsum16 = all->qsum16 + a0 * (k / 16)};
}

/* Columns [c0, c1) of row r as float32 into dst; c0 and c1 whole blocks (or k). */
static void dequant_row_scalar(const pagellm_matrix *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *src = w->w + r * w->row_bytes;
    switch (w->type) {
    case T_F32:
        memcpy(dst, src + 4 * c0, (size_t)(c1 - c0) * 4);
        return;
    case T_F16:
        for (int64_t i = c0; i < c1; i++) dst[i - c0] = fp16_to_fp32(load_u16(src + 2 * i));
        return;
    case T_BF16:
        for (int64_t i = c0; i < c1; i++) {
            const uint32_t bits = (uint32_t)load_u16(src + 2 * i) << 16;
            memcpy(dst + i - c0, &bits, 4);
        }
        return;
    }
    if (is_k_type(w->type)) {
        for (int64_t s = c0 / 256; s < c1 / 256; s++)
            dequant_super_block_scalar(w->type, src + s * super_block_bytes(w->type), dst + 256 * s - c0);
        return;
    }
    for (int64_t b = c0 / 32; b < c1 / 32; b++)
        dequant_block_scalar(w->type, block_at(w->type, w->w, w->row_bytes, w->grouped_rows, r, b), dst + 32 * b - c0);
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

/* Same contract as dequant_row_scalar, bit-identical. */
AVX2 static void dequant_row_avx2(const pagellm_matrix *w, int64_t r, int64_t c0, int64_t c1, float *dst) {
    const uint8_t *src = w->w + r * w->row_bytes;
    if (w->type == T_F16) {
        int64_t i = c0;
        for (; i + 8 <= c1; i += 8)
            _mm256_storeu_ps(dst + i - c0, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src + 2 * i))));
        for (; i < c1; i++) dst[i - c0] = fp16_to_fp32(load_u16(src + 2 * i));
        return;
    }
    if (is_k_type(w->type)) {
        for (int64_t s = c0 / 256; s < c1 / 256; s++)
            dequant_super_block_avx2(w->type, src + s * super_block_bytes(w->type), dst + 256 * s - c0);
        return;
    }
    if (!is_block_type(w->type)) {
        dequant_row_scalar(w, r, c0, c1, dst);
        return;
    }
    /* One loop per type: with the type a constant, the block's layout and decoding fold into straight-line code
     * (a switch per block cost about a third of the tiles' dequantization). */
#define DEQUANT_BLOCKS(type)                                                                                           \
    for (int64_t b = c0 / 32; b < c1 / 32; b++)                                                                        \
        dequant_block_avx2(type, block_at(type, w->w, w->row_bytes, w->grouped_rows, r, b), dst + 32 * b - c0);
    /* clang-format off */
    switch (w->type) {
    case T_Q4_0: DEQUANT_BLOCKS(T_Q4_0); break;
    case T_Q4_1: DEQUANT_BLOCKS(T_Q4_1); break;
    case T_Q5_0: DEQUANT_BLOCKS(T_Q5_0); break;
    case T_Q5_1: DEQUANT_BLOCKS(T_Q5_1); break;
    case T_Q8_0: DEQUANT_BLOCKS(T_Q8_0); break;
    case T_IQ4_NL: DEQUANT_BLOCKS(T_IQ4_NL); break;
    default: DEQUANT_BLOCKS(w->type); break; /* a block type added later, at the old speed */
    }
    /* clang-format on */
#undef DEQUANT_BLOCKS
}

AVX2 static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The fragments below are included here, not at the top: they use the types and static functions above, and
 * sharing one translation unit lets the always_inline kernels inline across them. */
#include "linear_tiles.inc"

/* ---- small M: the block decoded in registers, no buffer (linear_fused.inc; linear_int8.inc when opted in) --- */
/* Activation rows per kernel call: AVX2's register budget. */
#define FUSED_MAX_M 4
/* The AVX-512 group kernel's (32-weight types): its 32 registers hold 8 rows' accumulators, so a speculative verify
 * step's 5-8 rows decode each block once instead of twice. A row's floats do not depend on the rows beside it. */
#define WIDE_MAX_M 8
/* Up to how many rows the small-M path beats dequantized tiles (measured on SmolLM2's layer shapes, 2 threads, AMD
 * Zen 5): the 32-weight types up to 12 rows (AVX-512, 8 rows a pass: 1.75-2.1x at 9 rows, 1.5-1.8x at 12; AVX2, 4
 * a pass: 1.05-1.4x at 9, 0.85-1.35x at 12 (Q5_1 and IQ4_NL lose, Q4_0 and Q8_0 win, Q4_1 even); at 16 AVX2 fell to
 * 0.7-0.85x); K-quants and IQ4_XS up to 8 (their 4-row passes at 12: 0.6-0.85x); with int8 activations up to 48 on
 * the 32-weight types (1.8x at 8; at 48 even on Q4_1; 0.9x at 128 against linear_tiles.inc); float weights only at
 * FUSED_MAX_M (0.96x at 5). K-quants with int8 activations take the small-M path at any length: against
 * linear_tiles.inc on TinyLlama's shapes it measured 1.2-1.25x at 64 rows and 1.05-1.15x at 512 (Q3_K 1.1x at 64,
 * even from 128). The limits are the same with and without AVX-512: the two paths compute different floats, and
 * every CPU must pick the same. */
#define GROUP_FUSED_MAX_ROWS 12
#define SUPER_FUSED_MAX_ROWS 8
#define INT8_MAX_ROWS 48

/* One call per m (1..FUSED_MAX_M), each a constant the kernel is specialised for. Kept as a table, one case a line
 * (clang-format would give each case four). */
/* clang-format off */
#define FOR_M(m, call)                                                                                                \
    switch (m) {                                                                                                      \
    case 1: { const int M = 1; call; } break;                                                                         \
    case 2: { const int M = 2; call; } break;                                                                         \
    case 3: { const int M = 3; call; } break;                                                                         \
    default: { const int M = 4; call; } break;                                                                        \
    }
#define FOR_WIDE_M(m, call)                                                                                           \
    switch (m) {                                                                                                      \
    case 5: { const int M = 5; call; } break;                                                                         \
    case 6: { const int M = 6; call; } break;                                                                         \
    case 7: { const int M = 7; call; } break;                                                                         \
    case 8: { const int M = 8; call; } break;                                                                         \
    default: FOR_M(m, call)                                                                                           \
    }
/* clang-format on */
#include "linear_int8.inc"
#include "linear_fused.inc"

/* The AVX2 small-M work of one storage type: every type with float32 activations (exact_rows, linear_fused.inc),
 * K-quants, and the 32-weight types with int8 activations. */
AVX2 static inline __attribute__((always_inline)) void fused_typed(const int type, int64_t m, const pagellm_matrix *w,
                                                                   int64_t r0, int64_t r1, const activations *act,
                                                                   float *out, int64_t ldo) {
    const int int8 = act->q != NULL;
    if (is_k_type(type)) {
        if (int8) FOR_M(m, k_rows_q8(type, M, w, r0, r1, act, out, ldo))
        else FOR_M(m, k_rows(type, M, w, r0, r1, act, out, ldo))
        return;
    }
    if (!int8) {
        exact_rows_avx2(type, m, w, r0, r1, act, out, ldo);
        return;
    }
    for (; r0 + 4 <= r1 && r0 + 4 <= w->grouped_rows; r0 += 4)
        FOR_M(m, group_rows_q8(type, M, w->w + r0 * w->row_bytes, w->k / 32, act, out + r0, ldo))
    FOR_M(m, block_rows(type, M, w, r0, r1, act, out, ldo)) /* rows outside the groups (float32 activations) */
}

/* Each storage type a constant the kernels are specialised for: a table by type family (clang-format cannot see
 * that a FUSED_TYPE is a whole case). */
#define FUSED_TYPE(kernel, t)                                                                                          \
    case t:                                                                                                            \
        kernel(t, m, w, r0, r1, act, out, ldo);                                                                        \
        return;

/* Rows [r0, r1) of out for m <= FUSED_MAX_M activation rows; k a multiple of 32. */
AVX2 static void fused_avx2(const pagellm_matrix *w, int64_t m, int64_t r0, int64_t r1, const activations *act,
                            float *out, int64_t ldo) {
    /* clang-format off */
    switch (w->type) {
    FUSED_TYPE(fused_typed, T_F32) FUSED_TYPE(fused_typed, T_F16) FUSED_TYPE(fused_typed, T_BF16)
    FUSED_TYPE(fused_typed, T_Q4_0) FUSED_TYPE(fused_typed, T_Q4_1) FUSED_TYPE(fused_typed, T_Q5_0)
    FUSED_TYPE(fused_typed, T_Q5_1) FUSED_TYPE(fused_typed, T_Q8_0) FUSED_TYPE(fused_typed, T_IQ4_NL)
    FUSED_TYPE(fused_typed, T_Q2_K) FUSED_TYPE(fused_typed, T_Q3_K) FUSED_TYPE(fused_typed, T_Q4_K)
    FUSED_TYPE(fused_typed, T_Q5_K) FUSED_TYPE(fused_typed, T_Q6_K) FUSED_TYPE(fused_typed, T_IQ4_XS)
    }
    /* clang-format on */
}

/* fused_avx2's floats, for float32 activations and a float or 32-weight block type (fused_exact_avx512 says
 * which); the rest runs fused_avx2. */
AVX512 static void fused_avx512(const pagellm_matrix *w, int64_t m, int64_t r0, int64_t r1, const activations *act,
                                float *out, int64_t ldo) {
    /* clang-format off */
    switch (w->type) {
    FUSED_TYPE(exact_rows_avx512, T_F32) FUSED_TYPE(exact_rows_avx512, T_F16) FUSED_TYPE(exact_rows_avx512, T_BF16)
    FUSED_TYPE(exact_rows_avx512, T_Q4_0) FUSED_TYPE(exact_rows_avx512, T_Q4_1) FUSED_TYPE(exact_rows_avx512, T_Q5_0)
    FUSED_TYPE(exact_rows_avx512, T_Q5_1) FUSED_TYPE(exact_rows_avx512, T_Q8_0) FUSED_TYPE(exact_rows_avx512, T_IQ4_NL)
    }
    /* clang-format on */
}
#undef FUSED_TYPE

/* Whether fused_avx512 takes this matrix's small-M work (K-quants and int8 activations stay AVX2). */
static int fused_exact_avx512(const pagellm_matrix *w, int int8) {
    return w->use_avx512 && !int8 && !is_k_type(w->type);
}

int pagellm_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

int pagellm_cpu_has_avx512(void) {
    __builtin_cpu_init();
    return pagellm_cpu_has_avx2() && __builtin_cpu_supports("avx512f");
}
#else
int pagellm_cpu_has_avx2(void) { return 0; }
int pagellm_cpu_has_avx512(void) { return 0; }
#endif

/* ---- entry points ------------------------------------------------------------------------------------- */

static int valid(const pagellm_matrix *w) {
    if (w->num_parts) return 0; /* only pagellm_matmul takes a stack */
    if (is_float_type(w->type)) return w->row_bytes >= w->k * element_bytes(w->type);
    if (is_k_type(w->type))
        return w->k % 256 == 0 && w->row_bytes == w->k / 256 * super_block_bytes(w->type) && w->grouped_rows == 0;
    return is_block_type(w->type) && w->k % 32 == 0 && w->row_bytes == w->k / 32 * block_bytes(w->type) &&
           w->grouped_rows % 4 == 0 && w->grouped_rows <= w->n;
}

static void dequant_row(const pagellm_matrix *w, int64_t r, float *dst) {
#if HAVE_X86
    if (w->use_avx2) {
        dequant_row_avx2(w, r, 0, w->k, dst);
        return;
    }
#endif
    dequant_row_scalar(w, r, 0, w->k, dst);
}

/* Rows `ids[0..count)` of the matrix as float32 into out [count, k]. Returns 0, or -1 for an invalid matrix. */
int pagellm_dequantize_rows(const pagellm_matrix *w, const int64_t *ids, int64_t count, float *out, int nthreads) {
    if (!valid(w)) return -1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (count > 16)
    for (int64_t i = 0; i < count; i++) dequant_row(w, ids[i], out + i * w->k);
    return 0;
}

/* A plain block-type matrix src [n, row_bytes] rewritten into dst in the interleaved layout (ggml_blocks.h).
 * Returns the number of grouped rows, or -1 for a type without blocks. */
int64_t pagellm_interleave(int type, const uint8_t *src, int64_t n, int64_t row_bytes, uint8_t *dst) {
    if (!is_block_type(type)) return -1;
    const int64_t grouped = n & ~(int64_t)3, blocks = row_bytes / block_bytes(type), qb = quant_bytes(type);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < grouped; g += 4)
        for (int64_t b = 0; b < blocks; b++)
            for (int i = 0; i < 4; i++) {
                const block_ref from = block_at(type, src, row_bytes, 0, g + i, b);
                const block_ref to = block_at(type, dst, row_bytes, grouped, g + i, b);
                memcpy((void *)to.d, from.d, 2);
                if (has_min(type)) memcpy((void *)to.m, from.m, 2);
                if (five_bit(type)) memcpy((void *)to.qh, from.qh, 4);
                memcpy((void *)to.qs, from.qs, (size_t)qb);
            }
    memcpy(dst + grouped * row_bytes, src + grouped * row_bytes, (size_t)((n - grouped) * row_bytes));
    return grouped;
}

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) times W^T for one matrix (not a stack). */
static int matmul_into(const pagellm_matrix *w, const float *x, int64_t m, int64_t ldx, float *out, int64_t ldo,
                       int nthreads) {
    if (!valid(w)) return -1;
    const int64_t n = w->n, k = w->k;
#if HAVE_X86
    const int int8 = w->int8_activations && !is_float_type(w->type);
    if (int8 && is_k_type(w->type) && m > M_CHUNK) { /* as the tiles: passes whose int8 rows stay in L2 */
        for (int64_t a0 = 0; a0 < m; a0 += M_CHUNK) {
            const int status =
                matmul_into(w, x + a0 * ldx, m - a0 < M_CHUNK ? m - a0 : M_CHUNK, ldx, out + a0 * ldo, ldo, nthreads);
            if (status) return status;
        }
        return 0;
    }
    const int64_t small = int8                     ? (is_k_type(w->type) ? m : INT8_MAX_ROWS)
                          : is_float_type(w->type) ? FUSED_MAX_M
                          : is_k_type(w->type)     ? SUPER_FUSED_MAX_ROWS
                                                   : GROUP_FUSED_MAX_ROWS;
    if (w->use_avx2 && m <= small && k % 32 == 0) {
        /* one allocation: exact sums over 32 and over 16, then (int8) scales, sums of 16 and the int8 rows, or
         * (float32 activations, strided levels) the activations permuted to the order the levels are decoded in */
        const int permuted = !int8 && strided_levels(w->type);
        float *xsum =
            malloc((size_t)(m * (k / 32)) * (int8 ? 4 * sizeof(float) + 4 + 32 : (3 + 32 * permuted) * sizeof(float)));
        if (xsum == NULL) return -2;
        float *xsum16 = xsum + m * (k / 32);
        float *scale = xsum16 + m * (k / 16);
        int16_t *qsum16 = (int16_t *)(scale + m * (k / 32));
        int8_t *q = (int8_t *)(qsum16 + m * (k / 16));
        const int64_t group = q8_group(w->type);
        const int offsets = w->type == T_Q3_K || w->type == T_Q6_K; /* int8 sums of 16 needed */
#pragma omp parallel for schedule(static) num_threads(nthreads) if (m > 2 * FUSED_MAX_M)
        for (int64_t i = 0; i < m; i++) {
            for (int64_t c = 0; c < k / 16; c++) {
                float s = 0.0f;
                for (int j = 0; j < 16; j++) s += x[i * ldx + c * 16 + j];
                xsum16[i * (k / 16) + c] = s;
                if (c & 1) xsum[i * (k / 32) + c / 2] = xsum16[i * (k / 16) + c - 1] + s;
            }
            if (int8)
                quantize_rows_q8(x + i * ldx, 1, ldx, k, group, q + i * k, scale + i * (k / group),
                                 offsets ? qsum16 + i * (k / 16) : NULL);
        }
        if (permuted) { /* after the sums: those over 16 are in element order */
            permute_activations(x, m, ldx, k, scale);
            x = scale, ldx = k;
        }
        const activations all = {
            .x = x, .ldx = ldx, .sum = xsum, .sum16 = xsum16, .q = int8 ? q : NULL, .scale = scale, .qsum16 = qsum16};
        /* Activation rows go a kernel's register budget at a time against the same 16 weight rows, which stay in
         * cache between them: the weights are still streamed from memory once. */
        const int64_t chunk = 16; /* rows per scheduling unit (whole groups): keeps the split even on small matrices */
        const int wide = fused_exact_avx512(w, int8);
        const int64_t step = wide && !is_float_type(w->type) ? WIDE_MAX_M : FUSED_MAX_M;
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t r0 = 0; r0 < n; r0 += chunk)
            for (int64_t a0 = 0; a0 < m; a0 += step) {
                const activations act = activation_rows(&all, a0, k, group);
                const int64_t rows = m - a0 < step ? m - a0 : step, r1 = r0 + chunk < n ? r0 + chunk : n;
                if (wide) fused_avx512(w, rows, r0, r1, &act, out + a0 * ldo, ldo);
                else fused_avx2(w, rows, r0, r1, &act, out + a0 * ldo, ldo);
            }
        free(xsum);
        return 0;
    }
#endif
#if HAVE_X86
    if (w->use_avx512) return tiles_avx512(w, x, m, ldx, out, ldo, nthreads);
    if (w->use_avx2) return tiles_avx2(w, x, m, ldx, out, ldo, nthreads);
#endif
    /* the portable path: TILE_ROWS rows at a time dequantized into a buffer (read in place for float32) */
    const int64_t tiles = (n + TILE_ROWS - 1) / TILE_ROWS;
    int status = 0;
#pragma omp parallel num_threads(nthreads)
    {
        float *buffer = w->type == T_F32 ? NULL : malloc((size_t)(TILE_ROWS * k) * sizeof(float));
        if (w->type != T_F32 && buffer == NULL) {
#pragma omp atomic write
            status = -2;
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            if (w->type != T_F32 && buffer == NULL) continue;
            const int64_t r0 = t * TILE_ROWS, rb = n - r0 < TILE_ROWS ? n - r0 : TILE_ROWS;
            if (w->type == T_F32) {
                tile_gemm_scalar(x, m, ldx, (const float *)(w->w + r0 * w->row_bytes), rb, w->row_bytes / 4, k,
                                 out + r0, ldo);
                continue;
            }
            for (int64_t r = 0; r < rb; r++) dequant_row_scalar(w, r0 + r, 0, k, buffer + r * k);
            tile_gemm_scalar(x, m, ldx, buffer, rb, k, k, out + r0, ldo);
        }
        free(buffer);
    }
    return status;
}

/* out [m, n] (contiguous) = x [m, k] (row stride ldx) times W^T; a stack's parts fill their columns in turn.
 * Returns 0, -1 for an invalid matrix, -2 when a buffer cannot be allocated. */
int pagellm_matmul(const pagellm_matrix *w, const float *x, int64_t m, int64_t ldx, float *out, int nthreads) {
    if (w->num_parts == 0) return matmul_into(w, x, m, ldx, out, w->n, nthreads);
    int64_t column = 0;
    for (int64_t i = 0; i < w->num_parts; i++) {
        const pagellm_matrix *part = w->parts + i;
        if (part->num_parts || part->k != w->k || column + part->n > w->n) return -1;
        const int status = matmul_into(part, x, m, ldx, out + column, w->n, nthreads);
        if (status) return status;
        column += part->n;
    }
    return column == w->n ? 0 : -1;
}
