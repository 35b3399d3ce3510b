"""Speculative decoding (ngram prompt lookup) end to end on a tiny random-weight model: greedy outputs are
token-identical to transformers' greedy decoding and to the engine without speculation, under chunked prefill,
prefix caching, preemption and n > 1, with drafts actually accepted; logprobs are the target model's. With
--async-scheduling too (ngram and suffix): the same tokens as the plain engine, drafting requests verifying while
the others decode blind, counters that match the drafts verified, and no block left held."""
from __future__ import annotations

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagellm import LLM, SamplingParams
from pagellm.metrics.prometheus import PrometheusStatLogger
from pagellm.spec_decode import adaptive

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MAX_MODEL_LEN = 256


@pytest.fixture(autouse=True)
def fixed_draft_length(monkeypatch):
    """Every match drafts k tokens. The adaptive length follows the step times this host measures
    (spec_decode/step_cost.py): a loaded host must not switch drafting off in tests of what drafts produce (the
    adaptive rule itself: tests/spec_decode/test_adaptive.py)."""
    monkeypatch.setattr(adaptive, "best_length", lambda rate, max_k, *_: max_k)


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama")
    return model_dir, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    """Repetitive prompts (a random phrase said several times), so that prompt lookup finds drafts."""
    phrases = make_token_prompts([7, 11, 5, 13], seed=31)
    return [{"prompt_token_ids": p["prompt_token_ids"] * 4 + p["prompt_token_ids"][:3]} for p in phrases]


def hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                             min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def make_llm(model_dir, spec: bool, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16,
               speculative_config=dict(SPEC) if spec else None, **kwargs)


def accepted(llm: LLM) -> int:
    return llm.llm_engine.engine_core.scheduler.spec_decoding_stats.num_accepted_tokens


