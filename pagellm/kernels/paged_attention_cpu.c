/* Decode attention straight from the paged KV cache, float32, CPU.
 *
 * One query token per sequence. For each (sequence, kv head) the kernel reads every cached key of that sequence
 * once, in place, through the block table (no gathered copy), computes the scores of the query heads of the
 * group, takes the softmax and accumulates the values. Cache layout: [kv_heads, num_blocks, block_size, dim].
 * (sequence, kv head) pairs are spread over OpenMP threads (the process's libgomp, shared with PyTorch).
 * With AVX2 the dot products keep four independent accumulator chains and the value sum keeps its output row in
 * registers; otherwise the loops are left to the compiler's vectoriser.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd_exp.h"

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

static inline float dot(const float *a, const float *b, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
    if (n % 32 == 0) { /* four chains: one dependent FMA chain would leave the FMA units waiting on latency */
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < n; i += 32) {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
        }
        return hsum256(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    }
#endif
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* In place; vectorised exp where AVX2 is there (a scalar expf per score cost more than the dot products). */
static inline void softmax(float *s, int64_t len) {
    float max = -INFINITY, sum = 0.0f;
    for (int64_t t = 0; t < len; t++) max = s[t] > max ? s[t] : max;
    int64_t t = 0;
#if defined(__AVX2__) && defined(__FMA__)
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmax));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum256(vsum);
#endif
    for (; t < len; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
    const float inv = 1.0f / sum;
    for (t = 0; t < len; t++) s[t] *= inv;
}

/* Blocks are scattered, so the hardware prefetcher stops at each block's edge: ask for the next one early. */
static inline void prefetch_block(const float *base, const int64_t *table, int64_t block, int64_t len,
                                  int64_t block_size, int64_t head_dim) {
    if (block * block_size >= len) return;
    const char *start = (const char *)(base + table[block] * block_size * head_dim);
    const int64_t bytes = block_size * head_dim * (int64_t)sizeof(float);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset, 0, 1);
}

/* o[0..head_dim) = sum_t p[t] * v_t over the sequence's cached values, walking its blocks. */
static inline void weighted_values(const float *p, const float *values, const int64_t *table, int64_t len,
                                   float *o, int64_t head_dim, int64_t block_size) {
#if defined(__AVX2__) && defined(__FMA__)
    if (head_dim % 64 == 0) { /* 64 columns at a time in 8 registers: no load and store of o per token */
        for (int64_t c = 0; c < head_dim; c += 64) {
            __m256 acc[8];
            for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
            for (int64_t blk = 0, t0 = 0; t0 < len; blk++, t0 += block_size) {
                if (c == 0) prefetch_block(values, table, blk + 1, len, block_size, head_dim);
                const float *v = values + table[blk] * block_size * head_dim + c;
                const int64_t n = len - t0 < block_size ? len - t0 : block_size;
                for (int64_t i = 0; i < n; i++, v += head_dim) {
                    const __m256 w = _mm256_set1_ps(p[t0 + i]);
                    for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8 * j), acc[j]);
                }
            }
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(o + c + 8 * j, acc[j]);
        }
        return;
    }
#endif
    memset(o, 0, sizeof(float) * (size_t)head_dim);
    for (int64_t blk = 0, t0 = 0; t0 < len; blk++, t0 += block_size) {
        const float *v = values + table[blk] * block_size * head_dim;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++, v += head_dim) {
            const float w = p[t0 + i];
#pragma omp simd
            for (int64_t d = 0; d < head_dim; d++) o[d] += w * v[d];
        }
    }
}

/* One (sequence, kv head): scores of its query-head group against every cached key, softmax, weighted values. */
static void attend(const float *q, const float *keys, const float *values, const int64_t *table, int64_t len,
                   float *o, float *scores, int64_t group, int64_t head_dim, int64_t block_size, float scale) {
    for (int64_t blk = 0, t0 = 0; t0 < len; blk++, t0 += block_size) {
        prefetch_block(keys, table, blk + 1, len, block_size, head_dim);
        const float *k = keys + table[blk] * block_size * head_dim;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++, k += head_dim)
            for (int64_t g = 0; g < group; g++) scores[g * len + t0 + i] = dot(q + g * head_dim, k, head_dim) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        softmax(scores + g * len, len);
        weighted_values(scores + g * len, values, table, len, o + g * head_dim, head_dim, block_size);
    }
}

int paged_decode_attention_f32(const float *query,      /* [B, H, D] */
                               const float *key_cache,  /* [Hkv, num_blocks, block_size, D] */
                               const float *value_cache,
                               const int64_t *block_tables, /* [B, max_blocks] */
                               const int64_t *seq_lens,     /* [B] */
                               float *out,                  /* [B, H, D] */
                               int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               int64_t num_blocks, int64_t block_size, int64_t max_blocks, float scale,
                               int nthreads) {
    const int64_t group = num_heads / num_kv_heads;
    int64_t longest = 1;
    for (int64_t b = 0; b < batch; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (batch * num_kv_heads > 1)
    {
        float *scores = malloc(sizeof(float) * (size_t)(group * longest));
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
        /* dynamic: sequences differ in length, so equal counts are not equal work */
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < batch * num_kv_heads; unit++) {
            if (!scores) continue;
            const int64_t b = unit / num_kv_heads, kvh = unit % num_kv_heads;
            const float *keys = key_cache + kvh * num_blocks * block_size * head_dim;
            const float *values = value_cache + kvh * num_blocks * block_size * head_dim;
            const float *q = query + (b * num_heads + kvh * group) * head_dim;
            float *o = out + (b * num_heads + kvh * group) * head_dim;
            attend(q, keys, values, block_tables + b * max_blocks, seq_lens[b], o, scores, group, head_dim,
                   block_size, scale);
        }
        free(scores);
    }
    return failed ? -1 : 0;
}

/* Write each token's key and value into its cache slot (vLLM's reshape_and_cache). Token t, head h of k starts at
 * k + t * k_stride + h * head_dim (likewise v), so views of the fused QKV output need no copy. Caches are
 * [kv_heads, num_slots, head_dim]; slots[t] = block * block_size + offset. */
void reshape_and_cache_f32(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                           int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots,
                           float *key_cache, float *value_cache) {
    const size_t row = (size_t)head_dim * sizeof(float);
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const int64_t dst = (h * num_slots + slots[t]) * head_dim;
            memcpy(key_cache + dst, k + t * k_stride + h * head_dim, row);
            memcpy(value_cache + dst, v + t * v_stride + h * head_dim, row);
        }
}
