"""The Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral with its sliding window), parameterised for its
close relatives: QKV bias (Qwen2), per-head Q/K RMSNorm (Qwen3) and layers without RoPE (SmolLM3's NoPE layers,
`uses_rope`) are switches, not copies of the model. Loading (model_loader/weight_utils.py), pipeline stages
(pipeline.py) and the one-call CPU decode step (fused_cpu_decoder.py) are shared code.

Under tensor parallelism (the TP group set up before the model is built) each rank holds a slice of every layer:
its attention heads (attention and its KV cache see only those; Q/K norms act per head), its MLP columns and
its vocabulary rows; o_proj, down_proj and the embedding sum over the ranks, the LM head gathers the logits.

Under pipeline parallelism (the PP group) each stage builds and loads only its range of decoder layers (see
pipeline.py). A stage after the first receives the residual stream from the one before and sends its own on; only
the last returns hidden states. The layers keep no separate residual tensor (each layer returns the whole stream,
its norms applied on entry), so the stream is the one tensor passed between stages."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_pp_group, get_tp_group
from pagellm.kernels.decoder import FusedDecoder
from pagellm.model_executor.layers.activation import SiluAndMul
from pagellm.model_executor.layers.attention import Attention, AttentionMetadata, layer_sliding_window
from pagellm.model_executor.layers.layernorm import RMSNorm
from pagellm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from pagellm.model_executor.layers.mlp import GatedMLP
from pagellm.model_executor.layers.quantization import PackedTensor
from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagellm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from pagellm.model_executor.model_loader.weight_utils import FUSED_QKV_GATE_UP, StackedParams, load_weights
from pagellm.model_executor.models.fused_cpu_decoder import FusedDecodeStep, build_fused_decoder
from pagellm.model_executor.models.pipeline import StageLayers, held_elsewhere


class LlamaAttention(nn.Module):
    def __init__(self, config, index: int, rotary_emb: RotaryEmbedding | None, qkv_bias: bool,
                 qk_norm: bool) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads,
                                          bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.rotary_emb = rotary_emb  # None: queries and keys attend without positions
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              sliding_window=layer_sliding_window(config, index))

    def forward(self, rope: tuple, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_emb is not None:
            q, k = self.rotary_emb(rope, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, index: int, rotary_emb: RotaryEmbedding | None, qkv_bias: bool, qk_norm: bool,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, index, rotary_emb, qkv_bias, qk_norm)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        attn_out = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        # hidden += attn_out in place, fused with the norm: hidden is this forward pass's own intermediate.
        return hidden + self.mlp(self.post_attention_layernorm(attn_out, residual=hidden))


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    use_fused_decoder = True  # tests switch it off to compare against the module-by-module path
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    stacked_params: StackedParams = FUSED_QKV_GATE_UP

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.tp_size = get_tp_group().world_size  # ranks every layer below is split over
        self.pp = get_pp_group()
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        is_first, is_last = self.pp.is_first_rank, self.pp.is_last_rank
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        # A tied LM head is the embedding matrix: the last stage needs it too.
        needs_embedding = is_first or (is_last and self.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if needs_embedding else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One cos/sin cache shared by every layer.
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_position)
        self.stage = StageLayers(config.num_hidden_layers, lambda index: LlamaDecoderLayer(
            config, index, self.rotary_emb if self.uses_rope(config, index) else None, qkv_bias, self.qk_norm,
            self.make_mlp(config, index)))
        self.layers = self.stage.layers
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if is_last else None
        has_lm_head = is_last and not self.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if has_lm_head else None
        self.fused_step = FusedDecodeStep(lambda: build_fused_decoder(
            self.stage.own, config, self.tp_size, rotary_of=lambda layer: layer.self_attn.rotary_emb)
            if self.use_fused_decoder else None)

    def uses_rope(self, config, index: int) -> bool:
        """Whether layer `index` rotates its queries and keys; a family with position-free layers overrides it."""
        return True

    def make_mlp(self, config, index: int) -> nn.Module:
        """Layer `index`'s MLP; a family whose layers differ there (a mixture of experts) overrides it."""
        return GatedMLP(config.hidden_size, config.intermediate_size, SiluAndMul(),
                        bias=getattr(config, "mlp_bias", False))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states on the last pipeline stage; None on the others (they send theirs on).
        `kv_caches` holds this stage's layers only."""
        if self.pp.is_first_rank:
            hidden = self.embed_tokens(input_ids)
        else:
            # Every stage builds the same batch, so the shape is known here: no header message is needed.
            dtype = self.stage.own[0].input_layernorm.weight.dtype
            hidden = self.pp.recv_prev((input_ids.shape[0], self.config.hidden_size), dtype, input_ids.device)
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
        rope = self.rotary_emb.tables(positions, hidden)
        for layer, kv_cache in zip(self.stage.own, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, meta)
        return hidden

    def fused_decoder(self) -> FusedDecoder | None:
        """Every layer of a decode step in one C call (see fused_cpu_decoder.py), built on first use; None where it
        does not apply, and then the modules run one by one."""
        return self.fused_step.decoder

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (on every tensor-parallel rank of the last pipeline stage)."""
        logits = self.embed_tokens.compute_logits(hidden) if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedTensor]],
                     quantization: str = "none") -> set[str]:
        """Store checkpoint tensors (Hugging Face names) in the parameters (see weight_utils.load_weights); tensors
        of modules another pipeline stage holds are skipped, as is a tied LM head (which is the embedding)."""
        absent = {name for name in ("embed_tokens", "norm", "lm_head") if getattr(self, name) is None}
        return load_weights(self, weights, quantization, self.stacked_params,
                            skip=lambda name: held_elsewhere(name, self.stage, absent))