def greedy(max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def token_ids(outputs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_greedy_matches_transformers_and_drafts_are_accepted(tiny, prompts, async_scheduling):
    model_dir, hf = tiny
    llm = make_llm(model_dir, spec=True, async_scheduling=async_scheduling)
    outputs = llm.generate(prompts, greedy())
    for prompt, output in zip(prompts, outputs):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, prompt["prompt_token_ids"], 24)
    stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    llm.llm_engine.engine_core.scheduler.check_consistency()
    # The counters reach Prometheus under vLLM's names.
    exposition = generate_latest(PrometheusStatLogger(
        "m", lambda: [llm.llm_engine.engine_core.scheduler.stats()]).registry).decode()
    samples = {s.name + str(sorted(s.labels.items())): s.value
               for family in text_string_to_metric_families(exposition) for s in family.samples}
    labels = str(sorted({"model_name": "m", "engine": "0"}.items()))
    assert samples["pagellm:spec_decode_num_accepted_tokens_total" + labels] == stats.num_accepted_tokens
    assert samples["pagellm:spec_decode_num_drafts_total" + labels] == stats.num_drafts
    assert samples["pagellm:spec_decode_num_draft_tokens_total" + labels] == stats.num_draft_tokens
    first = str(sorted({"model_name": "m", "engine": "0", "position": "0"}.items()))
    assert samples["pagellm:spec_decode_num_accepted_tokens_per_pos_total" + first] > 0


@pytest.mark.parametrize("case", ["chunked-prefill", "prefix-caching", "preemption", "preemption-async"])
def test_identical_to_no_speculation(tiny, prompts, pool_bytes, case):
    model_dir, _ = tiny
    kwargs = {"chunked-prefill": {"max_num_batched_tokens": 16},
              "prefix-caching": {"enable_prefix_caching": True},
              # 16 blocks of 16 for 4 sequences growing to 63-95 tokens (21 blocks): some are preempted.
              "preemption": {"kv_cache_memory_bytes": pool_bytes(model_dir, 16, 16)}}[case.removesuffix("-async")]
    expected = token_ids(make_llm(model_dir, spec=False, **kwargs).generate(prompts, greedy(40)))
    llm = make_llm(model_dir, spec=True, async_scheduling=case.endswith("-async"), **kwargs)
    # Twice over the same prompts: the second round hits the prefix cache (when on).
    for _ in range(2):
        assert token_ids(llm.generate(prompts, greedy(40))) == expected
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.spec_decoding_stats.num_accepted_tokens > 0
    scheduler.check_consistency()
    if case.startswith("preemption"):
        assert scheduler.num_preemptions_total > 0, "the pool was meant to force preemption"


def test_n_and_logprobs_identical_to_no_speculation(tiny, prompts):
    model_dir, _ = tiny
    params = greedy(20, n=2, logprobs=2)
    base = make_llm(model_dir, spec=False).generate(prompts, params)
    llm = make_llm(model_dir, spec=True)
    spec = llm.generate(prompts, params)
    assert token_ids(spec) == token_ids(base)
    for b, s in zip(base, spec):
        for cb, cs in zip(b.outputs, s.outputs):
            for lb, ls in zip(cb.logprobs, cs.logprobs):
                assert lb.keys() == ls.keys()
                for token in lb:
                    assert ls[token].logprob == pytest.approx(lb[token].logprob, abs=1e-4)
    assert accepted(llm) > 0


def test_never_past_max_tokens(tiny, prompts):
    model_dir, hf = tiny
    llm = make_llm(model_dir, spec=True)
    for max_tokens in (1, 2, 3, 5):
        outputs = llm.generate(prompts, greedy(max_tokens))
        for prompt, output in zip(prompts, outputs):
            assert list(output.outputs[0].token_ids) == hf_greedy(hf, prompt["prompt_token_ids"], 24)[:max_tokens]
    llm.llm_engine.engine_core.scheduler.check_consistency()


def test_constrained_and_stop_string_requests_run_without_drafts_beside_speculating_ones(tiny, prompts):
    """A grammar's bitmask covers one position and stop strings are found after detokenizing: such requests decode
    a token a step, in the same batches as speculating ones, with the outputs they have without speculation."""
    from pagellm.sampling_params import StructuredOutputsParams

    model_dir, _ = tiny
    params = [greedy(16, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,12}")),
              greedy(16, stop=["zzz"]), greedy(16), greedy(16)]
    base = make_llm(model_dir, spec=False).generate(prompts, params)
    llm = make_llm(model_dir, spec=True)
    spec = llm.generate(prompts, params)
    assert token_ids(spec) == token_ids(base)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in base]
    stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
    assert 0 < stats.num_drafts <= 2 * 15, "only the two plain requests draft, at most once per decode step"


def hf_logprobs(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """transformers' log-softmax at each output position: [len(output_ids), vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + output_ids])).logits[0, len(prompt_ids) - 1:-1]
    return logits.float().log_softmax(-1)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_sampled_requests_speculate_within_the_target_and_with_its_logprobs(tiny, prompts, async_scheduling,
                                                                            no_leaks):
    """Temperature > 0 speculates (rejection sampling; its statistics are in tests/spec_decode): every emitted token,
    drafted or not, lies in transformers' top-k at its position, and its logprobs are transformers'; every block
    comes back."""
    model_dir, hf = tiny
    llm = make_llm(model_dir, spec=True, async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0.5, top_k=3, max_tokens=24, ignore_eos=True, logprobs=1)
    outputs = llm.generate(prompts, params)
    assert accepted(llm) > 0, "drafts were meant to be kept at temperature > 0 too"
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        reference = hf_logprobs(hf, prompt["prompt_token_ids"], list(completion.token_ids))
        for position, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            assert token in reference[position].topk(3).indices.tolist()
            assert entry[token].logprob == pytest.approx(reference[position, token].item(), abs=1e-3)
    no_leaks(llm)


def test_seeded_sampling_matches_no_speculation_alone_and_in_a_batch(tiny, prompts):
    """A seeded row's noise depends only on its seed and output position (worker/sampling_inputs.py), so a seeded
    request's tokens do not depend on the drafts verified, nor on its batch."""
    model_dir, _ = tiny
    seeded = [SamplingParams(temperature=0.3, top_k=3, top_p=0.95, seed=11 + i, max_tokens=24, ignore_eos=True)
              for i in range(len(prompts))]
    expected = token_ids(make_llm(model_dir, spec=False).generate(prompts, seeded))
    llm = make_llm(model_dir, spec=True)
    alone = [token_ids(llm.generate([prompt], params))[0] for prompt, params in zip(prompts, seeded)]
    assert alone == expected
    assert accepted(llm) > 0, "the seeded requests were meant to keep drafts"
    # Together, in reverse order, beside an unseeded request and a greedy one.
    extra = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True), greedy(8)]
    together = token_ids(llm.generate(prompts[::-1] + prompts[:2], seeded[::-1] + extra))
    assert together[:len(prompts)] == expected[::-1]


