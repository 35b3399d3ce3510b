"""The Llama-family decoder (Llama 2/3, SmolLM2, TinyLlama, Mistral), parameterised for its close relatives:
QKV bias (Qwen2) and per-head Q/K RMSNorm (Qwen3) are switches, not copies of the model.

Under tensor parallelism (the TP group set up before the model is built) each rank holds a slice of every layer:
its attention heads (attention and its KV cache see only those; Q/K norms act per head), its MLP columns and
its vocabulary rows; o_proj, down_proj and the embedding sum over the ranks, the LM head gathers the logits.

Under pipeline parallelism (the PP group) each stage builds and loads only its range of decoder layers: the first
also the embedding, the last the final norm and the LM head (and the embedding, when the head is tied to it). A
stage after the first receives the residual stream from the one before and sends its own on; only the last
returns hidden states. The layers keep no separate residual tensor (each layer returns the whole stream, its
norms applied on entry), so the stream is the one tensor passed between stages."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from pagellm.distributed.parallel_state import get_pp_group, get_tp_group, stage_layer_range
from pagellm.kernels import decoder as fused_decoder_kernels
from pagellm.kernels import elementwise
from pagellm.kernels.decoder import FusedDecoder, LayerWeights
from pagellm.model_executor.layers.activation import SiluAndMul
from pagellm.model_executor.layers.attention import Attention, AttentionMetadata, attention_backend
from pagellm.model_executor.layers.layernorm import RMSNorm
from pagellm.model_executor.layers.linear import (KERNEL_MAX_ROWS, ColumnParallelLinear, Linear,
                                                  MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
from pagellm.model_executor.layers.quantization import PackedTensor
from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding
from pagellm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool) -> None:
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
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, rope: tuple, hidden: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(rope, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        size = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [size, size], bias=bias)
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, rotary_emb: RotaryEmbedding, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, kv_cache, meta) -> torch.Tensor:
        attn_out = self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        # hidden += attn_out in place, fused with the norm: hidden is this forward pass's own intermediate.
        return hidden + self.mlp(self.post_attention_layernorm(attn_out, residual=hidden))


class OtherStageLayer(nn.Module):
    """Stands in for a decoder layer another pipeline stage holds: no parameters, and this stage's own layers keep
    their indices (and so their checkpoint names)."""


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    use_fused_decoder = True  # tests switch it off to compare against the module-by-module path
    # checkpoint name fragment -> (fused parameter fragment, shard index)
    stacked_params = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.tp_size = get_tp_group().world_size  # ranks every layer below is split over
        self.pp = get_pp_group()
        self.start_layer, self.end_layer = stage_layer_range(config.num_hidden_layers, self.pp.rank,
                                                             self.pp.world_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        is_first, is_last = self.pp.is_first_rank, self.pp.is_last_rank
        qkv_bias = self.qkv_bias or getattr(config, "attention_bias", False)
        # A tied LM head is the embedding matrix: the last stage needs it too.
        needs_embedding = is_first or (is_last and self.tie_word_embeddings)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size) if needs_embedding else None
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One cos/sin cache shared by every layer.
        self.rotary_emb = RotaryEmbedding(config, head_dim, max_position)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, qkv_bias, self.qk_norm)
            if self.start_layer <= index < self.end_layer else OtherStageLayer()
            for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if is_last else None
        has_lm_head = is_last and not self.tie_word_embeddings
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if has_lm_head else None
        self._fused: FusedDecoder | bool | None = None  # None: not built yet; False: does not apply
        # This pipeline stage's decoder layers, in order (all of them with one stage): a plain list, built once.
        self.own_layers: list[LlamaDecoderLayer] = list(self.layers)[self.start_layer:self.end_layer]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor | None:
        """The final hidden states on the last pipeline stage; None on the others (they send theirs on).
        `kv_caches` holds this stage's layers only."""
        if self.pp.is_first_rank:
            hidden = self.embed_tokens(input_ids)
        else:
            # Every stage builds the same batch, so the shape is known here: no header message is needed.
            dtype = self.own_layers[0].input_layernorm.weight.dtype
            hidden = self.pp.recv_prev((input_ids.shape[0], self.config.hidden_size), dtype, input_ids.device)
        hidden = self._run_layers(hidden, positions, kv_caches, meta)
        if not self.pp.is_last_rank:
            self.pp.send_next(hidden)
            return None
        return self.norm(hidden)

    def _run_layers(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                    meta: AttentionMetadata) -> torch.Tensor:
        if not meta.prefills and meta.num_decodes <= KERNEL_MAX_ROWS and self.fused_decoder() is not None:
            return self._fused.forward(hidden, positions, kv_caches, meta.slot_mapping, meta.decode_block_tables,
                                       meta.decode_seq_lens)
        rope = self.rotary_emb.tables(positions, hidden)
        for layer, kv_cache in zip(self.own_layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, meta)
        return hidden

    def fused_decoder(self) -> FusedDecoder | None:
        """Every layer of a decode step in one C call (float32 on the CPU, every projection on the C kernel, one
        tensor-parallel rank; a pipeline stage fuses its own layers), built on first use; None where it does not
        apply, and then the modules run one by one."""
        if self._fused is None:
            self._fused = self._build_fused_decoder() or False
        return self._fused or None

    def _build_fused_decoder(self) -> FusedDecoder | None:
        # The C call runs every layer back to back, with no way to sum row-parallel outputs over the ranks; its
        # attention is the C kernel's, so another decode-attention backend keeps the layers apart. The device is
        # checked before the C library is loaded, which compiles it the first time.
        if (not self.use_fused_decoder or self.tp_size > 1 or self.rotary_emb.cos_cache.device.type != "cpu"
                or fused_decoder_kernels.load() is None or attention_backend("cpu", torch.float32) != "c"):
            return None
        layers = []
        own_layers = self.own_layers
        for layer in own_layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
            if any(p.kernel is None for p in projections) or not elementwise.applies(layer.input_layernorm.weight):
                return None
            layers.append(LayerWeights(
                *(p.kernel for p in projections), layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                *(p.bias for p in projections), attn.q_norm.weight if attn.q_norm else None,
                attn.k_norm.weight if attn.k_norm else None))
        attn = own_layers[0].self_attn
        return FusedDecoder(layers, hidden=self.config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                            head_dim=attn.head_dim, intermediate=self.config.intermediate_size,
                            eps=own_layers[0].input_layernorm.eps, cos_table=self.rotary_emb.cos_cache,
                            sin_table=self.rotary_emb.sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary (on every tensor-parallel rank of the last pipeline stage)."""
        logits = self.embed_tokens.compute_logits(hidden) if self.lm_head is None else self.lm_head(hidden)
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | PackedTensor]],
                     quantization: str = "none") -> set[str]:
        """Store checkpoint tensors (Hugging Face names) in the parameters, matrices through their layer's
        `load_weight` (which may keep them packed, see `quantization`); returns the names loaded. Tensors of
        modules another pipeline stage holds are skipped (as is a tied LM head, which is the embedding)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or self._held_elsewhere(name):
                continue
            fragment = next((f for f in self.stacked_params if f".{f}." in name), None)
            if fragment is not None:
                fused, shard = self.stacked_params[fragment]
                name = name.replace(f".{fragment}.", f".{fused}.")
            module_name, _, kind = name.rpartition(".")
            if name not in params:
                raise ValueError(f"Checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}.")
            module = self.get_submodule(module_name)
            try:
                if fragment is not None and kind == "weight":
                    module.load_shard(tensor, shard, quantization)
                elif fragment is not None:
                    module.load_bias_shard(tensor, shard)
                elif kind == "weight" and isinstance(module, Linear):
                    module.load_weight(tensor, quantization)
                elif params[name].shape != tensor.shape:
                    raise ValueError(f"has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}.")
                else:
                    params[name].data.copy_(tensor)
            except ValueError as exc:
                raise ValueError(f"Checkpoint tensor {name!r}: {exc}") from exc
            loaded.add(name)
        missing = set(params) - loaded
        missing |= {f"{module_name}.weight (some of its shards)" for module_name, module in self.named_modules()
                    if isinstance(module, ColumnParallelLinear) and module.has_pending_shards}
        if missing:
            raise ValueError(f"Checkpoint is missing weights: {sorted(missing)[:8]}")
        return loaded

    def _held_elsewhere(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (without "model.") belongs to a module this stage does not build."""
        module = name.split(".", 1)[0]
        if module == "layers":
            return not self.start_layer <= int(name.split(".")[1]) < self.end_layer
        absent = {"embed_tokens": self.embed_tokens is None, "norm": self.norm is None,
                  "lm_head": self.lm_head is None}
        return absent.get(module, False)
