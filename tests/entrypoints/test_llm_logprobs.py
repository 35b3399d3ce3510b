"""Logprobs, prompt logprobs and the logits-processing SamplingParams end to end on a tiny random-weight Llama.

The logprob reference is log_softmax of transformers' logits on the same checkpoint (one unbatched forward over
prompt + generated tokens); the other parameters are checked by what they must (or must not) produce.
"""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, Logprob, SamplingParams

MAX_MODEL_LEN = 128
BIG_KV = 4 << 20
PROMPT_LENS = [1, 5, 19, 40]
TOL = 1e-3



@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=BIG_KV)


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    return make_token_prompts(PROMPT_LENS, seed=7)


def hf_logprobs(hf_model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), V]: log_softmax of the logits at every position (position i predicts token i + 1)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([token_ids])).logits[0].float()
    return logits.log_softmax(dim=-1)


def check_entry(entry: dict[int, Logprob], reference: torch.Tensor, token: int, k: int, tokenizer) -> None:
    """The actual token (its logprob and rank) plus the top-k (ranks 1..k, descending, equal to the reference)."""
    assert token in entry
    assert len(entry) in (k, k + 1)
    value = reference[token]
    assert entry[token].logprob == pytest.approx(value.item(), abs=TOL)
    # Rank = 1 + the number of more likely tokens; float near-ties may go either way.
    assert int((reference > value + TOL).sum()) + 1 <= entry[token].rank <= int((reference > value - TOL).sum()) + 1
    top = sorted((lp.rank, lp.logprob) for t, lp in entry.items() if not (t == token and len(entry) == k + 1))
    assert [r for r, _ in top] == list(range(1, k + 1))
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(reference.topk(k).values.tolist(), abs=TOL) if k else values == []
    for t, lp in entry.items():
        assert lp.logprob == pytest.approx(reference[t].item(), abs=TOL)
        assert lp.decoded_token == tokenizer.decode([t])


@pytest.mark.parametrize("engine", ["plain", "chunked", "preempting"])
def test_logprobs_match_transformers(engine, model_dir, llm, hf_model, prompts, no_leaks, pool_bytes):
    if engine == "plain":
        engine_llm = llm
    elif engine == "chunked":
        engine_llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=BIG_KV,
                         max_num_batched_tokens=8)
    else:
        block_size, num_blocks = 4, MAX_MODEL_LEN // 4 + 2
        engine_llm = LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, block_size=block_size,
                         kv_cache_memory_bytes=pool_bytes(model_dir, block_size, num_blocks),
                         max_num_batched_tokens=16)
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.9, seed=11, max_tokens=40, ignore_eos=True, logprobs=0,
                             prompt_logprobs=0),
              SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=5),
              SamplingParams(temperature=1.0, top_k=5, seed=3, max_tokens=40, ignore_eos=True, logprobs=1,
                             prompt_logprobs=4)]
    outputs = engine_llm.generate(prompts, params, use_tqdm=False)
    no_leaks(engine_llm)
    tokenizer = engine_llm.get_tokenizer()
    for prompt, p, out in zip(prompts, params, outputs):
        prompt_ids = prompt["prompt_token_ids"]
        completion = out.outputs[0]
        reference = hf_logprobs(hf_model, prompt_ids + completion.token_ids)
        assert len(completion.logprobs) == len(completion.token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
            check_entry(entry, reference[len(prompt_ids) - 1 + i], token, p.logprobs, tokenizer)
            total += entry[token].logprob
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-4)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
            continue
        assert len(out.prompt_logprobs) == len(prompt_ids)
        assert out.prompt_logprobs[0] is None
        for i in range(1, len(prompt_ids)):
            check_entry(out.prompt_logprobs[i], reference[i - 1], prompt_ids[i], p.prompt_logprobs, tokenizer)
    if engine == "preempting":
        assert engine_llm.llm_engine.engine_core.scheduler.num_preemptions_total > 0


