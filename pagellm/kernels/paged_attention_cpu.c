/* Decode attention straight from the paged KV cache, CPU; float32 arithmetic over a float32, float16, bfloat16 or
 * 8-bit float (e4m3, e5m2) cache (`--kv-cache-dtype`), and the cache write that rounds new keys and values to the
 * cache's type.
 *
 * One query token per batch entry. It sees the sequence's tokens, or with a sliding window of n (the layer's) its
 * last n: blocks wholly before the window are never read, so a long sequence costs the window's length. Consecutive
 * entries of one sequence (a speculative verify step's 1 + k rows: the same blocks, lengths one apart) form a run, and
 * a unit of work is (run, kv head, partition of the tokens the run sees): it reads each cached key and value of its
 * partition once for all the run's rows, in place, through the block table (no gathered copy), scores the query
 * heads of the group of each row, and accumulates exp(score - max) * value over each row's own tokens, keeping the
 * max and the sum of the exponentials. Runs are split into partitions only when there are too few (run, kv head)
 * pairs to keep every thread busy (one conversation, few kv heads); a second pass then merges each head's partitions
 * (flash-decoding). Cache layout: [kv_heads, num_blocks, block_size, dim]. Units are spread over
 * OpenMP threads (the process's libgomp, shared with PyTorch). With AVX2 the heads of a group go in tiles of up to
 * three: each key row and each value row is loaded (and widened) once per tile, and the tile's dot products (in a
 * unit's later tiles four tokens at a time) and value sums stay in registers; otherwise the loops are left to the
 * compiler's vectoriser. Each cache type gets its own copy of the inner loops: `attend_f32` and friends call one
 * always-inlined body with a constant type.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kv_types.h"
#include "simd_exp.h"

#if VECTOR_KV
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* The first cached row of a sequence's block `blk`, through its block table; the block's rows follow it. */
ALWAYS_INLINE const char *block_rows(const void *base, const int64_t *table, int64_t blk, int64_t block_size,
                                     int64_t head_dim, int kind) {
    return (const char *)base + (size_t)(table[blk] * block_size * head_dim) * kv_size(kind);
}

/* The portable dot product (key_tile's vector loop takes head sizes that are multiples of 16 where AVX2 is there). */
ALWAYS_INLINE float dot(const float *q, const void *k, int64_t n, int kind) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += q[i] * load1(k, i, kind);
    return acc;
}

/* s[t] = exp(s[t] - max) in place; returns max and the sum of the exponentials. Vectorised exp where AVX2 is there
 * (a scalar expf per score cost more than the dot products). */
static void exponentials(float *s, int64_t len, float *max_out, float *sum_out) {
    float max = -INFINITY, sum = 0.0f;
    int64_t t = 0;
#if VECTOR_KV
    /* the compiler leaves the max scalar (its NaN rule); max_ps(x, m) keeps m when x is NaN, as the loop below does */
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; t + 8 <= len; t += 8) vm = _mm256_max_ps(_mm256_loadu_ps(s + t), vm);
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    max = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; t < len; t++) max = s[t] > max ? s[t] : max;
    t = 0;
#if VECTOR_KV
    const __m256 vmax = _mm256_set1_ps(max);
    __m256 vsum = _mm256_setzero_ps();
    for (; t + 8 <= len; t += 8) {
        const __m256 e = exp256_ps(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmax));
        _mm256_storeu_ps(s + t, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    sum = hsum256(vsum);
#endif
    for (; t < len; t++) {
        s[t] = expf(s[t] - max);
        sum += s[t];
    }
    *max_out = max;
    *sum_out = sum;
}

/* Blocks are scattered, so the hardware prefetcher stops at each block's edge: while a block is read, its rows ask
 * for the same rows of the next one (NULL past the end), a row per row, spread out (asking for a whole block at once
 * stalled the loop on the prefetch instructions: a third of its time, measured). */
ALWAYS_INLINE const char *next_block(const void *base, const int64_t *table, int64_t blk, int64_t end,
                                     int64_t block_size, int64_t head_dim, int kind) {
    return (blk + 1) * block_size < end ? block_rows(base, table, blk + 1, block_size, head_dim, kind) : NULL;
}

