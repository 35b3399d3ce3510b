"""One realism check on the default model, SmolLM2-135M (30 layers, GGUF weights kept packed: the adapter's deltas
go on top of the packed matmul, in the fused CPU decode step's one C call): a PEFT adapter on every projection,
greedy beside the base model in one batch, against transformers running PEFT's merged model on the same
(dequantized) weights."""
from __future__ import annotations

import torch

from pagellm import LLM, SamplingParams
from pagellm.lora import LoRARequest
from tests.entrypoints.conftest import hf_greedy_generate

PROMPT = "The three primary colours are"
MAX_TOKENS = 8


def test_smollm2_adapter_matches_merged_model(smollm2_dir, peft_adapter_factory, lora_rows_seen):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter = peft_adapter_factory(smollm2_dir, seed=5, rank=16, alpha=32, scale=0.05)
    llm = LLM(model=str(smollm2_dir), enable_lora=True, max_model_len=128, kv_cache_memory_bytes=8 << 20)
    assert llm.llm_engine.config.model_config.quantization == "gguf"
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    base, tuned = llm.generate([PROMPT, PROMPT], params, lora_request=[None, LoRARequest("a", 1, str(adapter))],
                               use_tqdm=False)
    assert lora_rows_seen, "the decode steps ran the fused C step, the adapter's deltas on its packed matmuls"

    ids = AutoTokenizer.from_pretrained(str(smollm2_dir)).encode(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    expected_base = hf_greedy_generate(model, ids, MAX_TOKENS)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    expected_tuned = hf_greedy_generate(merged, ids, MAX_TOKENS)
    assert expected_tuned != expected_base
    assert base.outputs[0].token_ids == expected_base
    assert tuned.outputs[0].token_ids == expected_tuned
