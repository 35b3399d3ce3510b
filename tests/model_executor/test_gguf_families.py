"""GGUF files of every family the converter knows run packed through the whole engine: a Qwen2 file (QKV biases)
and a Qwen3 file (per-head Q/K norms, stored without llama.cpp's Q/K permutation) give every logprob within float32's
rounding error of transformers' own loading of the same file, run in float64 (see test_k_quants.py)."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_gguf_loader import ARCHITECTURES, write_tiny_gguf
from test_k_quants import assert_greedy_within_float32_error

from pagellm import LLM


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_family_file_runs_packed_and_matches_transformers(tmp_path, arch, qtype):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{arch}-{qtype.name}.gguf"
    hf_weights = write_tiny_gguf(path, qtype, arch=arch, **ARCHITECTURES[arch][1])
    reference_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float64).eval()
    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.config.model_config.architecture == ARCHITECTURES[arch][0]
    weight_bytes = llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0]
    float_bytes = 4 * sum(w.size for w in hf_weights.values() if w.ndim == 2)
    assert weight_bytes < float_bytes / 3  # packed

    assert_greedy_within_float32_error(llm, reference_model)
