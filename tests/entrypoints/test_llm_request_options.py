"""The offline API's per-request options of issue 10: `LLM.generate(..., priority=[...])` and a prompt dict's
`cache_salt` reach the engine's requests or are refused with a clear error (and nothing stays queued), and
`RequestOutput.num_cached_tokens` reports prefix-cache hits: a repeated prompt finds its full blocks (all but the
last token's, which must be recomputed), another cache_salt finds none, and greedy output does not change."""
from __future__ import annotations

import pytest

from pagellm import LLM, SamplingParams
from pagellm.exceptions import InvalidRequestError

MAX_MODEL_LEN = 128
KV_BYTES = 2 << 20
LONG_PROMPT_LEN = 40  # two full 16-token blocks and a partial one
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)



@pytest.fixture(scope="module")
def llm(model_dir):
    """The defaults: FCFS, prefix caching on."""
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def priority_llm(model_dir):
    """Priority scheduling, prefix caching off."""
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES,
               scheduling_policy="priority", enable_prefix_caching=False)


@pytest.fixture
def added_requests(monkeypatch):
    """Call with an LLM: every Request its engine core queues from then on is appended to the returned list."""

    def spy(llm: LLM) -> list:
        core = llm.llm_engine.engine_core
        add_request, requests = core.add_request, []

        def recording_add_request(request, *args):
            requests.append(request)
            add_request(request, *args)

        monkeypatch.setattr(core, "add_request", recording_add_request)
        return requests

    return spy


def full_block_tokens(llm: LLM, num_prompt_tokens: int) -> int:
    """The prompt tokens a full prefix-cache hit supplies: whole blocks, never the last token (its logits are
    needed)."""
    block_size = llm.llm_engine.config.cache_config.block_size
    return (num_prompt_tokens - 1) // block_size * block_size


# ---------------------------------------------------------------------------------------------------- priority
@pytest.mark.parametrize("priority", [[0], [0, 0, 0], 0])
def test_priority_must_be_one_int_per_prompt(llm, priority):
    with pytest.raises(InvalidRequestError, match="^priority must be a list of one int per prompt, i.e. 2 ints"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=priority)


def test_nonzero_priority_is_refused_under_fcfs_and_queues_nothing(llm, no_leaks):
    with pytest.raises(InvalidRequestError, match="--scheduling-policy priority"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 1])
    no_leaks(llm)
    assert len(llm.generate(["a", "b"], GREEDY, use_tqdm=False, priority=[0, 0])) == 2


def test_priorities_reach_the_requests(priority_llm, added_requests, no_leaks):
    texts = ["The capital of France is", "Hello", "1, 2, 3,"]
    alone = [priority_llm.generate(text, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for text in texts]
    requests = added_requests(priority_llm)
    outputs = priority_llm.generate(texts, GREEDY, use_tqdm=False, priority=[2, -1, 0])
    assert [r.priority for r in requests] == [2, -1, 0]
    assert [o.outputs[0].token_ids for o in outputs] == alone  # in input order, whatever ran first
    no_leaks(priority_llm)


# -------------------------------------------------------------------------------------------------- cache_salt
def test_cache_salt_reaches_the_requests(llm, added_requests, make_token_prompts):
    token_prompt = make_token_prompts([5], seed=1)[0]
    requests = added_requests(llm)
    llm.generate([{"prompt": "Hello", "cache_salt": "a"}, {**token_prompt, "cache_salt": "b"}, "Hello"], GREEDY,
                 use_tqdm=False)
    assert [r.cache_salt for r in requests] == ["a", "b", None]


def test_cache_salt_is_refused_without_prefix_caching(priority_llm, no_leaks):
    with pytest.raises(InvalidRequestError, match="^cache_salt needs prefix caching"):
        priority_llm.generate(["a", {"prompt": "b", "cache_salt": "s"}], GREEDY, use_tqdm=False)
    no_leaks(priority_llm)


# ------------------------------------------------------------------------------ prefix-cache hits (needs the core)
def test_a_repeated_prompt_reports_its_cached_tokens(llm, make_token_prompts, no_leaks):
    prompt = make_token_prompts([LONG_PROMPT_LEN], seed=2)[0]
    first = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    second = llm.generate(prompt, GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == full_block_tokens(llm, LONG_PROMPT_LEN) > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    no_leaks(llm)


def test_cache_salt_separates_cached_prefixes(llm, make_token_prompts):
    prompt = make_token_prompts([LONG_PROMPT_LEN], seed=3)[0]

    def num_cached(**salt) -> int:
        return llm.generate({**prompt, **salt}, GREEDY, use_tqdm=False)[0].num_cached_tokens

    assert num_cached(cache_salt="a") == 0
    assert num_cached(cache_salt="b") == 0
    assert num_cached() == 0
    assert num_cached(cache_salt="a") == full_block_tokens(llm, LONG_PROMPT_LEN)


def test_nothing_is_cached_with_prefix_caching_off(priority_llm, make_token_prompts):
    prompt = make_token_prompts([LONG_PROMPT_LEN], seed=4)[0]
    assert [priority_llm.generate(prompt, GREEDY, use_tqdm=False)[0].num_cached_tokens for _ in range(2)] == [0, 0]
