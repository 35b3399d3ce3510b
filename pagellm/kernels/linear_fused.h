/* Part of linear_cpu.c (included after its matrix and activation types): the small-M kernels with float32
 * activations, the exact default.
 *
 * For decode-sized batches the tile buffer's store and reload cost more than the arithmetic, so each block is
 * decoded in registers and used straight away. A block's products are regrouped around its scales:
 *     sum_j (d q_j + m) x_j  =  d (sum_j q_j x_j) + m (sum_j x_j)
 * with sum_j x_j computed once per call. That removes the multiply and add per weight that rebuilding ggml's
 * float weights costs, and keeps float32 activations and float32 accumulation (no activation quantization);
 * the result differs from the tile path only by float32 rounding. Specialised per type and per M
 * (always_inline with constants).
 */

/* A block's levels for a float32 dot product, without their offset: strided for the types that matmul_into
 * permutes the activations for (strided_levels), else in element order. */
AVX2 static inline __attribute__((always_inline)) void dot_levels(const int type, block_ref ref, __m256 f[4]) {
    if (type == T_IQ4_NL) iq4_levels_strided(ref.qs, f);
    else if (strided_levels(type)) widen_strided(block_level_bytes(type, ref), f); /* Q5_0, Q5_1 */
    else block_levels(type, ref, f, 0);
}

/* What dot_levels leaves in the levels, which the products take back as offset * d * (sum of the activations). */
static inline int dot_offset(int type) { return type == T_IQ4_NL || type == T_IQ4_XS ? IQ4_OFFSET : level_offset(type); }

/* sum_j f_j x_j over a block's 32 weights (levels in f, activations at xb), as one vector of 8 partial sums: two
 * independent chains, added once. */
AVX2 static inline __attribute__((always_inline)) __m256 block_dot(const __m256 f[4], const float *xb) {
    const __m256 v01 = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), _mm256_mul_ps(f[0], _mm256_loadu_ps(xb)));
    const __m256 v23 = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), _mm256_mul_ps(f[2], _mm256_loadu_ps(xb + 16)));
    return _mm256_add_ps(v01, v23);
}

/* A float type's 32 values (block `ref`) as four vectors of 8. */
AVX2 static inline __attribute__((always_inline)) void float_block(const int type, block_ref ref, __m256 f[4]) {
    for (int p = 0; p < 4; p++) {
        const uint8_t *src = ref.qs + 8 * p * element_bytes(type);
        if (type == T_F32) f[p] = _mm256_loadu_ps((const float *)src);
        else if (type == T_F16) f[p] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)src));
        else f[p] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)src)), 16));
    }
}

/* Rows [r0, r1), one row at a time, for m activation rows. */
AVX2 static inline __attribute__((always_inline)) void fused_rows(const int type, const int m, const pagellm_matrix *w,
                                                                  int64_t r0, int64_t r1, const activations *act,
                                                                  float *out, int64_t ldo) {
    const float *x = act->x, *xsum = act->sum;
    const int64_t ldx = act->ldx;
    const int64_t blocks = w->k / 32;
    const int scaled = is_block_type(type);
    for (int64_t r = r0; r < r1; r++) {
        __m256 acc[FUSED_MAX_M][4];
        float min_acc[FUSED_MAX_M];
        for (int i = 0; i < m; i++) {
            min_acc[i] = 0.0f;
            for (int c = 0; c < 4; c++) acc[i][c] = _mm256_setzero_ps();
        }
        /* Consecutive blocks of a row lie `stride` bytes apart in either layout: one pointer walks the row and
         * the fields keep their offsets from it. */
        const block_ref first = block_at(type, w->w, w->row_bytes, w->grouped_rows, r, 0);
        const int64_t stride = !scaled ? 32 * element_bytes(type) : block_bytes(type) * (r < w->grouped_rows ? 4 : 1);
        const int64_t m_at = first.m - first.d, qh_at = first.qh - first.d, qs_at = first.qs - first.d;
        const uint8_t *base = first.d;
        for (int64_t b = 0; b < blocks; b++, base += stride) {
            const block_ref ref = {base, base + m_at, base + qh_at, base + qs_at};
            __m256 f[4];
            const float *xb = x + b * 32;
            if (!scaled) { /* four independent chains per row hide the FMA latency */
                float_block(type, ref, f);
                for (int i = 0; i < m; i++)
                    for (int p = 0; p < 4; p++)
                        acc[i][p] = _mm256_fmadd_ps(f[p], _mm256_loadu_ps(xb + i * ldx + 8 * p), acc[i][p]);
                continue;
            }
            dot_levels(type, ref, f);
            const float d = half_avx2(ref.d), mn = has_min(type) ? half_avx2(ref.m) : -(float)dot_offset(type) * d;
            const __m256 dv = _mm256_set1_ps(d);
            for (int i = 0; i < m; i++) {
                /* The block's dot product is independent of the accumulator, so only one FMA per block sits on
                 * the loop-carried chain. */
                acc[i][0] = _mm256_fmadd_ps(block_dot(f, xb + i * ldx), dv, acc[i][0]);
                if (has_min(type) || dot_offset(type)) min_acc[i] += mn * xsum[i * blocks + b];
            }
        }
        for (int i = 0; i < m; i++) {
            const __m256 total = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
            out[i * ldo + r] = hsum(total) + min_acc[i];
        }
    }
}