ALWAYS_INLINE void prefetch_row(const char *next, int64_t i, size_t row_bytes) {
    if (next == NULL) return;
    for (size_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(next + i * row_bytes + offset, 0, 3);
}

/* s[g][t - begin] = q_g . k_t * scale for `heads` heads of a group (their q rows head_dim apart, their s rows `len`
 * apart) over tokens [begin, end). With AVX2 and head_dim a multiple of 16 each key row is loaded (and widened)
 * once for every head of the tile; otherwise each head takes the portable dot product. `values` (or NULL): the
 * value rows of the same tokens are asked into L2 as their keys are read, so the value pass finds them there
 * (this loop is waiting on memory anyway: 4-11% less time at 32 sequences of 160 tokens, 3-8% at one of 2,048). */
ALWAYS_INLINE void key_tile(const float *q, const void *keys, const void *values, const int64_t *table, int64_t begin,
                            int64_t end, float *s, int64_t len, int64_t head_dim, int64_t block_size, float scale,
                            int kind, const int heads) {
    const size_t row_bytes = (size_t)head_dim * kv_size(kind);
    for (int64_t blk = begin / block_size, t0 = blk * block_size; t0 < end; blk++, t0 += block_size) {
        const int64_t i0 = t0 < begin ? begin - t0 : 0; /* a sliding window may open inside the first block */
        const char *k = block_rows(keys, table, blk, block_size, head_dim, kind) + i0 * row_bytes;
        const char *next = next_block(keys, table, blk, end, block_size, head_dim, kind);
        const char *v = values ? block_rows(values, table, blk, block_size, head_dim, kind) : NULL;
        const int64_t n = end - t0 < block_size ? end - t0 : block_size;
        int64_t i = i0;
#if VECTOR_KV
        /* A unit's later tiles (a run of verify rows' heads), whose keys the first tile brought into cache, take
         * four tokens at a time: each head's four sums reduce in one horizontal-add tree to four adjacent scores (a
         * sum and a store per head and token took a tenth of a 5-row verify step's attention, measured). The first
         * tile, waiting on memory, keeps one token at a time: four at a time there was 3-8% slower over float32. */
        if (head_dim % 16 == 0 && values == NULL)
            for (; i + 4 <= n; i += 4, k += 4 * row_bytes) {
                __m256 acc[3][4];
                for (int g = 0; g < heads; g++)
                    for (int r = 0; r < 4; r++) acc[g][r] = _mm256_setzero_ps();
                for (int64_t c = 0; c < head_dim; c += 8) {
                    __m256 x[4];
                    for (int r = 0; r < 4; r++) x[r] = load8(k + r * row_bytes, c, kind);
                    for (int g = 0; g < heads; g++) {
                        const __m256 qv = _mm256_loadu_ps(q + g * head_dim + c);
                        for (int r = 0; r < 4; r++) acc[g][r] = _mm256_fmadd_ps(qv, x[r], acc[g][r]);
                    }
                }
                for (int g = 0; g < heads; g++) {
                    const __m256 h =
                        _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
                    const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
                    _mm_storeu_ps(s + g * len + t0 - begin + i, _mm_mul_ps(dots, _mm_set1_ps(scale)));
                }
            }
#endif
        for (; i < n; i++, k += row_bytes) {
            prefetch_row(next, i, row_bytes);
            if (v != NULL)
                for (size_t offset = 0; offset < row_bytes; offset += 64)
                    __builtin_prefetch(v + i * row_bytes + offset, 0, 2);
            float *row_scores = s + t0 - begin + i;
#if VECTOR_KV
            if (head_dim % 16 == 0) {
                __m256 acc[3][2];
                for (int g = 0; g < heads; g++) acc[g][0] = acc[g][1] = _mm256_setzero_ps();
                for (int64_t c = 0; c < head_dim; c += 16) {
                    const __m256 x0 = load8(k, c, kind), x1 = load8(k, c + 8, kind);
                    for (int g = 0; g < heads; g++) {
                        acc[g][0] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + c), x0, acc[g][0]);
                        acc[g][1] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * head_dim + c + 8), x1, acc[g][1]);
                    }
                }
                for (int g = 0; g < heads; g++)
                    row_scores[g * len] = hsum256(_mm256_add_ps(acc[g][0], acc[g][1])) * scale;
                continue;
            }
