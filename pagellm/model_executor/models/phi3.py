"""Phi-3 and Phi-4-mini: the Llama decoder as their checkpoints store it, plus the LongRoPE context bound.

Their checkpoints already hold the fused `qkv_proj` and `gate_up_proj` matrices, which the fused layers load whole
(each splits the matrix into its shards for tensor parallelism), so nothing is renamed. Partial rotary
(Phi-4-mini's 0.75) is the rotary embedding's `partial_rotary_factor`; such a model runs module by module, as the
one-call CPU decode step rotates whole heads only.

LongRoPE: transformers rotates with the short factors while a forward pass's positions stay within
original_max_position_embeddings and switches every position of the pass to the long factors past it, so its output
beyond that length depends on how the sequence was split into passes. pagellm rotates with the short factors, and
its context stops at original_max_position_embeddings (the default max_model_len; a longer one is refused), where
it could not be exact.
"""
from __future__ import annotations

from pagellm.model_executor.layers.rotary_embedding import longrope_limit
from pagellm.model_executor.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config, max_position: int) -> None:
        limit = longrope_limit(config)
        if limit is not None and max_position > limit:
            raise ValueError(
                f"max_model_len ({max_position}) exceeds this LongRoPE model's original_max_position_embeddings "
                f"({limit}): past it transformers switches to the long RoPE factors, which pagellm does not "
                f"implement; pass --max-model-len {limit} (max_model_len={limit}) or less.")
        super().__init__(config, max_position)
