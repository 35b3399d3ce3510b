"""Whether, and how, a model's decode steps run as one C call (kernels/decoder.py): every layer of the step back to
back, float32 on the CPU, every projection on the C kernel.

The call applies to one tensor-parallel rank only (it cannot sum row-parallel outputs over the ranks), to layers of
the shape the C side implements (pre-norm RMSNorm, a gate|up MLP with SiLU or tanh-GELU, optional QKV bias, Q/K
norms and output norms, full rotary), and only where the attention backend attends as the C kernel does. A
pipeline stage fuses its own layers. `FusedDecodeStep` is what a model holds: built on first use, run for the
batches it takes. Rows with LoRA adapters run in it too: it points the C side at the worker's adapter slots
(lora/worker_manager.py) when a slot's adapter changes, and passes each row's slot with every step.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagellm.kernels import decoder as fused_decoder_kernels
from pagellm.kernels import elementwise
from pagellm.kernels.decoder import FusedDecoder, LayerWeights
from pagellm.lora import context as lora_context
from pagellm.lora.weights import LoRAModel
from pagellm.model_executor.layers.activation import GeluAndMul, SiluAndMul
from pagellm.model_executor.layers.attention import AttentionMetadata, select_backend
from pagellm.model_executor.layers.linear import KERNEL_MAX_ROWS
from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding

# The gate activations the C side has, by module type.
_ACTIVATIONS: dict[type, str] = {SiluAndMul: "silu", GeluAndMul: "gelu_tanh"}


@dataclass(frozen=True, slots=True)
class LayerNorms:
    """The parts a decoder layer's RMSNorms play: on the attention's input and the MLP's input, and, where the family
    has them (Gemma 3), on the attention's and the MLP's outputs before each residual add."""
    input: nn.Module
    mlp: nn.Module
    attn_out: nn.Module | None = None
    mlp_out: nn.Module | None = None


def llama_norms(layer: nn.Module) -> LayerNorms:
    return LayerNorms(layer.input_layernorm, layer.post_attention_layernorm)


def build_fused_decoder(layers: list[nn.Module], config, tp_size: int,
                        rotary_of: Callable[[nn.Module], RotaryEmbedding | None],
                        norms_of: Callable[[nn.Module], LayerNorms] = llama_norms) -> FusedDecoder | None:
    """The one-call decoder over `layers` (decoder layers with `self_attn` and `mlp` as in llama.py), or None where it
    does not apply. `rotary_of(layer)` is the layer's RotaryEmbedding (None: no positions), `norms_of(layer)` its
    norms' parts."""
    # The device is checked before the C library is loaded, which compiles it the first time.
    rotaries = [rotary_of(layer) for layer in layers]
    if (tp_size > 1 or any(r.cos_cache.device.type != "cpu" or r.rotary_dim != r.head_dim for r in rotaries if r)
            or fused_decoder_kernels.load() is None
            or not select_backend("cpu", torch.float32).supports_fused_decoder):
        return None
    activations = {_ACTIVATIONS.get(type(getattr(layer.mlp, "act", None))) for layer in layers}
    if len(activations) != 1 or None in activations:
        return None
    weights = []
    for layer, rotary in zip(layers, rotaries, strict=True):
        attn, mlp, norms = layer.self_attn, layer.mlp, norms_of(layer)
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if any(p.kernel is None for p in projections) or not elementwise.applies(norms.input.weight):
            return None
        qkv, o, gate_up, down = (p.kernel for p in projections)
        weights.append(LayerWeights(
            qkv=qkv, o=o, gate_up=gate_up, down=down, input_norm=norms.input.weight, mlp_norm=norms.mlp.weight,
            cos_table=rotary.cos_cache if rotary else None, sin_table=rotary.sin_cache if rotary else None,
            qkv_bias=attn.qkv_proj.bias,
            o_bias=attn.o_proj.bias, gate_up_bias=mlp.gate_up_proj.bias, down_bias=mlp.down_proj.bias,
            q_norm=attn.q_norm.weight if attn.q_norm else None, k_norm=attn.k_norm.weight if attn.k_norm else None,
            attn_out_norm=norms.attn_out.weight if norms.attn_out else None,
            mlp_out_norm=norms.mlp_out.weight if norms.mlp_out else None, sliding_window=attn.attn.sliding_window,
            kv_group=attn.attn.kv_group, lora_targets=tuple(projections)))
    attn = layers[0].self_attn
    if len({layer.self_attn.attn.scale for layer in layers}) != 1:
        return None
    return FusedDecoder(weights, hidden=config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                        head_dim=attn.head_dim, intermediate=config.intermediate_size,
                        eps=norms_of(layers[0]).input.eps, scale=attn.attn.scale, activation=activations.pop())


class FusedDecodeStep:
    """A model's one-call decode step: `build` runs on the first decode-only batch (None: the step does not apply,
    and the modules run one by one from then on)."""

    def __init__(self, build: Callable[[], FusedDecoder | None]) -> None:
        self._build = build
        self._decoder: FusedDecoder | None = None
        self.built = False
        self._lora_slots: list[LoRAModel | None] = []  # the adapter whose weights each C slot points at

    @property
    def decoder(self) -> FusedDecoder | None:
        if not self.built:
            self._decoder, self.built = self._build(), True
        return self._decoder

    def run(self, hidden: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
            meta: AttentionMetadata) -> torch.Tensor | None:
        """The layers' output for a batch of decodes only, in one call; None when the batch has prefills, is wider
        than the C matmul takes, or the step does not apply (then the caller runs its modules)."""
        if meta.prefills or meta.num_decodes > KERNEL_MAX_ROWS:
            return None
        decoder = self.decoder
        if decoder is None:
            return None
        lora = lora_context.current()
        if lora is not None:
            if lora.row_slot is None:
                return None  # no slots given: the modules add the deltas
            self._bind_lora(decoder, lora.slots)
        slots, tables = meta.slot_mapping, meta.decode_block_tables
        assert tables is not None, "a decode-only batch has its block tables"
        if meta.kv_groups:  # several KV cache groups: each layer reads its group's row
            slots = torch.stack([slots, *(group.slot_mapping for group in meta.kv_groups)])
            tables = torch.stack([tables, *(g.decode_block_tables for g in meta.kv_groups
                                            if g.decode_block_tables is not None)])
        return decoder.forward(hidden, positions, kv_caches, slots, tables, meta.decode_seq_lens,
                               None if lora is None else lora.row_slot)

    def _bind_lora(self, decoder: FusedDecoder, slots: tuple[LoRAModel | None, ...]) -> None:
        """Point the C side's slots at `slots`' adapters, rewriting only the slots whose adapter changed."""
        if len(slots) > len(self._lora_slots):
            decoder.set_lora_slots(len(slots))
            self._lora_slots += [None] * (len(slots) - len(self._lora_slots))
        for slot, adapter in enumerate(slots):
            if self._lora_slots[slot] is adapter:
                continue
            for index, layer in enumerate(decoder.layers):
                for projection, module in enumerate(layer.lora_targets):
                    weights = adapter.layers.get(module) if adapter is not None else None
                    decoder.set_lora(slot, index, projection,
                                     None if weights is None else (weights.a, weights.b_t, weights.parts))
            self._lora_slots[slot] = adapter