def test_no_logprobs_by_default(llm, prompts):
    out = llm.generate(prompts[1], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_min_tokens_prevents_early_stop(llm, prompts):
    base = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    greedy = llm.generate(prompts, base, use_tqdm=False)
    # A stop token greedy decoding hits early: the second generated token of the longest prompt.
    tokens = greedy[3].outputs[0].token_ids
    stop = tokens[1]
    early = llm.generate(prompts[3], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop]),
                         use_tqdm=False)[0].outputs[0]
    assert len(early.token_ids) <= 2 and early.token_ids[-1] == stop
    for min_tokens in (5, 30):
        out = llm.generate(prompts[3], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop],
                                                      min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) >= min_tokens
        assert stop not in out.token_ids[:min_tokens]
        if out.finish_reason == "stop":
            assert out.token_ids[-1] == stop and len(out.token_ids) > min_tokens
    # EOS too (ignore_eos False): with logit_bias forcing EOS, min_tokens still holds it back.
    eos = 2
    out = llm.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4,
                                                  logit_bias={eos: 100}), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 5 and out.token_ids[-1] == eos and eos not in out.token_ids[:4]


def test_logit_bias_forces_token(llm, prompts):
    forced = 1234
    for params in (SamplingParams(temperature=0.0, max_tokens=6, logit_bias={forced: 100.0}),
                   SamplingParams(temperature=1.0, seed=0, max_tokens=6, logit_bias={str(forced): 1000})):
        for out in llm.generate(prompts, params, use_tqdm=False):
            assert out.outputs[0].token_ids == [forced] * 6
    # A strong negative bias removes the greedy choice.
    greedy = llm.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    first = greedy.outputs[0].token_ids[0]
    out = llm.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=1, logit_bias={first: -100}),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids[0] != first


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_bad_words_never_appear(llm, prompts):
    tokenizer = llm.get_tokenizer()
    base = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, base, use_tqdm=False)]
    # Words the model would produce: a single-token word and a two-token word from its own output.
    def is_word(t: int) -> bool:
        # A word that is one token both with and without a leading space (as vLLM, the spaced variant is only
        # banned when it has as many tokens as the plain one).
        word = tokenizer.decode([t]).strip()
        plain, spaced = (tokenizer.encode(w, add_special_tokens=False) for w in (word, " " + word))
        return bool(word) and len(plain) == len(spaced) == 1 and t in plain + spaced

    single_id = next(t for out in greedy for t in out if is_word(t))
    single = tokenizer.decode([single_id]).strip()
    double = "".join(tokenizer.decode([t]) for t in greedy[2][3:5])
    for words in ([single], [double], [single, double]):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, bad_words=words)
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        banned = llm.llm_engine.input_processor.tokenize_bad_words(words)
        assert banned
        for out in outputs:
            for ids in banned:
                assert not contains(out, ids), (words, ids, out)
        if single in words:
            assert [single_id] in banned
            assert all(single_id not in out for out in outputs)
            assert outputs != greedy
    # Sampled rows too.
    params = SamplingParams(temperature=1.5, seed=5, max_tokens=30, ignore_eos=True, bad_words=[single])
    for out in llm.generate(prompts, params, use_tqdm=False):
        for ids in llm.llm_engine.input_processor.tokenize_bad_words([single]):
            assert not contains(out.outputs[0].token_ids, ids)


def test_truncate_prompt_tokens(llm, prompts):
    prompt = prompts[3]["prompt_token_ids"]
    for k in (1, 7, len(prompt), len(prompt) + 5):
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, truncate_prompt_tokens=k)
        truncated = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        reference = llm.generate({"prompt_token_ids": prompt[-k:]},
                                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
        assert truncated.prompt_token_ids == prompt[-k:]
        assert truncated.outputs[0].token_ids == reference.outputs[0].token_ids
    text = llm.generate("Hello there, my good friend", SamplingParams(truncate_prompt_tokens=2, max_tokens=2),
                        use_tqdm=False)[0]
    assert len(text.prompt_token_ids) == 2


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(bad_words=[""]), "bad_words"),
])
def test_invalid_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_invalid_logit_bias_token(llm, prompts, no_leaks):
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(prompts[1], SamplingParams(logit_bias={10**6: 1.0}), use_tqdm=False)
    no_leaks(llm)


def test_logit_bias_clamped():
    assert SamplingParams(logit_bias={3: 500, 4: -500.0}).logit_bias == {3: 100.0, 4: -100.0}