/* Lane i (0..3) of v, in every lane; v holds the same four values in both 128-bit halves, so an in-lane shuffle
 * does it (a lane-crossing one costs about three times as much here). */
AVX2 static inline __attribute__((always_inline)) __m256 lane_broadcast(__m256 v, const int i) {
    return i == 0 ? _mm256_permute_ps(v, 0x00) : i == 1 ? _mm256_permute_ps(v, 0x55)
         : i == 2 ? _mm256_permute_ps(v, 0xaa) : _mm256_permute_ps(v, 0xff);
}

/* m activation rows against an interleaved group of four weight rows: one load gives the four rows' scales (and
 * minimums), each block is decoded once for the m rows, and the 4 m accumulators are independent chains. The
 * minimums' term sum_b m_b xsum_b of the four rows builds up in one vector per activation row: lanes 4..7 from the
 * minimums, or lanes 0..3 from d (times -offset at the end: ggml's q - offset regrouped as d q - offset d).
 * With `int8` the block's products are linear_int8.h's integer dot product, scaled by d times the activations'
 * block scale. */
AVX2 static inline __attribute__((always_inline)) void group_gemm(const int type, const int m, const uint8_t *group,
                                                                  int64_t blocks, const activations *act, float *out,
                                                                  int64_t ldo, const int int8) {
    const float *x = act->x, *xsum = act->sum;
    const int64_t ldx = act->ldx;
    const int64_t stride = 4 * block_bytes(type);
    const int offset = int8 ? level_offset(type) : dot_offset(type); /* int8: IQ4_NL's signed levels, no offset */
    __m256 acc[FUSED_MAX_M][4], min_acc[FUSED_MAX_M];
    for (int a = 0; a < m; a++) {
        min_acc[a] = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) acc[a][i] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < blocks; b++, group += stride) {
        /* d0..d3 and, for types with a minimum, m0..m3 */
        const __m256 scales = _mm256_cvtph_ps(has_min(type) ? _mm_loadu_si128((const __m128i *)group)
                                                            : _mm_loadl_epi64((const __m128i *)group));
        const __m256 ds = _mm256_insertf128_ps(scales, _mm256_castps256_ps128(scales), 1); /* d0..d3 twice */
        for (int a = 0; a < m && (has_min(type) || offset); a++)
            min_acc[a] = _mm256_fmadd_ps(scales, _mm256_broadcast_ss(xsum + a * blocks + b), min_acc[a]);
        if (int8) {
            __m256i xq[FUSED_MAX_M];
            __m256 dx[FUSED_MAX_M];
            for (int a = 0; a < m; a++) {
                xq[a] = _mm256_loadu_si256((const __m256i *)(act->q + (a * blocks + b) * 32));
                dx[a] = _mm256_mul_ps(ds, _mm256_broadcast_ss(act->scale + a * blocks + b));
            }
            for (int i = 0; i < 4; i++) {
                const __m256i levels = block_level_bytes(type, group_block(type, group, i));
                for (int a = 0; a < m; a++)
                    acc[a][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot_q8(type, levels, xq[a])),
                                                lane_broadcast(dx[a], i), acc[a][i]);
            }
            continue;
        }
        for (int i = 0; i < 4; i++) {
            __m256 f[4];
            dot_levels(type, group_block(type, group, i), f);
            const __m256 d = lane_broadcast(ds, i);
            for (int a = 0; a < m; a++) {
                const float *xb = x + a * ldx + 32 * b;
                __m256 v = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
                v = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xb + 8), v);
                v = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xb + 16), v);
                v = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xb + 24), v);
                acc[a][i] = _mm256_fmadd_ps(v, d, acc[a][i]);
            }
        }
    }
    for (int a = 0; a < m; a++) {
        float mins[8];
        _mm256_storeu_ps(mins, min_acc[a]);
        /* ggml's offset: sum_b (-offset d_b) xsum_b, scaled once at the end (offset a power of two: exact) */
        for (int i = 0; i < 4; i++)
            out[a * ldo + i] = hsum(acc[a][i]) + (has_min(type) ? mins[4 + i] : -(float)offset * mins[i]);
    }
}

