"""Qwen2: the Llama decoder with a bias on the Q/K/V projections."""
from pagellm.model_executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
