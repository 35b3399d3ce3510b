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

/* Blocks are scattered, so the hardware prefetcher stops at each block's edge: ask for the next one early. */
static inline void prefetch_block(const float *base, const int64_t *table, int64_t block, int64_t len,
                                  int64_t block_size, int64_t head_dim) {
    if (block * block_size >= len) return;
    const char *start = (const char *)(base + table[block] * block_size * head_dim);
    const int64_t bytes = block_size * head_dim * (int64_t)sizeof(float);
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(start + offset, 0, 1);
}

/* One (sequence, kv head): scores of its query-head group against every cached key, softmax, weighted values.
 * Always inlined into per-head_dim copies below, so the inner loops see a constant length and fully unroll. */
static inline __attribute__((always_inline)) void attend(
    const float *q, const float *keys, const float *values, const int64_t *table, int64_t len, float *o,
    float *scores, int64_t group, const int64_t head_dim, int64_t block_size, float scale) {
    /* Walk block by block: no division per token, and the next block is prefetched. */
    for (int64_t blk = 0, t0 = 0; t0 < len; blk++, t0 += block_size) {
        prefetch_block(keys, table, blk + 1, len, block_size, head_dim);
        const float *k = keys + table[blk] * block_size * head_dim;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++, k += head_dim)
            for (int64_t g = 0; g < group; g++) scores[g * len + t0 + i] = dot(q + g * head_dim, k, head_dim) * scale;
    }
    for (int64_t g = 0; g < group; g++) {
        float *s = scores + g * len, max = -INFINITY, sum = 0.0f;
        for (int64_t t = 0; t < len; t++) max = s[t] > max ? s[t] : max;
        for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - max); sum += s[t]; }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < len; t++) s[t] *= inv;
    }
    memset(o, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t blk = 0, t0 = 0; t0 < len; blk++, t0 += block_size) {
        prefetch_block(values, table, blk + 1, len, block_size, head_dim);
        const float *v = values + table[blk] * block_size * head_dim;
        const int64_t n = len - t0 < block_size ? len - t0 : block_size;
        for (int64_t i = 0; i < n; i++, v += head_dim)
            for (int64_t g = 0; g < group; g++) {
                const float p = scores[g * len + t0 + i];
                float *og = o + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) og[d] += p * v[d];
            }
    }
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
            switch (head_dim) {  /* the head sizes of the supported models; others take the generic copy */
            case 64: attend(q, keys, values, table, len, o, scores, group, 64, block_size, scale); break;
            case 128: attend(q, keys, values, table, len, o, scores, group, 128, block_size, scale); break;
            default: attend(q, keys, values, table, len, o, scores, group, head_dim, block_size, scale);
            }
        }
    }
    free(scores);
    return 0;
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
