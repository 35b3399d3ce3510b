"""Qwen3-MoE: Qwen3's decoder (QK norm) whose MLP is, on most layers, a mixture of experts (layers/moe.py).

A layer is sparse when it is not in `mlp_only_layers`, the config has experts, and its 1-based index is a multiple
of `decoder_sparse_step`; the others keep the dense MLP of `intermediate_size`. Checkpoints name each expert's
projections `mlp.experts.{j}.gate_proj/up_proj/down_proj` and the router `mlp.gate`, so the Llama loader's renaming
of gate/up into gate_up_proj applies to the experts too. The one-call CPU decode step fuses Llama-shaped layers
only, so this model always runs module by module.
"""
from __future__ import annotations

from torch import nn

from pagellm.model_executor.layers.moe import MixtureOfExperts
from pagellm.model_executor.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config, index: int) -> bool:
    """Whether layer `index` uses the mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
    return (index not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    use_fused_decoder = False

    def make_mlp(self, config, index: int) -> nn.Module:
        if not is_sparse_layer(config, index):
            return super().make_mlp(config, index)
        return MixtureOfExperts(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                config.num_experts_per_tok, bool(config.norm_topk_prob))
