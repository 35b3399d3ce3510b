"""Gemma 3's text decoder (Gemma3ForCausalLM; model_type gemma3_text), as transformers computes it.

Where it departs from Llama: a GeGLU MLP (tanh-approximated GELU); four (1 + w) RMSNorms per layer, a pre- and a
post-norm around both attention and MLP, and the same norm on each head's queries and keys; embeddings scaled by
sqrt(hidden_size) (the factor rounded to the model dtype, as transformers does); attention scaled by
query_pre_attn_scalar^-0.5; local layers with a sliding window and global layers without, each kind with its own
RoPE parameters (one RotaryEmbedding per layer type); a tied LM head; and, where the config sets it, final logit
soft-capping, tanh(logits / cap) * cap.

Tensor and pipeline parallelism are Llama's (see llama.py): the same parallel layers, StageLayers and weight
loader, and so is the one-call CPU decode step (fused_cpu_decoder.py), given each layer's RoPE tables and the parts
its four norms play.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_pp_group, get_tp_group
from pagellm.kernels.decoder import FusedDecoder
from pagellm.model_executor.layers.activation import GeluAndMul
from pagellm.model_executor.layers.attention import Attention, AttentionMetadata, layer_sliding_window
from pagellm.model_executor.layers.layernorm import GemmaRMSNorm
from pagellm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from pagellm.model_executor.layers.mlp import GatedMLP
from pagellm.model_executor.layers.quantization import PackedTensor
from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagellm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagellm.model_executor.model_loader.weight_utils import FUSED_QKV_GATE_UP, StackedParams, load_weights
from pagellm.model_executor.models.fused_cpu_decoder import FusedDecodeStep, LayerNorms, build_fused_decoder
from pagellm.model_executor.models.pipeline import StageLayers, held_elsewhere


class Gemma3Attention(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.layer_type: str = config.layer_types[index]
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=config.attention_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, bias=config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              sliding_window=layer_sliding_window(config, index),
                              scale=config.query_pre_attn_scalar ** -0.5)

    def forward(self, rotary_emb: RotaryEmbedding, rope: tuple, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        q, k = rotary_emb(rope, q, k)
        return self.o_proj(self.attn(q, k, v.reshape(-1, self.num_kv_heads, self.head_dim), kv_cache, meta))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, index: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, index)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, GeluAndMul())
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, rotary_emb: RotaryEmbedding, rope: tuple, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        attn_out = self.self_attn(rotary_emb, rope, self.input_layernorm(hidden), kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn_out)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))

    def norms(self) -> LayerNorms:
        return LayerNorms(self.input_layernorm, self.pre_feedforward_layernorm,
                          attn_out=self.post_attention_layernorm, mlp_out=self.post_feedforward_layernorm)


class Gemma3ForCausalLM(nn.Module):
    use_fused_decoder = True  # tests switch it off to compare against the module-by-module path
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    stacked_params: StackedParams = FUSED_QKV_GATE_UP

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.pp = get_pp_group()
        is_first, is_last = self.pp.is_first_rank, self.pp.is_last_rank
        # The LM head is always the embedding matrix: the last stage needs it too.
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size)
                             if is_first or is_last else None)
        # transformers keeps sqrt(hidden_size) as a float32 tensor and casts it to the weights' dtype.
        scale = torch.tensor(config.hidden_size ** 0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale.to(torch.get_default_dtype()), persistent=False)
        # One cos/sin cache per kind of layer (local and global layers have different RoPE bases).
        self.rotary_embs = nn.ModuleDict({
            layer_type: RotaryEmbedding(config, config.head_dim, max_position, layer_type=layer_type)
            for layer_type in sorted(set(config.layer_types))})
        self.stage = StageLayers(config.num_hidden_layers, lambda index: Gemma3DecoderLayer(config, index))
        self.layers = self.stage.layers
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps) if is_last else None
        self.softcap: float | None = getattr(config, "final_logit_softcapping", None)
        self.fused_step = FusedDecodeStep(lambda: build_fused_decoder(
            self.stage.own, config, get_tp_group().world_size,
            rotary_of=lambda layer: self.rotary_embs[layer.self_attn.layer_type],
            norms_of=Gemma3DecoderLayer.norms) if self.use_fused_decoder else None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states on the last pipeline stage; None on the others (they send theirs on).
        `kv_caches` holds this stage's layers only."""
        if self.pp.is_first_rank:
            hidden = self.embed_tokens(input_ids) * self.embed_scale
        else:
            hidden = self.pp.recv_prev((input_ids.shape[0], self.config.hidden_size), self.embed_scale.dtype,
                                       input_ids.device)
        hidden = self._run_layers(hidden, positions, kv_caches, meta)
        if not self.pp.is_last_rank:
            self.pp.send_next(hidden)
            return None
        return self.norm(hidden)

    def _run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    meta: AttentionMetadata) -> torch.Tensor:
        fused = self.fused_step.run(hidden, positions, kv_caches, meta)
        if fused is not None:
            return fused
        ropes = {layer_type: rotary.tables(positions, hidden) for layer_type, rotary in self.rotary_embs.items()}
        for layer, kv_cache in zip(self.stage.own, kv_caches, strict=True):
            layer_type = layer.self_attn.layer_type
            hidden = layer(self.rotary_embs[layer_type], ropes[layer_type], hidden, kv_cache, meta)
        return hidden

    def fused_decoder(self) -> FusedDecoder | None:
        """Every layer of a decode step in one C call, built on first use; None where it does not apply."""
        return self.fused_step.decoder

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (on every tensor-parallel rank of the last pipeline stage)."""
        logits = self.embed_tokens.compute_logits(hidden).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedTensor]],
                     quantization: str = "none") -> set[str]:
        """Store checkpoint tensors (Hugging Face names, norms as w) in the parameters (see
        weight_utils.load_weights); the norms keep 1 + w. Another stage's tensors and the tied LM head are skipped."""
        absent = {name for name in ("embed_tokens", "norm") if getattr(self, name) is None} | {"lm_head"}
        return load_weights(self, _norms_plus_one(weights), quantization, self.stacked_params,
                            skip=lambda name: held_elsewhere(name, self.stage, absent))


def _norms_plus_one(weights: Iterable[tuple[str, torch.Tensor | PackedTensor]]) -> \
        Iterator[tuple[str, torch.Tensor | PackedTensor]]:
    for name, tensor in weights:
        if name.endswith("norm.weight") and isinstance(tensor, torch.Tensor):
            tensor = tensor.float() + 1.0  # in float32, as transformers adds it, before the copy rounds it
        yield name, tensor
