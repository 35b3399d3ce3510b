"""Qwen3-MoE: Qwen3's decoder (QK norm) whose MLP is, on most layers, a mixture of experts (layers/moe.py).

A layer is sparse when it is not in `mlp_only_layers`, the config has experts, and its 1-based index is a multiple
of `decoder_sparse_step`; the others keep the dense MLP of `intermediate_size`. Checkpoints name each expert's
projections `mlp.experts.{j}.gate_proj/up_proj/down_proj` and the router `mlp.gate`, so the Llama loader's renaming
of gate/up into gate_up_proj applies to the experts too. The one-call CPU decode step fuses Llama-shaped layers
only, so this model always runs module by module.
"""
from __future__ import annotations

from pagellm.model_executor.layers.moe import MixtureOfExperts
from pagellm.model_executor.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config, index: int) -> bool:
    """Whether layer `index` uses the mixture of experts (transformers' Qwen3MoeDecoderLayer rule)."""
    return (index not in (getattr(config, "mlp_only_layers", None) or []) and config.num_experts > 0
            and (index + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    use_fused_decoder = False

    def __init__(self, config, max_position: int) -> None:
        super().__init__(config, max_position)
        # The Llama layers come with a dense MLP; the sparse layers trade theirs for the experts before any weight
        # is stored. The dense matrices were allocated, never written: on the CPU their pages were never touched,
        # on a GPU the caching allocator hands their memory to the (larger) experts built next.
        for index, layer in enumerate(self.layers):
            if self.stage.holds_layer(index) and is_sparse_layer(config, index):
                layer.mlp = MixtureOfExperts(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                                             config.num_experts_per_tok, bool(config.norm_topk_prob))
