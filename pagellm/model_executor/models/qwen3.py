"""Qwen3: the Llama decoder with RMSNorm on each query and key head before RoPE."""
from pagellm.model_executor.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
