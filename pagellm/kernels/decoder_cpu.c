/* A whole decode step through the decoder layers in one call, float32, CPU.
 *
 * At decode batch sizes a layer is a dozen small operations; run from Python, each one costs more in dispatch than
 * in arithmetic. This file strings the existing kernels together (packed-weight matmul, RMSNorm, RoPE, cache write,
 * paged decode attention, SiLU-and-multiply; reached through the function pointers in `pagellm_decoder`, so each
 * stays in its own library) in exactly the order of the PyTorch models (models/llama.py, models/gemma3.py), with
 * the same variants: biases on any projection (Qwen2), per-head RMSNorm of queries and keys (Qwen3, Gemma 3), a
 * sliding window and RoPE tables per layer (Mistral; Gemma 3's local and global layers), norms of the attention and
 * MLP outputs before their residual adds and a tanh-GELU MLP (Gemma 3). Every token of the batch is one decoding
 * sequence (no prefill chunks).
 *
 * LoRA adapters (lora/): after each projection's packed matmul, a row that runs with an adapter adds its low-rank
 * delta in float32, as the PyTorch layers do (lora/context.py), before the bias. The adapters sit in slots (the
 * worker's LoRA manager keeps them there); the rows of each slot are gathered once per call, so a batch with four
 * adapters does four small products per projection, not one per row.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int (*matmul_fn)(const void *matrix, const float *x, int64_t m, int64_t ldx, float *out, int nthreads);
typedef void (*rms_norm_fn)(const float *x, float *residual, const float *weight, float *out, int64_t rows, int64_t dim,
                            float eps, int nthreads);
typedef void (*act_and_mul_fn)(const float *x, float *out, int64_t rows, int64_t d, int nthreads);
typedef void (*rope_fn)(float *x, int64_t tokens, int64_t heads, int64_t token_stride, int64_t dim,
                        const int64_t *positions, const float *cos_table, const float *sin_table);
typedef void (*cache_fn)(const float *k, const float *v, int64_t k_stride, int64_t v_stride, const int64_t *slots,
                         int64_t num_tokens, int64_t num_kv_heads, int64_t head_dim, int64_t num_slots, void *key_cache,
                         void *value_cache, int kv_type);
typedef int (*attention_fn)(const float *query, const void *key_cache, const void *value_cache,
                            const int64_t *block_tables, const int64_t *seq_lens, float *out, int64_t batch,
                            int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                            int64_t block_size, int64_t max_blocks, float scale, int kv_type, int64_t sliding_window,
                            int64_t partition_tokens, int nthreads);

typedef struct {
    const void *qkv, *o, *gate_up, *down;                      /* pagellm_matrix descriptors */
    const float *qkv_bias, *o_bias, *gate_up_bias, *down_bias; /* NULL when absent */
    const float *input_norm, *mlp_norm;                        /* the norms of the attention's and MLP's inputs */
    const float *q_norm, *k_norm;                              /* NULL unless per-head (Qwen3, Gemma 3) */
    const float *attn_out_norm, *mlp_out_norm;                 /* NULL unless Gemma 3 */
    const float *cos_table, *sin_table; /* this layer's RoPE tables, as RotaryEmbedding keeps them; NULL: none */
    void *key_cache, *value_cache;      /* [kv_heads, num_blocks, block_size, D] of the decoder's kv_type */
    int64_t sliding_window;             /* this layer's: a query sees the last n tokens; 0: all of them */
    int64_t kv_group; /* its KV cache group: the slots and block tables it reads are that group's (see forward) */
} pagellm_decoder_layer;

/* One adapter's weights on one projection of one layer (kernels/decoder.py `_LoRA`; rank 0: the adapter leaves the
 * projection alone). delta = (x A^T) B^T: A [rank, in] stacks the A's of the fused projection's parts (q|k|v,
 * gate|up). Part p takes the next part_rank[p] rows of A and writes outputs [part_out[p], + part_size[p]) with its
 * (scaling B)^T [part_rank[p], part_size[p]], stored in blocks of LORA_COLS outputs (the last one narrower), each
 * block [part_rank[p], its outputs] contiguous, the parts one after another in `b`: a work item reads one block. */
#define LORA_MAX_PARTS 3
#define LORA_COLS 64 /* outputs per block: one work item of the expansion */
typedef struct {
    const float *a, *b;
    int64_t rank, num_parts;
    int64_t part_rank[LORA_MAX_PARTS], part_out[LORA_MAX_PARTS], part_size[LORA_MAX_PARTS];
} pagellm_decoder_lora;

