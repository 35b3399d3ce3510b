"""GGUF files with K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4 weights (IQ4_NL, IQ4_XS: nibbles that
index a table of non-uniform levels) run on their packed blocks through the whole engine; every logprob over
prefill and decode is within float32's rounding error (`float32_error_bound`) of the exact result: transformers' own
loading of the same file (which dequantizes with the gguf package: an independent decoder) run in float64. Types
without a kernel load as float32, with a warning."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_gguf_loader import write_tiny_gguf

from pagellm import LLM, SamplingParams

U = torch.finfo(torch.float32).eps / 2  # float32's unit roundoff: an operation is exact up to a factor 1 + d, |d| <= U


def float32_error_bound(hidden: torch.Tensor, lm_head: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """How far float32 arithmetic, adding in any order, may put each log-probability [positions, vocab] from the
    exact one; from the exact final hidden states x [positions, n], the lm_head W [vocab, n] and the exact
    log-probabilities.

    A logit z_v = sum_i x_i W_vi summed in float32 is off by at most gamma_n S_v, where S_v = sum_i |x_i W_vi| and
    gamma_n = n U / (1 - n U) (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), in whatever order the
    terms are added: kernels and CPUs pick different orders. log p_v = z_v - logsumexp(z) then moves by z_v's error
    minus the softmax-weighted mean of all of them. That bounds the lm_head's own rounding. The layers before it
    round too, and their errors reach the logits through the same products; they are not bounded separately but
    stay far inside this worst case, since rounding errors add up like a random walk (about sqrt(n) U S, not n U S).
    Measured on these files: pagellm within 0.05 of the bound (transformers' own float32 run about the same, its
    error at the logprob -38.08 that missed a fixed 1e-3 on an Intel Xeon 3.9 U S, the bound 256 U S). A real
    bug is far outside: one of IQ4's 16 levels off by one, 190-9000 times the bound; IQ4_XS sub-block scales
    rounded to float16, which leaves every greedy token as it was, 9.6 times."""
    n = hidden.shape[-1]
    gamma = n * U / (1 - n * U)
    magnitudes = hidden.abs() @ lm_head.abs().T  # S [positions, vocab]
    return gamma * (magnitudes + (logprobs.exp() * magnitudes).sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.IQ4_NL, QT.IQ4_XS],
                         ids=lambda t: t.name)
def test_k_quant_file_runs_packed_and_matches_transformers(tmp_path, qtype):
    from transformers import AutoModelForCausalLM

    path = tmp_path / f"tiny-{qtype.name}.gguf"
    hf_weights = write_tiny_gguf(path, qtype)
    # float64 over the same dequantized weights (float32 values, exact in float64): transformers' float32 result
    # depends on the CPU it runs on, the exact one does not
    reference_model = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name,
                                                           dtype=torch.float64).eval()
    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    weight_bytes = llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0]
    float_bytes = 4 * sum(w.size for w in hf_weights.values() if w.ndim == 2)
    assert weight_bytes < float_bytes / 4  # packed: 2.6 (Q2_K) to 6.6 (Q6_K) bits per weight

    assert_greedy_within_float32_error(llm, reference_model)


def assert_greedy_within_float32_error(llm: LLM, reference_model) -> None:
    """Two prompts, 8 greedy tokens each: every token is the float64 reference's argmax, and each of its top-3
    logprobs is within `float32_error_bound` of the reference's."""
    prompts = [{"prompt_token_ids": [5, 17, 100, 42, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3, ignore_eos=True)
    for out in llm.generate(prompts, params, use_tqdm=False):
        tokens = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.inference_mode():
            hidden = reference_model.model(torch.tensor([tokens])).last_hidden_state[0]
            reference = reference_model.lm_head(hidden).log_softmax(dim=-1)
            bound = float32_error_bound(hidden, reference_model.lm_head.weight, reference)
        start = len(out.prompt_token_ids) - 1
        assert len(out.outputs[0].logprobs) == 8
        for step, entry in enumerate(out.outputs[0].logprobs):
            assert out.outputs[0].token_ids[step] == int(reference[start + step].argmax())  # greedy agrees
            for token, logprob in entry.items():
                expected = reference[start + step, token].item()
                assert logprob.logprob == pytest.approx(expected, abs=bound[start + step, token].item())


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
