/* Part of linear_cpu.c (included after dequant_row_avx2): the large-M path (prefill), float32 activations, exact.
 *
 * The activations are first repacked once per call into blocks of BLOCK_M rows, column-major within a block
 * ([k][16]), so that one column of a block is two vectors. The weight goes in panels of PANEL_ROWS rows, each
 * dequantized once per call, KC columns at a time, into a small row-major slice; the micro-kernel is an outer
 * product of a slice with an activation block: per column, two activation vectors and PANEL_ROWS broadcast
 * weights feed 12 accumulators, 2/3 of a load per FMA, all from L1. Sums accumulate across the slices in a
 * per-thread transposed buffer, written to `out` once the panel is done. No weight is transposed: a transposed
 * slice cost as much as dequantizing Q4_K.
 *
 * Each thread takes an equal run of panels (its own columns of `out`), so every weight is dequantized exactly
 * once per call. Measured on TinyLlama's shapes, 2 threads: 150-175 GFLOP/s, against 110-145 for the
 * dot-product tiles this replaced (which read all M activation rows per four weight rows, from L3 once they
 * outgrew L2) and about 194 for the FMA units' peak.
 */
#define PANEL_ROWS 6 /* weight rows per panel: 6 x 2 accumulators, 3 registers to spare */
#define BLOCK_M 16   /* activation rows per block: two vectors */
#define KC 256       /* columns per slice: one K-quant super-block */
#define GROUP 4      /* panels sharing each activation block: 24 KB of slices */
/* Activation rows per pass over the weight: every group of panels streams all the pass's packed rows, which must
 * stay in L2 (at 2048 rows they came from L3 or memory: 124-153 GFLOP/s on SmolLM2's shapes, 127-136 on
 * TinyLlama's; in passes of 256, 162-180, as fast as PyTorch's GEMM on float32 weights). Each pass dequantizes
 * the weight again, ~1% of its multiplications. */
#define M_CHUNK 256