enum { LORA_QKV, LORA_O, LORA_GATE_UP, LORA_DOWN, LORA_PROJECTIONS };

typedef struct {
    matmul_fn matmul;
    rms_norm_fn rms_norm;
    act_and_mul_fn act_and_mul; /* the MLP's gate activation times up: SiLU or tanh-GELU */
    rope_fn rope;
    cache_fn write_cache;
    attention_fn attention;
    int64_t hidden, heads, kv_heads, head_dim, intermediate, num_blocks, block_size, num_layers;
    int64_t kv_type;  /* the cache's element type, as kv_types.h numbers them */
    float eps, scale; /* scale: the attention's, applied to q.k */
    const pagellm_decoder_layer *layers;
    /* adapter `s` on projection `p` of layer `l`: lora[(l * lora_slots + s) * LORA_PROJECTIONS + p] */
    const pagellm_decoder_lora *lora;
    int64_t lora_slots, lora_max_rank; /* lora_max_rank: the largest `rank` in the table */
} pagellm_decoder;

/* The batch's rows by adapter slot: rows[start[s] .. start[s + 1]) run with slot s. */
typedef struct {
    int64_t *rows, *start;
} lora_rows;

/* Sums in 16 lanes, then the lanes pairwise: the same floats whether the compiler vectorises it or not. */
static float dot(const float *a, const float *x, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[i + l] * x[i + l];
    for (int l = 0; i + l < n; l++) acc[l] += a[i + l] * x[i + l];
    for (int w = 8; w > 0; w /= 2)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    return acc[0];
}

static int64_t lora_blocks(const pagellm_decoder_lora *e) {
    int64_t blocks = 0;
    for (int64_t q = 0; q < e->num_parts; q++) blocks += (e->part_size[q] + LORA_COLS - 1) / LORA_COLS;
    return blocks;
}

/* The slot that work item `item` falls in, counting each slot with rows and weights here as `rank` items (shrink)
 * or one per block of B (expand); *index: the item's index within its slot. */
static int64_t lora_item_slot(const pagellm_decoder_lora *table, const lora_rows *g, int64_t slots, int64_t item,
                              int expand, int64_t *index) {
    for (int64_t s = 0; s < slots; s++) {
        const pagellm_decoder_lora *e = table + s * LORA_PROJECTIONS;
        if (g->start[s] == g->start[s + 1] || !e->rank) continue;
        const int64_t count = expand ? lora_blocks(e) : e->rank;
        if (item < count) {
            *index = item;
            return s;
        }
        item -= count;
    }
    return -1;
}

/* y[r] += (x[r] A^T) B^T for each row r of slot s's group, over the outputs of block `block` of e's B. */
static void lora_expand(const pagellm_decoder_lora *e, int64_t block, const lora_rows *g, int64_t s,
                        const float *shrunk, int64_t ld, float *y, int64_t ldy) {
    int64_t q = 0, j0 = 0;
    const float *b = e->b;
    for (int64_t blocks; block >= (blocks = (e->part_size[q] + LORA_COLS - 1) / LORA_COLS); q++) {
        block -= blocks;
        j0 += e->part_rank[q];
        b += e->part_rank[q] * e->part_size[q];
    }
    const int64_t o0 = block * LORA_COLS, rank = e->part_rank[q];
    const int64_t cols = e->part_size[q] - o0 < LORA_COLS ? e->part_size[q] - o0 : LORA_COLS;
    b += rank * o0; /* the earlier blocks of this part are full */
    for (int64_t i = g->start[s]; i < g->start[s + 1]; i++) {
        const int64_t r = g->rows[i];
        float acc[LORA_COLS] = {0};
        for (int64_t j = 0; j < rank; j++) {
            const float sj = shrunk[r * ld + j0 + j], *bj = b + j * cols;
            for (int64_t o = 0; o < cols; o++) acc[o] += sj * bj[o];
        }
        float *out = y + r * ldy + e->part_out[q] + o0;
        for (int64_t o = 0; o < cols; o++) out[o] += acc[o];
    }
}

