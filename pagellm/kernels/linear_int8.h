/* Part of linear_cpu.c (included after its matrix and activation types): the small-M path with int8 activations,
 * opt-in (`--quantize-activations`), llama.cpp's arithmetic.
 *
 * Each activation row is rounded to int8 with one float scale per group: 32 values for the 32-weight types (as
 * ggml's Q8_0), 256 for K-quants (as Q8_K). A block's products then become an integer dot product: vpmaddubsw
 * multiplies unsigned weight levels by signed activations and adds pairs, vpmaddwd adds pairs again (times
 * the sub-block scale, for K-quants), and the block is scaled in float once. That is about a third of the vector
 * operations per weight of the float path. Offsets and minimums keep the exact float32 activation sums, as in the
 * float path; the rest of the error is the rounding of each activation, up to half a step of max|x| / 127.
 */

/* Values per int8 activation scale, by weight type. */
static inline int64_t q8_group(int type) { return is_k_type(type) ? 256 : 32; }

/* x [m, k] (row stride ldx) as int8 q [m, k] with scale [m, k / group]: per group, scale = max|x| / 127 and
 * q = round(x / scale). sum16 [m, k / 16] gets the sums of q over each 16 (the offsets of Q3_K and Q6_K). */
AVX2 static void quantize_rows_q8(const float *x, int64_t m, int64_t ldx, int64_t k, int64_t group, int8_t *q,
                                  float *scale, int16_t *sum16) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes the packs' lane interleaving */
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < k / group; g++) {
            const float *xg = x + i * ldx + g * group;
            __m256 amax = _mm256_setzero_ps();
            for (int64_t j = 0; j < group; j += 8) amax = _mm256_max_ps(amax, _mm256_and_ps(_mm256_loadu_ps(xg + j), magnitude));
            __m128 h = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
            h = _mm_max_ps(h, _mm_movehl_ps(h, h));
            const float max = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
            scale[i * (k / group) + g] = max / 127.0f;
            const __m256 inverse = _mm256_set1_ps(max > 0.0f ? 127.0f / max : 0.0f);
            int8_t *qg = q + i * k + g * group;
            for (int64_t j = 0; j < group; j += 32) {
                __m256i n[4]; /* round to nearest (the default mode); |n| <= 127 */
                for (int p = 0; p < 4; p++) n[p] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + j + 8 * p), inverse));
                const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
                _mm256_storeu_si256((__m256i *)(qg + j), _mm256_permutevar8x32_epi32(packed, order));
            }
        }
    for (int64_t i = 0; sum16 != NULL && i < m; i++)
        for (int64_t c = 0; c < k / 16; c++) {
            int sum = 0;
            for (int j = 0; j < 16; j++) sum += q[i * k + 16 * c + j];
            sum16[i * (k / 16) + c] = (int16_t)sum;
        }
}

/* Sixteen int16 sums of pairs of a block's 32 products: unsigned levels times signed activations; signed levels
 * (Q8_0, IQ4_NL, IQ4_XS) move their signs onto the activations first (|w| <= 128 fits vpmaddubsw's unsigned
 * operand). */
AVX2 static inline __attribute__((always_inline)) __m256i pair_dot_q8(const int type, __m256i levels, __m256i x) {
    if (signed_levels(type)) return _mm256_maddubs_epi16(_mm256_sign_epi8(levels, levels), _mm256_sign_epi8(x, levels));
    return _mm256_maddubs_epi16(levels, x);
}

/* Eight int32 partial sums of a block's 32 products. */
AVX2 static inline __attribute__((always_inline)) __m256i block_dot_q8(const int type, __m256i levels, __m256i x) {
    return _mm256_madd_epi16(pair_dot_q8(type, levels, x), _mm256_set1_epi16(1));
}

/* K-quant (and IQ4_XS) rows [r0, r1) for m activation rows: a super-block's products, each times its integer
 * sub-block scale (vpmaddwd), add up in int32 and are scaled in float once; the offset of Q6_K (32) and Q3_K (4)
 * comes off as offset sum_j sc_j qsum16_j, and the minimums of Q2_K, Q4_K and Q5_K take the exact activation sums. */