/* K-quant rows [r0, r1) for m activation rows, one row at a time: each sub-block's products regrouped around its
 * scale (and minimum), as for the 32-weight types. Each sub-block's sum is independent of the others, so a row
 * spreads them over CHAINS accumulators: with one, the two FMAs per 32 weights that add them in would form a
 * loop-carried chain of FMA latencies (about 3 ns per 32 weights for Q6_K) longer than the decoding itself. */
AVX2 static inline __attribute__((always_inline)) void k_rows(const int type, const int m, const pagellm_matrix *w,
                                                              int64_t r0, int64_t r1, const activations *act,
                                                              float *out, int64_t ldo) {
    const float *x = act->x, *xsum = act->sum;
    const int64_t ldx = act->ldx;
    enum { CHAINS = 4 };
    const int chains = m == 1 ? CHAINS : 2; /* more rows are more independent chains already */
    const int64_t supers = w->k / 256, blocks = w->k / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *sb = w->w + r * w->row_bytes;
        __m256 acc[FUSED_MAX_M][CHAINS], min_acc[FUSED_MAX_M];
        float scale[16]; /* the super-block's sub-block scales: broadcast from memory, a load, not a shuffle */
        for (int a = 0; a < m; a++) {
            min_acc[a] = _mm256_setzero_ps();
            for (int j = 0; j < CHAINS; j++) acc[a][j] = _mm256_setzero_ps();
        }
        for (int64_t s = 0; s < supers; s++, sb += super_block_bytes(type)) {
            __m256 f[4];
            if (type == T_IQ4_XS) { /* eight sub-blocks of 32, each IQ4_NL's nibbles */
                const __m256 d_sc = iq4xs_d_scales(sb);
                _mm256_storeu_ps(scale, d_sc);
                for (int a = 0; a < m; a++) /* the levels' offset, one lane per sub-block */
                    min_acc[a] = _mm256_fmadd_ps(_mm256_mul_ps(d_sc, _mm256_set1_ps((float)IQ4_OFFSET)),
                                                 _mm256_loadu_ps(xsum + a * blocks + 8 * s), min_acc[a]);
                for (int j = 0; j < 8; j++) {
                    iq4_levels_strided(sb + 8 + 16 * j, f);
                    const __m256 dl = _mm256_broadcast_ss(scale + j);
                    for (int a = 0; a < m; a++)
                        acc[a][j % chains] = _mm256_fmadd_ps(block_dot(f, x + a * ldx + 256 * s + 32 * j), dl,
                                                             acc[a][j % chains]);
                }
                continue;
            }
            if (is_k_nibble_type(type)) { /* Q4_K, Q5_K */
                __m256 d_sc, dmin_m;
                q4k_scales(sb, &d_sc, &dmin_m);
                _mm256_storeu_ps(scale, d_sc);
                for (int a = 0; a < m; a++) /* the minimums' term of the eight sub-blocks, one lane each */
                    min_acc[a] = _mm256_fmadd_ps(dmin_m, _mm256_loadu_ps(xsum + a * blocks + 8 * s), min_acc[a]);
                for (int c = 0; c < 4; c++) { /* sub-blocks 2c and 2c + 1 share their 32 bytes */
                    __m256 high[4];
                    if (strided_levels(type)) { /* Q5_K: its fifth bits cost less on bytes */
                        __m256i low_bytes, high_bytes;
                        k_nibble_level_bytes(type, sb, c, &low_bytes, &high_bytes);
                        widen_strided(low_bytes, f);
                        widen_strided(high_bytes, high);
                    } else {
                        k_nibble_levels(type, sb, c, f, high);
                    }
                    const __m256 d_low = _mm256_broadcast_ss(scale + 2 * c), d_high = _mm256_broadcast_ss(scale + 2 * c + 1);
                    for (int a = 0; a < m; a++) {
                        const float *xb = x + a * ldx + 256 * s + 64 * c;
                        __m256 v = _mm256_mul_ps(f[0], _mm256_loadu_ps(xb));
                        __m256 u = _mm256_mul_ps(high[0], _mm256_loadu_ps(xb + 32));
                        for (int p = 1; p < 4; p++) {
                            v = _mm256_fmadd_ps(f[p], _mm256_loadu_ps(xb + 8 * p), v);
                            u = _mm256_fmadd_ps(high[p], _mm256_loadu_ps(xb + 32 + 8 * p), u);
                        }
                        acc[a][(2 * c) % chains] = _mm256_fmadd_ps(v, d_low, acc[a][(2 * c) % chains]);
                        acc[a][(2 * c + 1) % chains] = _mm256_fmadd_ps(u, d_high, acc[a][(2 * c + 1) % chains]);
                    }
                }
                continue;
            }
            /* Q2_K, Q3_K, Q6_K: the sixteen sub-block scales times d, as ggml rounds them (d * sc) */
            if (type == T_Q2_K) {
                __m256 d_sc[2], dmin_m[2];
                q2k_scales(sb, d_sc, dmin_m);
                _mm256_storeu_ps(scale, d_sc[0]);
                _mm256_storeu_ps(scale + 8, d_sc[1]);
                for (int a = 0; a < m; a++) { /* the minimums' term, one lane per sub-block of 16 */
                    const float *sums = act->sum16 + a * (w->k / 16) + 16 * s;
                    min_acc[a] = _mm256_fmadd_ps(dmin_m[1], _mm256_loadu_ps(sums + 8),
                                                 _mm256_fmadd_ps(dmin_m[0], _mm256_loadu_ps(sums), min_acc[a]));
                }
            } else { /* the offset (Q6_K 32, Q3_K 4) times each sub-block's scale and exact sum of 16 */
                const __m128i packed = type == T_Q3_K ? q3k_scales_avx2(sb) : _mm_loadu_si128((const __m128i *)(sb + 192));
                const __m256 d = _mm256_set1_ps(half_avx2(sb + (type == T_Q3_K ? 108 : 208)));
                const __m256 d_sc[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(packed))),
                                        _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(packed, 8))))};
                _mm256_storeu_ps(scale, d_sc[0]);
                _mm256_storeu_ps(scale + 8, d_sc[1]);
                const __m256 offset = _mm256_set1_ps(type == T_Q3_K ? 4.0f : 32.0f); /* powers of two: exact */
                for (int a = 0; a < m; a++) {
                    const float *sums = act->sum16 + a * (w->k / 16) + 16 * s;
                    min_acc[a] = _mm256_fmadd_ps(_mm256_mul_ps(d_sc[1], offset), _mm256_loadu_ps(sums + 8),
                                                 _mm256_fmadd_ps(_mm256_mul_ps(d_sc[0], offset), _mm256_loadu_ps(sums), min_acc[a]));
                }
            }
            for (int half = 0; half < 2; half++) {
                __m256i q[4]; /* unsigned levels, the offset left to min_acc */
                if (type == T_Q2_K) q2k_level_bytes(sb, half, q);
                else if (type == T_Q3_K) q3k_level_bytes(sb, half, q);
                else q6k_level_bytes(sb + 64 * half, sb + 128 + 32 * half, q);
                for (int t = 0; t < 4; t++) { /* 32 weights, two sub-blocks of 16: lanes 0..3 and 4..7 */
                    widen_strided(q[t], f);
                    const float *pair = scale + 8 * half + 2 * t;
                    const __m256 d_pair = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(pair)),
                                                               _mm_broadcast_ss(pair + 1), 1);
                    for (int a = 0; a < m; a++)
                        acc[a][t % chains] = _mm256_fmadd_ps(block_dot(f, x + a * ldx + 256 * s + 128 * half + 32 * t),
                                                             d_pair, acc[a][t % chains]);
                }
            }
        }
        for (int a = 0; a < m; a++) {
            __m256 total = acc[a][0];
            for (int j = 1; j < chains; j++) total = _mm256_add_ps(total, acc[a][j]);
            out[a * ldo + r] = hsum(total) - hsum(min_acc[a]);
        }
    }
}

