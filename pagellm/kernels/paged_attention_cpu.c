/* Decode attention straight from the paged KV cache, float32, CPU.
 *
 * One query token per sequence. For each (sequence, kv head) the kernel reads every cached key of that sequence
 * once, in place, through the block table (no gathered copy), computes the scores of the query heads of the
 * group, takes the softmax and accumulates the values. Cache layout: [kv_heads, num_blocks, block_size, dim].
 * The caller splits sequences across threads; this function is single-threaded and reentrant.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

int paged_decode_attention_f32(const float *query,      /* [B, H, D] */
                               const float *key_cache,  /* [Hkv, num_blocks, block_size, D] */
                               const float *value_cache,
                               const int64_t *block_tables, /* [B, max_blocks] */
                               const int64_t *seq_lens,     /* [B] */
                               float *out,                  /* [B, H, D] */
                               int64_t seq_start, int64_t seq_end, int64_t num_heads, int64_t num_kv_heads,
                               int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t max_blocks,
                               float scale) {
    const int64_t group = num_heads / num_kv_heads;
    int64_t longest = 0;
    for (int64_t b = seq_start; b < seq_end; b++) longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    float *scores = malloc(sizeof(float) * (size_t)(group * (longest > 0 ? longest : 1)));
    if (!scores) return -1;

    for (int64_t b = seq_start; b < seq_end; b++) {
        const int64_t len = seq_lens[b];
        const int64_t *table = block_tables + b * max_blocks;
        for (int64_t kvh = 0; kvh < num_kv_heads; kvh++) {
            const float *keys = key_cache + kvh * num_blocks * block_size * head_dim;
            const float *values = value_cache + kvh * num_blocks * block_size * head_dim;
            const float *q = query + (b * num_heads + kvh * group) * head_dim;
            float *o = out + (b * num_heads + kvh * group) * head_dim;

            for (int64_t t = 0; t < len; t++) {
                const float *k = keys + (table[t / block_size] * block_size + t % block_size) * head_dim;
                for (int64_t g = 0; g < group; g++) scores[g * len + t] = dot(q + g * head_dim, k, head_dim) * scale;
            }
            for (int64_t g = 0; g < group; g++) {
                float *s = scores + g * len, max = -INFINITY, sum = 0.0f;
                for (int64_t t = 0; t < len; t++) max = s[t] > max ? s[t] : max;
                for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
                const float inv = 1.0f / sum;
                for (int64_t t = 0; t < len; t++) s[t] *= inv;
            }
            memset(o, 0, sizeof(float) * (size_t)(group * head_dim));
            for (int64_t t = 0; t < len; t++) {
                const float *v = values + (table[t / block_size] * block_size + t % block_size) * head_dim;
                for (int64_t g = 0; g < group; g++) {
                    const float p = scores[g * len + t];
                    float *og = o + g * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; d++) og[d] += p * v[d];
                }
            }
        }
    }
    free(scores);
    return 0;
}
