"""Speculative method `draft_model` (worker/draft_proposer.py) end to end on tiny random-weight models sharing
SmolLM2's vocabulary: greedy outputs are transformers' greedy decoding of the target, token for token, whatever the
draft (the target's own weights, whose drafts must then all be accepted; a near copy, accepted in part; another
model, rejected), and identical to no speculation under chunked prefill, prefix caching, preemption, n > 1,
constrained requests beside drafting ones and async scheduling; every draft is transformers' greedy continuation
under the draft model (its K/V, caught up and rolled back, holds the request's tokens); the default model's Q4_1
file drafts for its float32 self; bad settings are refused naming the field."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.engine.arg_utils import EngineArgs
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.spec_decode import adaptive
from pagellm.worker.draft_proposer import DraftModelProposer

MAX_MODEL_LEN = 256
K = 4


@pytest.fixture(autouse=True)
def fixed_draft_length(monkeypatch):
    """Every decode drafts k tokens: the adaptive length follows this host's step times (see
    tests/entrypoints/test_llm_spec_decode.py), which must not switch drafting off in tests of what drafts produce."""
    monkeypatch.setattr(adaptive, "best_length", lambda rate, max_k, *_: max_k)


def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def target(tiny_model_factory):
    model_dir = tiny_model_factory("llama")
    return model_dir, load_hf(model_dir)


@pytest.fixture(scope="module")
def drafts(tiny_model_factory, target):
    """Draft models of the target's vocabulary: its own weights; the same weights under another RoPE base (about a
    third of the drafts kept, so drafts are rolled back often); an unrelated model (nearly none kept)."""
    return {"self": target[0], "near": tiny_model_factory("llama", rope_theta=50000.0),
            "other": tiny_model_factory("qwen2")}


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    return make_token_prompts([5, 23, 40, 9], seed=7)


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def make_llm(model_dir, draft=None, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    spec = None if draft is None else {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16, speculative_config=spec, **kwargs)


def greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


def stats(llm: LLM):
    return llm.llm_engine.engine_core.scheduler.spec_decoding_stats


@pytest.mark.parametrize("draft", ["self", "near", "other"])
def test_greedy_matches_transformers(target, drafts, prompts, draft):
    model_dir, hf = target
    llm = make_llm(model_dir, drafts[draft])
    outputs = llm.generate(prompts, greedy(24))
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, prompt["prompt_token_ids"], 24)
    spec = stats(llm)
    assert spec.num_drafts > 0
    rate = spec.acceptance_rate
    # The target's own weights draft exactly what the target samples; a near copy agrees in part.
    assert {"self": rate == 1.0, "near": 0.1 < rate < 0.9, "other": rate < 0.1}[draft], (draft, rate)
    llm.llm_engine.engine_core.scheduler.check_consistency()


def test_each_draft_is_the_draft_models_greedy_continuation(target, drafts, prompts, monkeypatch):
    """Whatever the target accepted before, each draft is what transformers' greedy decoding of the draft model
    continues the request's tokens with: the draft's K/V (caught up, with rejected positions rewritten) is right."""
    model_dir, _ = target
    recorded: list[tuple[list[int], list[int]]] = []
    propose = DraftModelProposer.propose

    def recording(self, output):
        filled, made = propose(self, output)
        for scheduled in filled.scheduled:
            if scheduled.request_id in made:
                tokens = self.runner.input_batch.requests[scheduled.request_id].all_token_ids
                recorded.append((tokens[:scheduled.num_computed_tokens + 1], made[scheduled.request_id]))
        return filled, made

    monkeypatch.setattr(DraftModelProposer, "propose", recording)
    llm = make_llm(model_dir, drafts["near"])
    llm.generate(prompts, greedy(24))
    assert 0 < stats(llm).num_accepted_tokens < stats(llm).num_draft_tokens, "drafts were meant to be rolled back"
    draft_hf = load_hf(drafts["near"])
    assert len(recorded) > 20
    for context, draft in recorded:
        assert draft == hf_greedy(draft_hf, context, len(draft))


@pytest.mark.parametrize("case", ["chunked-prefill", "prefix-caching", "preemption"])
def test_identical_to_no_speculation(target, drafts, prompts, pool_bytes, case):
    model_dir, _ = target
    kwargs = {"chunked-prefill": {"max_num_batched_tokens": 16},
              "prefix-caching": {"enable_prefix_caching": True}, "preemption": {}}[case]
    max_tokens = 60 if case == "preemption" else 40
    if case == "preemption":  # 16 blocks of 16 for 4 sequences growing to 65-100 tokens (23 blocks)
        kwargs["kv_cache_memory_bytes"] = pool_bytes(model_dir, 16, 16)
    expected = token_ids(make_llm(model_dir, **kwargs).generate(prompts, greedy(max_tokens)))
    if case == "preemption":  # the draft's cache takes its share of the budget: the same 16 blocks
        kwargs["kv_cache_memory_bytes"] = pool_bytes(model_dir, 16, 16) + pool_bytes(drafts["self"], 16, 16)
    llm = make_llm(model_dir, drafts["self"], **kwargs)
    # Twice over the same prompts: the second round hits the prefix cache (when on).
    for _ in range(2):
        assert token_ids(llm.generate(prompts, greedy(max_tokens))) == expected
    scheduler = llm.llm_engine.engine_core.scheduler
    # The target's own weights as the draft: every draft is kept, after preemptions and prefix-cache hits too.
    assert scheduler.spec_decoding_stats.acceptance_rate == 1.0
    scheduler.check_consistency()
    if case == "preemption":
        assert scheduler.kv_cache_manager.block_pool.num_blocks == 16
        assert scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"


def test_n_and_constrained_requests_identical_to_no_speculation(target, drafts, prompts):
    """n > 1 forks share blocks (copy-on-write applies to the draft's cache too); a constrained request decodes a
    token a step beside drafting ones."""
    model_dir, _ = target
    params = [greedy(20, n=2, logprobs=2), greedy(16, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,12}")),
              greedy(20), greedy(20, n=3)]
    base = make_llm(model_dir).generate(prompts, params)
    llm = make_llm(model_dir, drafts["self"])
    spec = llm.generate(prompts, params)
    assert token_ids(spec) == token_ids(base)
    for b, s in zip(base[0].outputs, spec[0].outputs):
        for lb, ls in zip(b.logprobs, s.logprobs):
            assert {t: ls[t].logprob for t in ls} == pytest.approx({t: lb[t].logprob for t in lb}, abs=1e-4)
    assert stats(llm).acceptance_rate == 1.0 and stats(llm).num_drafts > 0
    llm.llm_engine.engine_core.scheduler.check_consistency()


def test_seeded_sampling_matches_no_speculation(target, drafts, prompts):
    """Temperature > 0: the drafts are the draft model's argmax (deterministic), so rejection sampling keeps the
    target's distribution, and a seeded row's noise depends only on its seed and position: the same tokens."""
    model_dir, _ = target
    seeded = [SamplingParams(temperature=0.8, top_k=5, seed=3 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    expected = token_ids(make_llm(model_dir).generate(prompts, seeded))
    llm = make_llm(model_dir, drafts["near"])
    assert token_ids(llm.generate(prompts, seeded)) == expected
    assert stats(llm).num_accepted_tokens > 0


def test_async_scheduling_identical_to_no_speculation(target, drafts, prompts):
    """With async scheduling a request verifying a draft waits for its batch, and the worker's drafts come back with
    the step's deferred output (placeholders left in their stead would never be kept); nothing leaks."""
    model_dir, _ = target
    params = [greedy(24, n=2), greedy(16, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,12}")),
              SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=24, ignore_eos=True), greedy(24)]
    expected = token_ids(make_llm(model_dir).generate(prompts, params))
    llm = make_llm(model_dir, drafts["near"], async_scheduling=True)
    assert token_ids(llm.generate(prompts, params)) == expected
    assert 0 < stats(llm).num_accepted_tokens < stats(llm).num_draft_tokens
    scheduler = llm.llm_engine.engine_core.scheduler
    scheduler.check_consistency()
    assert scheduler.kv_cache_manager.block_pool.num_free_blocks == scheduler.kv_cache_manager.block_pool.num_blocks