# ---- with --async-scheduling ---------------------------------------------------------------------------------------
def record_submitted(llm: LLM) -> list:
    """Every batch the engine submits from now on (async scheduling submits through either call)."""
    executor = llm.llm_engine.engine_core.executor
    submitted: list = []
    submit_model, submit_forward = executor.submit_model, executor.submit_forward

    def recording_submit_model(output, bitmask=None):
        submitted.append(output)
        return submit_model(output, bitmask)

    def recording_submit_forward(output):
        submitted.append(output)
        return submit_forward(output)

    executor.submit_model, executor.submit_forward = recording_submit_model, recording_submit_forward
    return submitted


@pytest.fixture(scope="module")
def mixed_batch(tiny, prompts, make_token_prompts):
    """Repeating prompts (drafting) beside random ones (little to draft), greedy (one with n = 2), seeded sampling
    and a grammar, with the tokens of the engine without speculation and without async scheduling."""
    from pagellm.sampling_params import StructuredOutputsParams

    mixed = prompts + make_token_prompts([6, 19, 33], seed=5) + prompts[:2]
    params = [greedy(32), greedy(32, n=2), greedy(32), greedy(32), greedy(32), greedy(24), greedy(32),
              SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=32, ignore_eos=True),
              greedy(16, structured_outputs=StructuredOutputsParams(regex=r"[a-z]{3,12}"))]
    return mixed, params, token_ids(make_llm(tiny[0], spec=False).generate(mixed, params))


@pytest.mark.parametrize("spec", [SPEC, {"method": "suffix", "num_speculative_tokens": 4}], ids=["ngram", "suffix"])
def test_async_scheduling_gives_the_plain_engine_s_tokens(tiny, mixed_batch, no_leaks, spec):
    """The plain engine's tokens (it equals transformers: tests/entrypoints/test_llm_async_scheduling.py), greedy
    ones checked against transformers here too. Drafting requests verify drafts while others decode blind, and the
    counters match the drafts verified."""
    model_dir, hf = tiny
    mixed, params, expected = mixed_batch
    llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=16, kv_cache_memory_bytes=8 << 20,
              speculative_config=dict(spec), async_scheduling=True)
    submitted = record_submitted(llm)
    outputs = llm.generate(mixed, params)
    assert token_ids(outputs) == expected
    for prompt, output, p in zip(mixed[:4], outputs, params):
        assert list(output.outputs[0].token_ids) == hf_greedy(hf, prompt["prompt_token_ids"], p.max_tokens)
    verified = [s for output in submitted for s in output.scheduled if s.spec_token_ids]
    assert verified and any(s.pending_token for output in submitted for s in output.scheduled)
    assert all(not s.pending_token for s in verified), "a draft is verified only after the batch before is back"
    stats = llm.llm_engine.engine_core.scheduler.spec_decoding_stats
    assert stats.num_drafts == len(verified) and stats.num_accepted_tokens > 0
    assert stats.num_draft_tokens == sum(len(s.spec_token_ids) for s in verified)
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens
    no_leaks(llm)
