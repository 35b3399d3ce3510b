"""GGUF files with K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4 weights (IQ4_NL, IQ4_XS: nibbles that
index a table of non-uniform levels) run on their packed blocks through the whole engine; every logprob over
prefill and decode is within 1e-3 of transformers' own loading of the same file (which dequantizes with the gguf
package: an independent decoder). Types without a kernel load as float32, with a warning."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_gguf_loader import write_tiny_gguf

from pagellm import LLM, SamplingParams


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS],
                         ids=lambda t: t.name)
def test_k_quant_file_runs_packed_and_matches_transformers(tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{qtype.name}.gguf"
    hf_weights = write_tiny_gguf(path, qtype)
    reference_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    weight_bytes = llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0]
    float_bytes = 4 * sum(w.size for w in hf_weights.values() if w.ndim == 2)
    assert weight_bytes < float_bytes / 4  # packed: 2.6 (Q2_K) to 6.6 (Q6_K) bits per weight

    prompts = [{"prompt_token_ids": [5, 17, 100, 42, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.inference_mode():
            reference = reference_model(torch.tensor([tokens])).logits[0].log_softmax(dim=-1)
        start = len(out.prompt_token_ids) - 1
        assert len(out.outputs[0].logprobs) == 8
        for step, entry in enumerate(out.outputs[0].logprobs):
            assert out.outputs[0].token_ids[step] == int(reference[start + step].argmax())  # greedy agrees
            for token, logprob in entry.items():
                assert logprob.logprob == pytest.approx(reference[start + step, token].item(), abs=1e-3)


def test_types_without_a_kernel_are_dequantized_with_a_warning(tmp_path, monkeypatch, caplog):
    """An IQ2_XXS file (no packed kernel) still loads, as float32, and the log says which matrices and what they
    cost: a file must not take several times its size unexplained."""
    import logging

    import test_gguf_loader

    monkeypatch.setitem(test_gguf_loader.RAW_BLOCK_FP16_OFFSETS, QT.IQ2_XXS, (0,))  # random blocks, finite d
    path = tmp_path / "tiny-IQ2_XXS.gguf"
    hf_weights = write_tiny_gguf(path, QT.IQ2_XXS)
    monkeypatch.setattr(logging.getLogger("pagellm"), "propagate", True)
    with caplog.at_level(logging.WARNING, logger="pagellm"):
        llm = LLM(model=str(path), max_model_len=64, kv_cache_memory_bytes=4 << 20)
    matrices = sum(1 for w in hf_weights.values() if w.ndim == 2)
    warning = next(r.getMessage() for r in caplog.records if "No packed kernel" in r.getMessage())
    assert f"{matrices} IQ2_XXS matrices" in warning and "dequantized to float32" in warning
    float_bytes = 4 * sum(w.size for w in hf_weights.values() if w.ndim == 2)
    assert llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0] >= float_bytes
    out = llm.generate([{"prompt_token_ids": [5, 17, 100]}], SamplingParams(max_tokens=2, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