/* y[r] += (x[r] A^T) B^T for every row r with an adapter on projection `p` of layer `l`; x [m, in] (row stride in),
 * y row stride ldy; shrunk: scratch [m, lora_max_rank]. One parallel region: the rank products of every slot, then
 * (after its barrier) the outputs of every slot, a block of B at a time. */
static void lora_delta(const pagellm_decoder *d, int64_t l, int p, const lora_rows *g, const float *x, int64_t in,
                       float *y, int64_t ldy, float *shrunk, int nthreads) {
    const pagellm_decoder_lora *table = d->lora + l * d->lora_slots * LORA_PROJECTIONS + p;
    int64_t shrink_items = 0, expand_items = 0;
    for (int64_t s = 0; s < d->lora_slots; s++) {
        const pagellm_decoder_lora *e = table + s * LORA_PROJECTIONS;
        if (g->start[s] == g->start[s + 1] || !e->rank) continue;
        shrink_items += e->rank;
        expand_items += lora_blocks(e);
    }
    if (!shrink_items) return;
    const int64_t ld = d->lora_max_rank;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < shrink_items; item++) {
            int64_t j;
            const int64_t s = lora_item_slot(table, g, d->lora_slots, item, 0, &j);
            const float *a = table[s * LORA_PROJECTIONS].a + j * in;
            for (int64_t i = g->start[s]; i < g->start[s + 1]; i++)
                shrunk[g->rows[i] * ld + j] = dot(a, x + g->rows[i] * in, in);
        }
#pragma omp for schedule(static) nowait
        for (int64_t item = 0; item < expand_items; item++) {
            int64_t block;
            const int64_t s = lora_item_slot(table, g, d->lora_slots, item, 1, &block);
            lora_expand(table + s * LORA_PROJECTIONS, block, g, s, shrunk, ld, y, ldy);
        }
    }
}

/* Group the rows by slot (a counting sort); row_slot[r] < 0: the base model. */
static void lora_group(const int32_t *row_slot, int64_t m, int64_t slots, lora_rows *g) {
    memset(g->start, 0, sizeof(int64_t) * (size_t)(slots + 1));
    for (int64_t r = 0; r < m; r++)
        if (row_slot[r] >= 0 && row_slot[r] < slots) g->start[row_slot[r] + 1]++;
    for (int64_t s = 0; s < slots; s++) g->start[s + 1] += g->start[s];
    /* each slot's run filled from its start, which advances to the next run's; shifted back after */
    for (int64_t r = 0; r < m; r++)
        if (row_slot[r] >= 0 && row_slot[r] < slots) g->rows[g->start[row_slot[r]]++] = r;
    for (int64_t s = slots; s > 0; s--) g->start[s] = g->start[s - 1];
    g->start[0] = 0;
}

static void add_rows(float *x, const float *bias, int64_t rows, int64_t dim) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += bias[i];
}

/* hidden [m, hidden] is updated in place to the output of the last layer (before the final norm). slots [groups, m]
 * and block_tables [groups, m, max_blocks]: one slot mapping and block table per KV cache group. row_slot [m]: each
 * row's adapter slot (-1: none), or NULL when no row has one. Returns 0, -1 when a kernel fails, -2 when scratch
 * memory cannot be allocated. */