/* dst[j * ldd + i] = src[i * lds + j] for i, j < 8. */
AVX2 static inline void transpose8(const float *src, int64_t lds, float *dst, int64_t ldd) {
    __m256 r[8], t[8];
    for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(src + i * lds);
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int j = 0; j < 2; j++) {
            r[i + 2 * j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
            r[i + 2 * j + 1] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xee);
        }
    for (int i = 0; i < 4; i++) {
        _mm256_storeu_ps(dst + i * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
        _mm256_storeu_ps(dst + (i + 4) * ldd, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
    }
}

/* Rows [m0, m0 + BLOCK_M) of x [m, k] as block[j * BLOCK_M + i] = x[(m0 + i) * ldx + j]; rows past m are zero. */
AVX2 static void pack_block(const float *x, int64_t m, int64_t ldx, int64_t k, int64_t m0, float *block) {
    const int64_t k8 = k & ~(int64_t)7;
    for (int h = 0; h < BLOCK_M; h += 8) {
        const float *rows = x + (m0 + h) * ldx;
        if (m0 + h + 8 <= m) {
            for (int64_t j = 0; j < k8; j += 8) transpose8(rows + j, ldx, block + j * BLOCK_M + h, BLOCK_M);
            for (int64_t j = k8; j < k; j++)
                for (int i = 0; i < 8; i++) block[j * BLOCK_M + h + i] = rows[i * ldx + j];
            continue;
        }
        for (int64_t j = 0; j < k; j++)
            for (int64_t i = 0; i < 8; i++) block[j * BLOCK_M + h + i] = m0 + h + i < m ? rows[i * ldx + j] : 0.0f;
    }
}

/* sums[r * lds + i] (+)= sum_j w[r * KC + j] block[j * BLOCK_M + i] for r < PANEL_ROWS, i < 8 nv, j < kc: added
 * when `accumulate`, else stored. nv = 1 serves a last block of at most 8 rows. Weight rows past `rows` repeat
 * row 0 (computed, stored, never read), so the loops have no branches. */
AVX2 static inline __attribute__((always_inline)) void micro_kernel(const int nv, const float *w, int64_t rows,
                                                                    const float *block, int64_t kc, float *sums,
                                                                    int64_t lds, int accumulate) {
    const float *wr[PANEL_ROWS];
    for (int r = 0; r < PANEL_ROWS; r++) wr[r] = w + (r < rows ? r : 0) * KC;
    __m256 acc[PANEL_ROWS][2];
    for (int r = 0; r < PANEL_ROWS; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t j = 0; j < kc; j++) {
        const __m256 x0 = _mm256_load_ps(block + j * BLOCK_M);
        const __m256 x1 = nv > 1 ? _mm256_load_ps(block + j * BLOCK_M + 8) : x0;
        for (int r = 0; r < PANEL_ROWS; r++) {
            const __m256 b = _mm256_broadcast_ss(wr[r] + j);
            acc[r][0] = _mm256_fmadd_ps(b, x0, acc[r][0]);
            if (nv > 1) acc[r][1] = _mm256_fmadd_ps(b, x1, acc[r][1]);
        }
    }
    /* constant indices only: an accumulator indexed by a variable would live on the stack, stored every step */
    for (int r = 0; r < PANEL_ROWS; r++)
        for (int v = 0; v < nv; v++) {
            float *s = sums + r * lds + 8 * v;
            _mm256_store_ps(s, accumulate ? _mm256_add_ps(_mm256_load_ps(s), acc[r][v]) : acc[r][v]);
        }
}

/* Panels [p0, p1) of out [m, n] = x W^T, x already packed in blocks: GROUP panels at a time, so that each
 * activation block, once in L1, serves all their slices (one panel at a time, the activations came from L3 once
 * per 6 weight rows: 1.06x at 512 rows). `buffer` holds the slices [GROUP][PANEL_ROWS][KC] and their sums
 * [GROUP][PANEL_ROWS][mp]. */
AVX2 static void panels_avx2(const pagellm_matrix *w, const float *packed, int64_t m, int64_t p0, int64_t p1,
                             float *buffer, float *out, int64_t ldo) {
    const int64_t n = w->n, k = w->k, blocks = (m + BLOCK_M - 1) / BLOCK_M, mp = blocks * BLOCK_M;
    float *slices = buffer, *sums = buffer + GROUP * PANEL_ROWS * KC;
    for (int64_t g0 = p0; g0 < p1; g0 += GROUP) {
        const int64_t panels = p1 - g0 < GROUP ? p1 - g0 : GROUP, r0 = g0 * PANEL_ROWS;
        const int64_t rows = n - r0 < panels * PANEL_ROWS ? n - r0 : panels * PANEL_ROWS; /* the group's */
        for (int64_t c0 = 0; c0 < k; c0 += KC) {
            const int64_t kc = k - c0 < KC ? k - c0 : KC;
            for (int64_t r = 0; r < rows; r++) {
                dequant_row_avx2(w, r0 + r, c0, c0 + kc, slices + r * KC);
                /* The rows' next super-blocks: GROUP x PANEL_ROWS short runs 1-2 KB apart, which the hardware
                 * prefetcher misses (measured 1.05x on Q6_K's 2048 x 5632 at 64 rows). */
                if (!is_k_type(w->type) || c0 + KC >= k) continue;
                const uint8_t *next = w->w + (r0 + r) * w->row_bytes + (c0 + KC) / 256 * super_block_bytes(w->type);
                for (int64_t l = 0; l < super_block_bytes(w->type); l += 64)
                    _mm_prefetch((const char *)next + l, _MM_HINT_T0);
            }
            for (int64_t b = 0; b < blocks; b++) {
                const float *block = packed + b * BLOCK_M * k + c0 * BLOCK_M;
                for (int64_t g = 0; g < panels; g++) {
                    const int64_t left = rows - g * PANEL_ROWS < PANEL_ROWS ? rows - g * PANEL_ROWS : PANEL_ROWS;
                    const float *slice = slices + g * PANEL_ROWS * KC;
                    float *s = sums + g * PANEL_ROWS * mp + b * BLOCK_M;
                    if (m - b * BLOCK_M > 8) micro_kernel(2, slice, left, block, kc, s, mp, c0 > 0);
                    else micro_kernel(1, slice, left, block, kc, s, mp, c0 > 0);
                }
            }
        }
        for (int64_t i = 0; i < m; i++)
            for (int64_t r = 0; r < rows; r++) out[i * ldo + r0 + r] = sums[r * mp + i];
    }
}

/* out [m, n] (row stride ldo) = x [m, k] (row stride ldx) times W^T. Returns 0, or -2 when a buffer cannot be
 * allocated. */
AVX2 static int tiles_avx2(const pagellm_matrix *w, const float *x, int64_t m, int64_t ldx, float *out, int64_t ldo,
                           int nthreads) {
    if (m > M_CHUNK) {
        for (int64_t a0 = 0; a0 < m; a0 += M_CHUNK) {
            const int status = tiles_avx2(w, x + a0 * ldx, m - a0 < M_CHUNK ? m - a0 : M_CHUNK, ldx, out + a0 * ldo, ldo,
                                          nthreads);
            if (status) return status;
        }
        return 0;
    }
    const int64_t k = w->k, blocks = (m + BLOCK_M - 1) / BLOCK_M, mp = blocks * BLOCK_M;
    const int64_t panels = (w->n + PANEL_ROWS - 1) / PANEL_ROWS;
    float *packed = aligned_alloc(32, (size_t)(mp * k) * sizeof(float));
    if (packed == NULL) return -2;
    int status = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) pack_block(x, m, ldx, k, b * BLOCK_M, packed + b * BLOCK_M * k);
        float *buffer = aligned_alloc(32, (size_t)(GROUP * PANEL_ROWS * (KC + mp)) * sizeof(float));
        if (buffer == NULL) {
#pragma omp atomic write
            status = -2;
        } else { /* each thread an equal run of panels */
            const int64_t t = omp_get_thread_num(), threads = omp_get_num_threads();
            panels_avx2(w, packed, m, panels * t / threads, panels * (t + 1) / threads, buffer, out, ldo);
        }
        free(buffer);
    }
    free(packed);
    return status;
}
