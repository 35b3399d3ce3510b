"""Whether, and how, a Llama-style model's decode steps run as one C call (kernels/decoder.py): every layer of the
step back to back, float32 on the CPU, every projection on the C kernel.

The call applies to one tensor-parallel rank only (it cannot sum row-parallel outputs over the ranks), to models whose
layers are all the Llama layer's shape (pre-norm RMSNorm, gate|up SiLU MLP, optional QKV bias and Q/K norms), and
only where the attention backend attends as the C kernel does. A pipeline stage fuses its own layers.
"""
from __future__ import annotations

import torch
from torch import nn

from pagellm.kernels import decoder as fused_decoder_kernels
from pagellm.kernels import elementwise
from pagellm.kernels.decoder import FusedDecoder, LayerWeights
from pagellm.model_executor.layers.attention import select_backend
from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding


def build_fused_decoder(layers: list[nn.Module], rotary_emb: RotaryEmbedding, config, tp_size: int) -> \
        FusedDecoder | None:
    """The one-call decoder over `layers` (Llama decoder layers), or None where it does not apply."""
    # The device is checked before the C library is loaded, which compiles it the first time.
    if (tp_size > 1 or rotary_emb.cos_cache.device.type != "cpu" or rotary_emb.rotary_dim != rotary_emb.head_dim
            or fused_decoder_kernels.load() is None
            or not select_backend("cpu", torch.float32).supports_fused_decoder):
        return None
    weights = []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
        if any(p.kernel is None for p in projections) or not elementwise.applies(layer.input_layernorm.weight):
            return None
        qkv, o, gate_up, down = (p.kernel for p in projections)
        weights.append(LayerWeights(
            qkv=qkv, o=o, gate_up=gate_up, down=down, input_norm=layer.input_layernorm.weight,
            post_norm=layer.post_attention_layernorm.weight, qkv_bias=attn.qkv_proj.bias, o_bias=attn.o_proj.bias,
            gate_up_bias=mlp.gate_up_proj.bias, down_bias=mlp.down_proj.bias,
            q_norm=attn.q_norm.weight if attn.q_norm else None, k_norm=attn.k_norm.weight if attn.k_norm else None,
            sliding_window=attn.attn.sliding_window))
    attn = layers[0].self_attn
    return FusedDecoder(weights, hidden=config.hidden_size, heads=attn.num_heads, kv_heads=attn.num_kv_heads,
                        head_dim=attn.head_dim, intermediate=config.intermediate_size,
                        eps=layers[0].input_layernorm.eps, cos_table=rotary_emb.cos_cache,
                        sin_table=rotary_emb.sin_cache)
