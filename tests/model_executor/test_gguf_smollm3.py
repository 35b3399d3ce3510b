"""A SmolLM3 GGUF file (`smollm3`: written by llama.cpp's converter as Llama, Q/K rows permuted; llama.cpp keeps the
layers without RoPE in code, every fourth) converts to SmolLM3 and runs packed through the whole engine: every greedy
token and logprob within float32's rounding error of transformers' SmolLM3 on the same weights, run in float64.
transformers cannot load a smollm3 GGUF, so its model is built from the weights written (for Q8_0, as the file's
blocks dequantize: rounding each row's blocks of 32 commutes with permuting rows)."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import test_gguf_loader
import torch
from gguf import GGMLQuantizationType as QT
from test_gguf_loader import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, tiny_vocab, write_tiny_gguf
from test_k_quants import assert_greedy_within_float32_error

from pagellm import LLM

LAYERS = 4  # layer 3 has no RoPE


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "pagellm-cache"))


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0], ids=lambda t: t.name)
def test_smollm3_file_runs_packed_and_matches_transformers(tmp_path, qtype, monkeypatch):
    from transformers import AutoModelForCausalLM, SmolLM3Config

    monkeypatch.setattr(test_gguf_loader, "LAYERS", LAYERS)
    path = tmp_path / f"tiny-smollm3-{qtype.name}.gguf"
    weights = write_tiny_gguf(path, qtype, arch="smollm3")
    config = SmolLM3Config(vocab_size=len(tiny_vocab()), hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                           max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0,
                           rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    assert config.no_rope_layers == [1, 1, 1, 0]
    reference = AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    state = {}
    for name, value in weights.items():
        if value.ndim == 2 and qtype != QT.F32:
            value = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
        state[name] = torch.from_numpy(np.ascontiguousarray(value)).double()
    missing, unexpected = reference.load_state_dict(state, strict=False)
    assert not unexpected and not [name for name in missing if "rotary" not in name]

    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    hf_config = llm.llm_engine.config.model_config.hf_config
    assert llm.llm_engine.config.model_config.architecture == "SmolLM3ForCausalLM"
    assert hf_config.no_rope_layers == [1, 1, 1, 0] and not hf_config.use_sliding_window
    assert_greedy_within_float32_error(llm, reference)
