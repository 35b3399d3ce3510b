"""Qwen3-MoE: which layers are sparse (transformers' rule), the experts and router as the checkpoint names them, no
one-call CPU decode step, and greedy tokens against transformers with the router's unnormalised top-k weights on
every other layer. The mixture itself: test_moe.py; the whole engine: tests/entrypoints/test_llm_phi3_qwen3_moe.py.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagellm import LLM, SamplingParams
from pagellm.model_executor.layers.mlp import GatedMLP
from pagellm.model_executor.layers.moe import MixtureOfExperts
from pagellm.model_executor.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer


def model_of(llm: LLM):
    return llm.llm_engine.engine_core.executor.collective_rpc("__getattribute__", "model_runner")[0].model


@pytest.mark.parametrize("step, mlp_only, experts", [(1, [1], 8), (2, [], 8), (3, [2, 5], 4), (1, [], 0)])
def test_sparse_layers_follow_transformers(step, mlp_only, experts):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeModel, Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_hidden_layers=6,
                            num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=32,
                            num_experts=experts, num_experts_per_tok=min(2, experts) or 1,
                            decoder_sparse_step=step, mlp_only_layers=mlp_only)
    hf = Qwen3MoeModel(config)
    for index, layer in enumerate(hf.layers):
        assert is_sparse_layer(config, index) == isinstance(layer.mlp, Qwen3MoeSparseMoeBlock), index


def test_layers_and_checkpoint_names(tiny_model_factory):
    model_dir = tiny_model_factory("qwen3_moe")
    llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    model = model_of(llm)
    assert isinstance(model, Qwen3MoeForCausalLM)
    assert [type(layer.mlp) for layer in model.layers] == [MixtureOfExperts, GatedMLP, MixtureOfExperts]
    moe = model.layers[2].mlp
    assert (moe.num_experts, moe.top_k, moe.renormalize) == (8, 2, True)
    checkpoint = load_file(model_dir / "model.safetensors")
    prefix = "model.layers.2.mlp"
    torch.testing.assert_close(moe.gate.weight, checkpoint[f"{prefix}.gate.weight"], rtol=0, atol=0)
    expert = moe.experts[5]
    gate_up = torch.cat([checkpoint[f"{prefix}.experts.5.gate_proj.weight"],
                         checkpoint[f"{prefix}.experts.5.up_proj.weight"]])
    torch.testing.assert_close(expert.gate_up_proj.weight, gate_up, rtol=0, atol=0)
    torch.testing.assert_close(expert.down_proj.weight, checkpoint[f"{prefix}.experts.5.down_proj.weight"],
                               rtol=0, atol=0)
    assert model.fused_decoder() is None, "the one-call decode step fuses Llama-shaped layers only"


def test_unnormalised_top_k_every_other_layer_matches_transformers(tiny_model_factory, make_token_prompts):
    """norm_topk_prob false (the top-k softmax weights as they are) and decoder_sparse_step 2: layer 1 only."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("qwen3_moe", norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[])
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20, max_num_batched_tokens=16)
    assert [type(layer.mlp) for layer in model_of(llm).layers] == [GatedMLP, MixtureOfExperts, GatedMLP]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    for output in llm.generate(make_token_prompts([5, 40], seed=4), params, use_tqdm=False):
        tokens = output.outputs[0].token_ids
        with torch.inference_mode():
            logits = hf(torch.tensor([output.prompt_token_ids + tokens])).logits[0]
        reference = logits[len(output.prompt_token_ids) - 1:-1].log_softmax(-1)
        ours = torch.tensor([entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens)])
        expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)
        assert ((reference.max(-1).values - expected) < 0.02).all()