#endif
            for (int g = 0; g < heads; g++) row_scores[g * len] = dot(q + g * head_dim, k, head_dim, kind) * scale;
        }
    }
}

/* o[g][0..head_dim) = sum_t p[g][t - begin] * v_t for `heads` heads of a group (their p rows `len` apart, their o
 * rows head_dim apart) over tokens [begin, end). 32 columns at a time: each value
 * row's slice is loaded (and widened) once for every head, and the 4 x `heads` sums stay in registers. */
#if VECTOR_KV
ALWAYS_INLINE void value_tile(const float *p, int64_t len, const void *values, const int64_t *table, int64_t begin,
                              int64_t end, float *o, int64_t head_dim, int64_t block_size, int kind, const int heads) {
    const size_t row_bytes = (size_t)head_dim * kv_size(kind);
    for (int64_t c = 0; c < head_dim; c += 32) {
        __m256 acc[3][4];
        for (int g = 0; g < heads; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int64_t blk = begin / block_size, t0 = blk * block_size; t0 < end; blk++, t0 += block_size) {
            const int64_t i0 = t0 < begin ? begin - t0 : 0;
            const char *v = block_rows(values, table, blk, block_size, head_dim, kind) + i0 * row_bytes;
            const char *next = c == 0 ? next_block(values, table, blk, end, block_size, head_dim, kind) : NULL;
            const int64_t n = end - t0 < block_size ? end - t0 : block_size;
            for (int64_t i = i0; i < n; i++, v += row_bytes) {
                prefetch_row(next, i, row_bytes);
                __m256 x[4];
                for (int j = 0; j < 4; j++) x[j] = load8(v, c + 8 * j, kind);
                for (int g = 0; g < heads; g++) {
                    const __m256 w = _mm256_set1_ps(p[g * len + t0 - begin + i]);
                    for (int j = 0; j < 4; j++) acc[g][j] = _mm256_fmadd_ps(w, x[j], acc[g][j]);
                }
            }
        }
        for (int g = 0; g < heads; g++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + g * head_dim + c + 8 * j, acc[g][j]);
    }
}
#endif

/* o[g][0..head_dim) = sum_t p[g][t - begin] * v_t for every head g of the group, over tokens [begin, end). */
ALWAYS_INLINE void weighted_values(const float *p, int64_t len, const void *values, const int64_t *table, int64_t begin,
                                   int64_t end, float *o, int64_t group, int64_t head_dim, int64_t block_size,
                                   int kind) {
#if VECTOR_KV
    if (head_dim % 32 == 0) { /* heads in tiles of three: 12 sums and 4 value vectors fill the 16 registers */
        for (int64_t g0 = 0; g0 < group; g0 += 3) {
            const float *pg = p + g0 * len;
            float *og = o + g0 * head_dim;
            const int64_t heads = group - g0; /* a constant in each call, so each tile size gets its own loops */
            if (heads >= 3) value_tile(pg, len, values, table, begin, end, og, head_dim, block_size, kind, 3);
            else if (heads == 2) value_tile(pg, len, values, table, begin, end, og, head_dim, block_size, kind, 2);
            else value_tile(pg, len, values, table, begin, end, og, head_dim, block_size, kind, 1);
        }
        return;
    }
#endif
    const size_t row_bytes = (size_t)head_dim * kv_size(kind);
    memset(o, 0, sizeof(float) * (size_t)(group * head_dim));
    for (int64_t blk = begin / block_size, t0 = blk * block_size; t0 < end; blk++, t0 += block_size) {
        const int64_t i0 = t0 < begin ? begin - t0 : 0;
        const char *v = block_rows(values, table, blk, block_size, head_dim, kind) + i0 * row_bytes;
        const int64_t n = end - t0 < block_size ? end - t0 : block_size;
        for (int64_t i = i0; i < n; i++, v += row_bytes)
            for (int64_t g = 0; g < group; g++) {
                const float w = p[g * len + t0 - begin + i];
                float *og = o + g * head_dim;
#pragma omp simd
                for (int64_t d = 0; d < head_dim; d++) og[d] += w * load1(v, d, kind);
            }
    }
}

