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
} pagellm_decoder_layer;

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
} pagellm_decoder;

static void add_rows(float *x, const float *bias, int64_t rows, int64_t dim) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < dim; i++) x[r * dim + i] += bias[i];
}

/* hidden [m, hidden] is updated in place to the output of the last layer (before the final norm). Returns 0, -1 when
 * a kernel fails, -2 when scratch memory cannot be allocated. */
int pagellm_decoder_forward(const pagellm_decoder *d, float *hidden, int64_t m, const int64_t *positions,
                            const int64_t *slots, const int64_t *block_tables, int64_t max_blocks,
                            const int64_t *seq_lens, int nthreads) {
    const int64_t q_size = d->heads * d->head_dim, kv_size = d->kv_heads * d->head_dim;
    const int64_t qkv_size = q_size + 2 * kv_size, num_slots = d->num_blocks * d->block_size;
    const int64_t widest = qkv_size > 2 * d->intermediate ? qkv_size : 2 * d->intermediate;
    float *normed = malloc(sizeof(float) * (size_t)(m * d->hidden));
    float *wide = malloc(sizeof(float) * (size_t)(m * widest)); /* qkv, then gate|up */
    float *query = malloc(sizeof(float) * (size_t)(m * q_size));
    float *mid = malloc(sizeof(float) * (size_t)(m * (q_size > d->intermediate ? q_size : d->intermediate)));
    float *proj = malloc(sizeof(float) * (size_t)(m * d->hidden));
    int status = (normed && wide && query && mid && proj) ? 0 : -2;
    for (int64_t l = 0; l < d->num_layers && status == 0; l++) {
        const pagellm_decoder_layer *layer = d->layers + l;
        /* attention block */
        d->rms_norm(hidden, NULL, layer->input_norm, normed, m, d->hidden, d->eps, nthreads);
        if ((status = d->matmul(layer->qkv, normed, m, d->hidden, wide, nthreads))) break;
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
        d->write_cache(wide + q_size, wide + q_size + kv_size, qkv_size, qkv_size, slots, m, d->kv_heads, d->head_dim,
                       num_slots, layer->key_cache, layer->value_cache, (int)d->kv_type);
        for (int64_t t = 0; t < m; t++) memcpy(query + t * q_size, wide + t * qkv_size, sizeof(float) * (size_t)q_size);
        if (d->attention(query, layer->key_cache, layer->value_cache, block_tables, seq_lens, mid, m, d->heads,
                         d->kv_heads, d->head_dim, d->num_blocks, d->block_size, max_blocks, d->scale, (int)d->kv_type,
                         layer->sliding_window, 0, nthreads)) {
            status = -1;
            break;
        }
        if ((status = d->matmul(layer->o, mid, m, q_size, proj, nthreads))) break;
        add_rows(proj, layer->o_bias, m, d->hidden);
        if (layer->attn_out_norm) d->rms_norm(proj, NULL, layer->attn_out_norm, proj, m, d->hidden, d->eps, nthreads);
        /* MLP block: hidden += attention output, fused with the norm */
        d->rms_norm(proj, hidden, layer->mlp_norm, normed, m, d->hidden, d->eps, nthreads);
        if ((status = d->matmul(layer->gate_up, normed, m, d->hidden, wide, nthreads))) break;
        add_rows(wide, layer->gate_up_bias, m, 2 * d->intermediate);
        d->act_and_mul(wide, mid, m, d->intermediate, nthreads);
        if ((status = d->matmul(layer->down, mid, m, d->intermediate, proj, nthreads))) break;
        add_rows(proj, layer->down_bias, m, d->hidden);
        if (layer->mlp_out_norm) d->rms_norm(proj, NULL, layer->mlp_out_norm, proj, m, d->hidden, d->eps, nthreads);
        for (int64_t i = 0; i < m * d->hidden; i++) hidden[i] += proj[i];
    }
    free(normed);
    free(wide);
    free(query);
    free(mid);
    free(proj);
    return status;
}
