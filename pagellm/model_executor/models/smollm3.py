"""SmolLM3: the Llama decoder with RoPE left out of some layers (NoPE), as transformers computes it.

transformers' rule (configuration_smollm3.py): `no_rope_layers[i]` is 1 where layer i *uses* RoPE (the name reads
the other way round); left out, it is 0 on every `no_rope_layer_interval`-th layer (3, 7, 11, ... for the default
4) and 1 elsewhere. A NoPE layer's queries and keys attend without positions, which is llama.py's `uses_rope`
switch. Where `use_sliding_window` and `sliding_window` are set, transformers marks the NoPE layers
"sliding_attention" in `layer_types`, which the attention reads (layer_sliding_window); SmolLM3-3B sets neither.
The checkpoint is Llama's (separate q/k/v and gate/up matrices, the LM head tied to the embedding by default).

The one-call CPU decode step (fused_cpu_decoder.py) skips the rotation of a NoPE layer (its RoPE tables are None).
"""
from __future__ import annotations

from pagellm.model_executor.models.llama import LlamaForCausalLM


class SmolLM3ForCausalLM(LlamaForCausalLM):
    def uses_rope(self, config, index: int) -> bool:
        return bool(config.no_rope_layers[index])