/* s[g][t - begin] = q_g . k_t * scale for every head g of the group (s rows `len` apart), over tokens [begin, end),
 * in tiles of three heads (12 sums and the 2 widened key vectors stay in registers). The first tile also brings
 * the values' rows into L2. */
ALWAYS_INLINE void key_scores(const float *q, const void *keys, const void *values, const int64_t *table, int64_t begin,
                              int64_t end, float *s, int64_t len, int64_t group, int64_t head_dim, int64_t block_size,
                              float scale, int kind) {
    for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const float *qg = q + g0 * head_dim;
        const void *v = g0 == 0 ? values : NULL;
        float *sg = s + g0 * len;
        const int64_t heads = group - g0; /* a constant in each call, so each tile size gets its own loops */
        if (heads >= 3) key_tile(qg, keys, v, table, begin, end, sg, len, head_dim, block_size, scale, kind, 3);
        else if (heads == 2) key_tile(qg, keys, v, table, begin, end, sg, len, head_dim, block_size, scale, kind, 2);
        else key_tile(qg, keys, v, table, begin, end, sg, len, head_dim, block_size, scale, kind, 1);
    }
}

/* One unit: the query heads of a group, for each of `rows` rows of a run (their q rows contiguous, row j's group
 * after row j - 1's), against one sequence's tokens; row j sees [begins[j], ends[j]) (empty for some, not all). The
 * keys and values of the rows' tokens together are read once for all rows x group heads; each row's scores
 * outside its own tokens are zeroed rather than exponentiated (exponentials' max would take them), so they add
 * nothing to its sums. Per head h (row-major), o[h] gets the unnormalised sum of exp(score - max) * value and
 * stats[2h], stats[2h + 1] the max and the sum of exponentials (-inf and 0 for a row with no tokens here).
 * Loads widen a narrow cache's values as they go (converting a block into a float32 scratch first, once for the
 * whole group, measured slower: the conversion then waits on memory with nothing to overlap). */
ALWAYS_INLINE void attend(const float *q, const void *keys, const void *values, const int64_t *table, int64_t rows,
                          const int64_t *begins, const int64_t *ends, float *o, float *stats, float *scores,
                          int64_t group, int64_t head_dim, int64_t block_size, float scale, int kind) {
    int64_t begin = INT64_MAX, end = 0; /* the rows' tokens together (a row's window may start past the others' end) */
    for (int64_t j = 0; j < rows; j++)
        if (begins[j] < ends[j]) {
            begin = begins[j] < begin ? begins[j] : begin;
            end = ends[j] > end ? ends[j] : end;
        }
    const int64_t len = end - begin, heads = rows * group;
    key_scores(q, keys, values, table, begin, end, scores, len, heads, head_dim, block_size, scale, kind);
    for (int64_t j = 0; j < rows; j++) {
        const int64_t lo = begins[j] < ends[j] ? begins[j] - begin : 0, hi = begins[j] < ends[j] ? ends[j] - begin : 0;
        for (int64_t h = j * group; h < (j + 1) * group; h++) {
            float *s = scores + h * len;
            memset(s, 0, sizeof(float) * (size_t)lo);
            memset(s + hi, 0, sizeof(float) * (size_t)(len - hi));
            exponentials(s + lo, hi - lo, stats + 2 * h, stats + 2 * h + 1);
        }
    }
    weighted_values(scores, len, values, table, begin, end, o, heads, head_dim, block_size, kind);
}

typedef void (*attend_fn)(const float *, const void *, const void *, const int64_t *, int64_t, const int64_t *,
                          const int64_t *, float *, float *, float *, int64_t, int64_t, int64_t, float);