AVX2 static inline __attribute__((always_inline)) void k_rows_q8(const int type, const int m, const pagellm_matrix *w,
                                                                 int64_t r0, int64_t r1, const activations *act,
                                                                 float *out, int64_t ldo) {
    const int64_t k = w->k, supers = k / 256, blocks = k / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *sb = w->w + r * w->row_bytes;
        __m256 acc[FUSED_MAX_M], min_acc[FUSED_MAX_M];
        for (int a = 0; a < m; a++) acc[a] = min_acc[a] = _mm256_setzero_ps();
        for (int64_t s = 0; s < supers; s++, sb += super_block_bytes(type)) {
            __m256i sum[FUSED_MAX_M];
            for (int a = 0; a < m; a++) sum[a] = _mm256_setzero_si256();
            float d;
            if (type == T_IQ4_XS) { /* eight sub-blocks of 32 with signed levels, each times its scale */
                int32_t sc[8];
                _mm256_storeu_si256((__m256i *)sc, iq4xs_scales(sb));
                for (int j = 0; j < 8; j++) {
                    const __m256i levels = iq4_level_bytes(sb + 8 + 16 * j), scale = _mm256_set1_epi16((short)sc[j]);
                    for (int a = 0; a < m; a++) {
                        const __m256i xq = _mm256_loadu_si256((const __m256i *)(act->q + a * k + 256 * s + 32 * j));
                        sum[a] = _mm256_add_epi32(sum[a], _mm256_madd_epi16(pair_dot_q8(type, levels, xq), scale));
                    }
                }
                d = half_avx2(sb);
            } else if (is_k_nibble_type(type)) { /* Q4_K, Q5_K */
                uint64_t packed_sc, packed_m;
                q4k_unpack(sb, &packed_sc, &packed_m);
                const __m256 dmin_m = _mm256_mul_ps(_mm256_set1_ps(half_avx2(sb + 2)), u8x8_to_ps(packed_m));
                for (int a = 0; a < m; a++) /* the minimums' term, exact sums: one lane per sub-block */
                    min_acc[a] = _mm256_fmadd_ps(dmin_m, _mm256_loadu_ps(act->sum + a * blocks + 8 * s), min_acc[a]);
                uint8_t sc[8];
                memcpy(sc, &packed_sc, 8);
                for (int c = 0; c < 4; c++) { /* sub-blocks 2c and 2c + 1: the low and high nibbles of 32 bytes */
                    __m256i low, high;
                    k_nibble_level_bytes(type, sb, c, &low, &high);
                    const __m256i sc_low = _mm256_set1_epi16(sc[2 * c]), sc_high = _mm256_set1_epi16(sc[2 * c + 1]);
                    for (int a = 0; a < m; a++) {
                        const int8_t *xq = act->q + a * k + 256 * s + 64 * c;
                        const __m256i p0 = _mm256_maddubs_epi16(low, _mm256_loadu_si256((const __m256i *)xq));
                        const __m256i p1 = _mm256_maddubs_epi16(high, _mm256_loadu_si256((const __m256i *)(xq + 32)));
                        sum[a] = _mm256_add_epi32(sum[a], _mm256_add_epi32(_mm256_madd_epi16(p0, sc_low),
                                                                           _mm256_madd_epi16(p1, sc_high)));
                    }
                }
                d = half_avx2(sb);
            } else { /* Q2_K, Q3_K, Q6_K: sixteen sub-blocks of 16; Q3_K and Q6_K with an offset of 4 or 32, Q2_K
                      * with minimums (exact sums, as Q4_K) */
                __m128i packed_scales;
                if (type == T_Q2_K) {
                    packed_scales = _mm_and_si128(_mm_loadu_si128((const __m128i *)sb), _mm_set1_epi8(0x0f));
                    __m256 d_sc[2], dmin_m[2]; /* d_sc unused here: the scales stay integers */
                    q2k_scales(sb, d_sc, dmin_m);
                    for (int a = 0; a < m; a++) {
                        const float *sums = act->sum16 + a * (k / 16) + 16 * s;
                        min_acc[a] = _mm256_fmadd_ps(dmin_m[1], _mm256_loadu_ps(sums + 8),
                                                     _mm256_fmadd_ps(dmin_m[0], _mm256_loadu_ps(sums), min_acc[a]));
                    }
                } else {
                    packed_scales = type == T_Q3_K ? q3k_scales_avx2(sb) : _mm_loadu_si128((const __m128i *)(sb + 192));
                }
                const __m256i sc16 = _mm256_cvtepi8_epi16(packed_scales);
                for (int half = 0; half < 2; half++) {
                    __m256i q[4];
                    if (type == T_Q2_K) q2k_level_bytes(sb, half, q);
                    else if (type == T_Q3_K) q3k_level_bytes(sb, half, q);
                    else q6k_level_bytes(sb + 64 * half, sb + 128 + 32 * half, q);
                    /* the half's eight scales in both 128-bit lanes, so one in-lane shuffle spreads two of them */
                    const __m256i sc_half = _mm256_permute4x64_epi64(sc16, half ? 0xee : 0x44);
                    for (int t = 0; t < 4; t++) { /* 32 weights: sub-blocks of 16 in the 128-bit halves */
                        const __m256i pick = _mm256_set_m128i(_mm_set1_epi16((short)(((4 * t + 3) << 8) | (4 * t + 2))),
                                                              _mm_set1_epi16((short)(((4 * t + 1) << 8) | (4 * t))));
                        const __m256i scales = _mm256_shuffle_epi8(sc_half, pick);
                        for (int a = 0; a < m; a++) {
                            const int8_t *xq = act->q + a * k + 256 * s + 128 * half + 32 * t;
                            const __m256i p = _mm256_maddubs_epi16(q[t], _mm256_loadu_si256((const __m256i *)xq));
                            sum[a] = _mm256_add_epi32(sum[a], _mm256_madd_epi16(p, scales));
                        }
                    }
                }
                for (int a = 0; a < m && type != T_Q2_K; a++) {
                    const __m256i sums = _mm256_loadu_si256((const __m256i *)(act->qsum16 + a * (k / 16) + 16 * s));
                    sum[a] = _mm256_sub_epi32(sum[a], _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), type == T_Q3_K ? 2 : 5));
                }
                d = half_avx2(sb + (type == T_Q2_K ? 80 : type == T_Q3_K ? 108 : 208));
            }
            for (int a = 0; a < m; a++)
                acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[a]), _mm256_set1_ps(d * act->scale[a * supers + s]), acc[a]);
        }
        for (int a = 0; a < m; a++) out[a * ldo + r] = hsum(acc[a]) - hsum(min_acc[a]);
    }
}
