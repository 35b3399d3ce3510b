"""BERT-family encoders (Hugging Face's `BertModel`: all-MiniLM-L6-v2, BGE, E5 and other sentence-transformers
checkpoints) for embeddings: token, absolute-position and token-type embeddings summed and layer-normed, then
post-LN encoder layers (bidirectional attention, GELU MLP). The output is the last hidden state of every token,
which the pooler reduces (mean, CLS or last per the model's sentence-transformers config: see
transformers_utils/sentence_transformers.py).

An encoder has no KV cache and no language-model head: attention runs over each whole prompt in its step
(layers/attention/encoder.py), the worker allocates no cache tensors, and the engine serves it with the pooling
runner, refusing generation. Every input is one segment (token type 0), as for a sentence embedding; sentence pairs
with token type 1 (cross-encoders) are not supported. Module and parameter names are the checkpoint's, so weights
load without renaming; the BERT pooler (a tanh layer on [CLS]) is not used by sentence embeddings and is skipped.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers.activations import ACT2FN

from pagellm.distributed.parallel_state import get_pp_group, get_tp_group
from pagellm.model_executor.layers.attention import AttentionMetadata
from pagellm.model_executor.layers.attention.encoder import EncoderAttention
from pagellm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagellm.model_executor.layers.quantization import PackedTensor
from pagellm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagellm.model_executor.model_loader.weight_utils import StackedParams, load_weights

# Checkpoint tensors an embedding model does not use: the [CLS] pooler, a pre-training head ("cls." in checkpoints
# saved from BertForPreTraining / BertForMaskedLM), and the position-ids buffer older transformers saved.
_UNUSED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(hidden + self.token_type_embeddings.weight[0])  # every token in segment 0


class BertSelfAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.attn = EncoderAttention(self.num_heads, self.head_dim)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = (x.view(-1, self.num_heads, self.head_dim)
                   for x in self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1))
        return self.attn(q, k, v, meta)


class BertResidualOutput(nn.Module):
    """dense, then LayerNorm over the residual sum: the post-LN step after attention and after the MLP."""

    def __init__(self, input_size: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(input_size, hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden, meta), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act = ACT2FN[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    # The checkpoint's separate query/key/value projections, fused into one matmul.
    stacked_params: StackedParams = {"query": ("qkv_proj", 0), "key": ("qkv_proj", 1), "value": ("qkv_proj", 2)}

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        position_type = getattr(config, "position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"BertModel with position_embedding_type={position_type!r} is not supported; only "
                             f"absolute position embeddings are.")
        if get_tp_group().world_size > 1 or get_pp_group().world_size > 1:
            raise ValueError("Encoder-only models run on one rank: drop --tensor-parallel-size and "
                             "--pipeline-parallel-size.")
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        """The last hidden state of every token (`kv_caches` is empty: an encoder caches nothing)."""
        hidden = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            hidden = layer(hidden, meta)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("BertModel is an encoder without a language-model head: it computes embeddings "
                         "(task 'embed'), not token logits.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedTensor]],
                     quantization: str = "none") -> set[str]:
        """Store checkpoint tensors (Hugging Face's BertModel names, or with the "bert." prefix of a checkpoint
        saved from a BERT head model) in the parameters (see weight_utils.load_weights)."""
        def used() -> Iterator[tuple[str, torch.Tensor | PackedTensor]]:
            for name, tensor in weights:
                name = name.removeprefix("bert.")
                if not name.startswith(_UNUSED_PREFIXES):
                    yield name, tensor

        return load_weights(self, used(), quantization, self.stacked_params, skip=lambda name: False)
