"""Stop strings end to end on a tiny random-weight Llama (greedy): the reference is an earlier run of the same
prompts without stop strings, cut by hand at the chosen stop string."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams

MAX_MODEL_LEN = 128
KV_BYTES = 2 << 20
MAX_TOKENS = 24
TEXTS = ["Hello, my name is", "The capital of France is", "a", "Once upon a time"]


def greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def baseline(llm):
    """Token ids and text of each prompt without stop strings."""
    outputs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]


def pick_stop(tokenizer, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character stop string straddling a token boundary in the middle of the text, and the number of tokens
    after which its first occurrence is complete."""
    for k in range(len(token_ids) // 2, len(token_ids) - 2):
        boundary = len(tokenizer.decode(token_ids[:k]))
        stop = text[boundary - 2:boundary + 2]
        if len(stop) == 4 and "\ufffd" not in text[:boundary + 2] and stop.strip():
            complete = next(n for n in range(1, len(token_ids) + 1) if stop in tokenizer.decode(token_ids[:n]))
            if complete < len(token_ids):
                return stop, complete
    pytest.skip("no clean token boundary in this random output")


def test_stop_string_cuts_text_and_frees_blocks(llm, baseline, no_leaks):
    tokenizer = llm.get_tokenizer()
    stops = [pick_stop(tokenizer, ids, text) for ids, text in baseline]
    params = [greedy(stop=[stop, "\x00never"]) for stop, _ in stops]
    params[-1] = greedy()  # one request without stop strings runs on to max_tokens in the same batch
    outputs = llm.generate(TEXTS, params, use_tqdm=False)
    for (ids, text), (stop, complete), output in list(zip(baseline, stops, outputs))[:-1]:
        completion = output.outputs[0]
        assert completion.text == text[:text.index(stop)]
        assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
        assert completion.token_ids == ids[:complete]  # generation ended on the token completing the stop
        assert len(completion.token_ids) < MAX_TOKENS
    last = outputs[-1].outputs[0]
    assert (last.token_ids, last.text, last.finish_reason) == (baseline[-1][0], baseline[-1][1], "length")
    no_leaks(llm)


def test_include_stop_str_in_output(llm, baseline, no_leaks):
    ids, text = baseline[0]
    stop, _ = pick_stop(llm.get_tokenizer(), ids, text)
    completion = llm.generate(TEXTS[0], greedy(stop=stop, include_stop_str_in_output=True),
                              use_tqdm=False)[0].outputs[0]
    assert completion.text == text[:text.index(stop) + len(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    no_leaks(llm)


def test_streaming_deltas_and_immediate_block_release(llm, baseline):
    ids, text = baseline[1]
    stop, complete = pick_stop(llm.get_tokenizer(), ids, text)
    engine = llm.llm_engine
    engine.add_request("stream", TEXTS[1], greedy(stop=[stop, "zzzzzzzz"]))  # 7 chars held back while running
    streamed, steps = "", 0
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_outputs(delta=True)
        for output in outputs:
            streamed += output.outputs[0].text
            assert text.startswith(streamed)  # nothing shown is ever taken back
            if output.finished:
                # Finished by the stop string in this very step: the core no longer holds it or its blocks.
                pool = engine.engine_core.kv_cache_manager.block_pool
                assert pool.num_free_blocks == pool.num_blocks
                assert output.outputs[0].stop_reason == stop
        steps += 1
    assert streamed == text[:text.index(stop)]
    assert not engine.output_processor.has_unfinished_requests()


def test_detokenize_false_gives_tokens_only(llm, baseline, no_leaks):
    completion = llm.generate(TEXTS[0], greedy(detokenize=False), use_tqdm=False)[0].outputs[0]
    assert completion.text == ""
    assert completion.token_ids == baseline[0][0]
    no_leaks(llm)


def test_text_equals_full_decode(llm, baseline):
    tokenizer = llm.get_tokenizer()
    for ids, text in baseline:
        assert text == tokenizer.decode(ids, skip_special_tokens=True)