int pagellm_decoder_forward(const pagellm_decoder *d, float *hidden, int64_t m, const int64_t *positions,
                            const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
                            const int64_t *seq_lens, const int32_t *row_slot, int nthreads) {
    const int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, num_slots = d->num_blocks * d->block_size;
    const int64_t widest = qkv_size > 2 * d->intermediate ? qkv_size : 2 * d->intermediate;
    float *normed = malloc(sizeof(float) * (size_t)(m * d->hidden));
    float *wide = malloc(sizeof(float) * (size_t)(m * widest)); /* qkv, then gate|up */
    float *query = malloc(sizeof(float) * (size_t)(m * q_size));
    float *mid = malloc(sizeof(float) * (size_t)(m * (q_size > d->intermediate ? q_size : d->intermediate)));
    float *proj = malloc(sizeof(float) * (size_t)(m * d->hidden));
    int status = (normed && wide && query && mid && proj) ? 0 : -2;
    lora_rows g = {NULL, NULL};
    float *shrunk = NULL;
    const int lora = row_slot && d->lora_slots > 0;
    if (lora && status == 0) {
        g.rows = malloc(sizeof(int64_t) * (size_t)m);
        g.start = malloc(sizeof(int64_t) * (size_t)(d->lora_slots + 1));
        shrunk = malloc(sizeof(float) * (size_t)(m * d->lora_max_rank));
        if (g.rows && g.start && shrunk) lora_group(row_slot, m, d->lora_slots, &g);
        else status = -2;
    }
    for (int64_t l = 0; l < d->num_layers && status == 0; l++) {
        const pagellm_decoder_layer *layer = d->layers + l;
        const int64_t *layer_slots = slots + layer->kv_group * m;
        const int64_t *layer_tables = block_tables + layer->kv_group * m * max_blocks;
        /* attention block */
        d->rms_norm(hidden, NULL, layer->input_norm, normed, m, d->hidden, d->eps, nthreads);
        if ((status = d->matmul(layer->qkv, normed, m, d->hidden, wide, nthreads))) break;
        if (lora) lora_delta(d, l, LORA_QKV, &g, normed, d->hidden, wide, qkv_size, shrunk, nthreads);
        add_rows(wide, layer->qkv_bias, m, qkv_size);
        for (int64_t t = 0; layer->q_norm && t < m; t++) { /* per-head norms, in place */
            float *row = wide + t * qkv_size;
            d->rms_norm(row, NULL, layer->q_norm, row, d->heads, d->head_dim, d->eps, 1);
            d->rms_norm(row + q_size, NULL, layer->k_norm, row + q_size, d->kv_heads, d->head_dim, d->eps, 1);
        }
        if (layer->cos_table) { /* NULL: a layer without positions (SmolLM3's no-RoPE layers) */
            d->rope(wide, m, d->heads, qkv_size, d->head_dim, positions, layer->cos_table, layer->sin_table);
            d->rope(wide + q_size, m, d->kv_heads, qkv_size, d->head_dim, positions, layer->cos_table,
                    layer->sin_table);
        }
        d->write_cache(wide + q_size, wide + q_size + kv_size, qkv_size, qkv_size, layer_slots, m, d->kv_heads,
                       d->head_dim, num_slots, layer->key_cache, layer->value_cache, (int)d->kv_type);
        for (int64_t t = 0; t < m; t++) memcpy(query + t * q_size, wide + t * qkv_size, sizeof(float) * (size_t)q_size);
        if (d->attention(query, layer->key_cache, layer->value_cache, layer_tables, seq_lens, mid, m, d->heads,
                         d->kv_heads, d->head_dim, d->num_blocks, d->block_size, max_blocks, d->scale, (int)d->kv_type,
                         layer->sliding_window, 0, nthreads)) {
            status = -1;
            break;
        }
        if ((status = d->matmul(layer->o, mid, m, q_size, proj, nthreads))) break;
        if (lora) lora_delta(d, l, LORA_O, &g, mid, q_size, proj, d->hidden, shrunk, nthreads);
        add_rows(proj, layer->o_bias, m, d->hidden);
        if (layer->attn_out_norm) d->rms_norm(proj, NULL, layer->attn_out_norm, proj, m, d->hidden, d->eps, nthreads);
        /* MLP block: hidden += attention output, fused with the norm */
        d->rms_norm(proj, hidden, layer->mlp_norm, normed, m, d->hidden, d->eps, nthreads);
        if ((status = d->matmul(layer->gate_up, normed, m, d->hidden, wide, nthreads))) break;
        if (lora) lora_delta(d, l, LORA_GATE_UP, &g, normed, d->hidden, wide, 2 * d->intermediate, shrunk, nthreads);
        add_rows(wide, layer->gate_up_bias, m, 2 * d->intermediate);
        d->act_and_mul(wide, mid, m, d->intermediate, nthreads);
        if ((status = d->matmul(layer->down, mid, m, d->intermediate, proj, nthreads))) break;
        if (lora) lora_delta(d, l, LORA_DOWN, &g, mid, d->intermediate, proj, d->hidden, shrunk, nthreads);
        add_rows(proj, layer->down_bias, m, d->hidden);
        if (layer->mlp_out_norm) d->rms_norm(proj, NULL, layer->mlp_out_norm, proj, m, d->hidden, d->eps, nthreads);
        for (int64_t i = 0; i < m * d->hidden; i++) hidden[i] += proj[i];
    }
    free(normed);
    free(wide);
    free(query);
    free(mid);
    free(proj);
    free(g.rows);
    free(g.start);
    free(shrunk);
    return status;
}
