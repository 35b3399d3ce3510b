"""`bench random-checkpoint`: a Hugging Face Llama directory of a real model's configuration (here with one layer
and a small hidden size, so the test stays light) that transformers loads with every tensor in place, whose
tokenizer decodes every id of the full vocabulary, and on which pagellm's greedy tokens equal transformers'."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from pagellm.benchmarks import random_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    small = dict(random_checkpoint.SHAPES["llama-3.2-1b"], hidden_size=128, intermediate_size=256, head_dim=32,
                 num_attention_heads=4, num_key_value_heads=2)
    shapes = dict(random_checkpoint.SHAPES, small=small)
    out = tmp_path_factory.mktemp("random-checkpoint")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(random_checkpoint, "SHAPES", shapes)
        random_checkpoint.run(argparse.Namespace(output=out, shape="small", layers=1, dtype="float32", seed=0))
    return out


def test_transformers_loads_every_tensor_and_the_tokenizer_decodes_every_id(checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((checkpoint / "config.json").read_text())
    assert config["vocab_size"] == 128256 and config["rope_scaling"]["rope_type"] == "llama3"
    model, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as in the model
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert len(tokenizer) == 128256
    assert tokenizer.decode([0, 100, 128255], skip_special_tokens=True) != ""
    assert tokenizer.decode(tokenizer.encode("a test")) == "a test"


def test_pagellm_greedy_matches_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    from pagellm import LLM, SamplingParams

    prompt = [5, 60, 200, 7, 128000, 90000]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)[0, len(prompt):]
    llm = LLM(model=str(checkpoint), max_model_len=64, kv_cache_memory_bytes=16 << 20)
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == expected.tolist()