def test_the_default_models_q4_1_file_drafts_for_its_float32_self(smollm2_dir):
    from pagellm.model_executor.model_loader.resolve import default_model_path

    prompt = {"prompt_token_ids": [1, 504, 3458, 314, 4649, 429, 2717, 30, 378, 3458, 314]}
    kwargs = dict(model=str(smollm2_dir), quantization="none", max_model_len=512, kv_cache_memory_bytes=64 << 20)
    expected = token_ids(LLM(**kwargs).generate([prompt], greedy(24)))
    llm = LLM(**kwargs, speculative_config={"method": "draft_model", "model": str(default_model_path()),
                                            "num_speculative_tokens": K})
    assert token_ids(llm.generate([prompt], greedy(24))) == expected
    # The float32 weights are the Q4_1 file's, dequantized: the drafts differ only by the kernels' rounding.
    assert stats(llm).acceptance_rate > 0.8


@pytest.mark.parametrize("spec, engine, message", [
    ({"method": "draft_model"}, {}, "speculative_config.model"),
    ({"method": "ngram", "model": "DRAFT"}, {}, "speculative_config.model"),
    ({"method": "draft_model", "model": "DRAFT", "draft_tensor_parallel_size": 2}, {}, "draft_tensor_parallel_size"),
    ({"method": "draft_model", "model": "DRAFT"}, {"tensor_parallel_size": 2}, "tensor-parallel-size"),
    ({"method": "draft_model", "model": "VOCAB"}, {}, "vocabulary"),
    ({"method": "draft_model", "model": "SHORT"}, {}, "max-model-len"),
    ({"method": "draft_model", "model": "DRAFT"}, {"model": "SLIDING"}, "sliding window"),
])
def test_bad_settings_are_refused(tiny_model_factory, target, spec, engine, message):
    paths = {"DRAFT": target[0], "VOCAB": tiny_model_factory("llama", vocab_size=49154),
             "SHORT": tiny_model_factory("llama", max_position_embeddings=128),
             "SLIDING": tiny_model_factory("mistral")}
    spec = {key: str(paths.get(value, value)) if key == "model" else value for key, value in spec.items()}
    engine = {"model": str(target[0]), **{key: str(paths.get(value, value)) if key == "model" else value
                                          for key, value in engine.items()}}
    with pytest.raises(ValueError, match=message):
        EngineArgs(**engine, max_model_len=MAX_MODEL_LEN, speculative_config=spec).create_engine_config()