#define ATTEND_FOR(name, kind)                                                                                         \
    static void name(const float *q, const void *k, const void *v, const int64_t *table, int64_t rows,                 \
                     const int64_t *begins, const int64_t *ends, float *o, float *stats, float *scores, int64_t group, \
                     int64_t head_dim, int64_t block_size, float scale) {                                              \
        attend(q, k, v, table, rows, begins, ends, o, stats, scores, group, head_dim, block_size, scale, kind);        \
    }
ATTEND_FOR(attend_f32, KV_F32)
ATTEND_FOR(attend_f16, KV_F16)
ATTEND_FOR(attend_bf16, KV_BF16)
ATTEND_FOR(attend_e4m3, KV_E4M3)
ATTEND_FOR(attend_e5m2, KV_E5M2)

/* The first token a sequence's query sees: with a sliding window of n, the query at position seq_len - 1 sees keys
 * k with seq_len - 1 - n < k (transformers' sliding_window_overlay). */
static inline int64_t first_in_window(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

/* The start of the block holding that token: where a sequence's partitions begin. */
static inline int64_t window_origin(int64_t seq_len, int64_t window, int64_t block_size) {
    return first_in_window(seq_len, window) / block_size * block_size;
}

/* Tokens per partition, in whole blocks: `requested` if positive, else at least 256 tokens (so a unit's fixed costs
 * stay small), splitting runs only until there are about four units per thread. */
static int64_t partition_tokens(int64_t requested, int64_t pairs, int64_t longest, int64_t block_size, int nthreads) {
    int64_t tokens = requested;
    if (tokens <= 0) {
        const int64_t wanted_parts = (4 * (int64_t)nthreads + pairs - 1) / pairs;
        tokens = (longest + wanted_parts - 1) / wanted_parts;
        if (tokens < 256) tokens = 256;
    }
    return (tokens + block_size - 1) / block_size * block_size;
}

/* The most rows a run takes (a verify step's 1 + k; longer runs are split): it sizes each thread's scratch. */
#define MAX_RUN_ROWS 16

/* Whether entry b + 1 continues the run that entry b ends, which began at entry `first`: one token longer, and the
 * same blocks wherever the run's rows so far read (from the first row's window on, to b's last block), so the run
 * can read them all through b + 1's table. Whole rows are compared, not a first block id: prefix caching shares
 * leading blocks between different sequences. */
static int continues_run(const int64_t *block_tables, const int64_t *seq_lens, int64_t first, int64_t b,
                         int64_t max_blocks, int64_t block_size, int64_t window) {
    if (seq_lens[b + 1] != seq_lens[b] + 1) return 0;
    const int64_t from = window_origin(seq_lens[first], window, block_size) / block_size;
    const int64_t to = (seq_lens[b] + block_size - 1) / block_size;
    if (to <= from) return 1;
    return memcmp(block_tables + b * max_blocks + from, block_tables + (b + 1) * max_blocks + from,
                  sizeof(int64_t) * (size_t)(to - from)) == 0;
}

int paged_decode_attention(const float *query,          /* [B, H, D] */
                           const void *key_cache,       /* [Hkv, num_blocks, block_size, D] of kv_type */
                           const void *value_cache,     /* the same */
                           const int64_t *block_tables, /* [B, max_blocks] */
                           const int64_t *seq_lens,     /* [B] */
                           float *out,                  /* [B, H, D] */
                           int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                           int64_t block_size, int64_t max_blocks, float scale, int kv_type,
                           int64_t sliding_window,             /* 0: every token; else the query sees the last n */
                           int64_t requested_partition_tokens, /* 0: chosen from the batch and the threads */
                           int nthreads) {
    static const attend_fn by_type[] = {attend_f32, attend_f16, attend_bf16, attend_e4m3, attend_e5m2};
    const attend_fn attend_unit = by_type[kv_type];
    const int64_t group = num_heads / num_kv_heads, pairs = batch * num_kv_heads;
    const size_t head_bytes = (size_t)(num_blocks * block_size * head_dim) * kv_size(kv_type);
    /* run_first[r]: the run's first entry (run_first[runs] = batch). Partitions are counted per run from the block
     * holding its first row's first token in the window (blocks before it are never read), so a sequence verified
     * with 1 + k rows is partitioned as it is with one. */
    int64_t *run_first = malloc(sizeof(int64_t) * (size_t)(batch + 1));
    int64_t runs = 0, longest = 1, most_rows = 1;
    for (int64_t b = 0; run_first && b < batch; runs++) {
        int64_t rows = 1;
        while (b + rows < batch && rows < MAX_RUN_ROWS &&
               continues_run(block_tables, seq_lens, b, b + rows - 1, max_blocks, block_size, sliding_window))
            rows++;
        const int64_t span = seq_lens[b + rows - 1] - window_origin(seq_lens[b], sliding_window, block_size);
        longest = span > longest ? span : longest;
        most_rows = rows > most_rows ? rows : most_rows;
        run_first[runs] = b;
        b += rows;
    }
    if (run_first) run_first[runs] = batch;
    const int64_t run_pairs = runs * num_kv_heads, merged = most_rows > 1;
    const int64_t part_tokens =
        partition_tokens(requested_partition_tokens, run_pairs > 0 ? run_pairs : 1, longest, block_size, nthreads);
    const int64_t parts = (longest + part_tokens - 1) / part_tokens;
    /* With one partition a unit accumulates straight into `out`; otherwise into its own slice of `partial`. Each
     * entry keeps its own (entry, kv head, partition) slots, whichever run computed them, for the merge below. */
    float *partial = parts > 1 ? malloc(sizeof(float) * (size_t)(pairs * parts * group * head_dim)) : NULL;
    float *stats = malloc(sizeof(float) * (size_t)(pairs * parts * group * 2));
    int failed = !run_first || !stats || (parts > 1 && !partial);
#pragma omp parallel num_threads(nthreads) if (run_pairs * parts > 1) shared(failed)
    {
        /* scores, then (for runs of several rows) the gathered queries, their outputs and their stats */
        const size_t heads = (size_t)(most_rows * group);
        const size_t scratch = heads * (size_t)part_tokens + (merged ? heads * (size_t)(2 * head_dim + 2) : 0);
        float *scores = failed ? NULL : malloc(sizeof(float) * scratch);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        /* dynamic: sequences differ in length, so equal counts are not equal work */
#pragma omp for schedule(dynamic, 1)
        for (int64_t unit = 0; unit < run_pairs * parts; unit++) {
            if (failed) continue;
            const int64_t run_pair = unit / parts, part = unit % parts, run = run_pair / num_kv_heads;
            const int64_t kvh = run_pair % num_kv_heads, b0 = run_first[run], rows = run_first[run + 1] - b0;
            const int64_t start = window_origin(seq_lens[b0], sliding_window, block_size) + part * part_tokens;
            int64_t begins[MAX_RUN_ROWS], ends[MAX_RUN_ROWS], seen = 0;
            for (int64_t j = 0; j < rows; j++) { /* each row its own causal end and window start */
                const int64_t first = first_in_window(seq_lens[b0 + j], sliding_window);
                ends[j] = seq_lens[b0 + j] < start + part_tokens ? seq_lens[b0 + j] : start + part_tokens;
                begins[j] = start > first ? start : first;
                seen += begins[j] < ends[j];
            }
            if (!seen) { /* a short run's empty partition: weight 0 in the merge */
                for (int64_t j = 0; j < rows; j++) {
                    float *unit_stats = stats + (((b0 + j) * num_kv_heads + kvh) * parts + part) * group * 2;
                    for (int64_t g = 0; g < group; g++) unit_stats[2 * g] = -INFINITY, unit_stats[2 * g + 1] = 0.0f;
                }
                continue;
            }
            const char *k = (const char *)key_cache + kvh * head_bytes,
                       *v = (const char *)value_cache + kvh * head_bytes;
            const int64_t *table = block_tables + (b0 + rows - 1) * max_blocks; /* the run's longest row's */
            if (rows == 1) { /* straight from the query, straight into its slots */
                const int64_t slot = (b0 * num_kv_heads + kvh) * parts + part;
                float *o =
                    parts > 1 ? partial + slot * group * head_dim : out + (b0 * num_heads + kvh * group) * head_dim;
                attend_unit(query + (b0 * num_heads + kvh * group) * head_dim, k, v, table, 1, begins, ends, o,
                            stats + slot * group * 2, scores, group, head_dim, block_size, scale);
                continue;
            }
            /* The rows' query heads side by side as one tile's heads; each row's results back to its entry's slots. */
            const size_t row_floats = sizeof(float) * (size_t)(group * head_dim);
            float *run_q = scores + heads * (size_t)part_tokens, *run_o = run_q + heads * (size_t)head_dim;
            float *run_stats = run_o + heads * (size_t)head_dim;
            for (int64_t j = 0; j < rows; j++)
                memcpy(run_q + j * group * head_dim, query + ((b0 + j) * num_heads + kvh * group) * head_dim,
                       row_floats);
            attend_unit(run_q, k, v, table, rows, begins, ends, run_o, run_stats, scores, group, head_dim, block_size,
                        scale);
            for (int64_t j = 0; j < rows; j++) {
                const int64_t slot = ((b0 + j) * num_kv_heads + kvh) * parts + part;
                float *o = parts > 1 ? partial + slot * group * head_dim
                                     : out + ((b0 + j) * num_heads + kvh * group) * head_dim;
                memcpy(o, run_o + j * group * head_dim, row_floats);
                memcpy(stats + slot * group * 2, run_stats + j * group * 2, sizeof(float) * (size_t)(group * 2));
            }
        }
        free(scores);
        /* merge: out = sum_p exp(m_p - m) o_p / sum_p exp(m_p - m) l_p, per (entry, head) */
#pragma omp for schedule(static)
        for (int64_t row = 0; row < batch * num_heads; row++) {
            if (failed) continue;
            const int64_t b = row / num_heads, h = row % num_heads, pair = b * num_kv_heads + h / group;
            const int64_t g = h % group;
            float *o = out + row * head_dim, max = -INFINITY, sum = 0.0f;
            for (int64_t p = 0; p < parts; p++) {
                const float m = stats[((pair * parts + p) * group + g) * 2];
                max = m > max ? m : max;
            }
            if (parts > 1) memset(o, 0, sizeof(float) * (size_t)head_dim);
            for (int64_t p = 0; p < parts; p++) {
                const float *s = stats + ((pair * parts + p) * group + g) * 2;
                if (s[1] == 0.0f) continue;
                const float w = expf(s[0] - max);
                sum += w * s[1];
                if (parts == 1) continue; /* o already holds the one partition's sum */
                const float *src = partial + ((pair * parts + p) * group + g) * head_dim;
                for (int64_t d = 0; d < head_dim; d++) o[d] += w * src[d];
            }
            const float inv = 1.0f / sum;
            for (int64_t d = 0; d < head_dim; d++) o[d] *= inv;
        }
    }
    free(run_first);
    free(partial);
    free(stats);
    return failed ? -1 : 0;
}

/* Write each token's key and value into its cache slot (vLLM's reshape_and_cache), in the cache's type. Token t,
 * head h of k starts at k + t * k_stride + h * head_dim (likewise v), so views of the fused QKV output need no copy.
 * Caches are [kv_heads, num_slots, head_dim]; slots[t] = block * block_size + offset. */
void reshape_and_cache(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                       int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, void *key_cache,
                       void *value_cache, int kv_type) {
    const size_t row = (size_t)head_dim * kv_size(kv_type);
    for (int64_t t = 0; t < num_tokens; t++)
        for (int64_t h = 0; h < num_kv_heads; h++) {
            const size_t dst = (size_t)(h * num_slots + slots[t]) * row;
            store_row((char *)key_cache + dst, k + t * k_stride + h * head_dim, head_dim, kv_type);
            store_row((char *)value_cache + dst, v + t * v_stride + h * head_dim, head_dim, kv_type);
        }
}
