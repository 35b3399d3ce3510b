"""Suffix decoding (`suffix`): drafts checked against a brute-force reference written here from the rule (every
match length, occurrences counted by scanning lists, the greedy frequency walk, the best score), the cache's bound,
the draft length's cap by match length, and end to end on a tiny model: greedy output identical to transformers'
with drafts accepted, and the finished outputs cached."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import SpeculativeConfig
from pagellm.core.request import RequestStatus
from pagellm.spec_decode import adaptive, suffix_proposer
from pagellm.spec_decode.suffix_proposer import SuffixProposer


@dataclass(eq=False)
class FakeRequest:
    all_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished


def proposer(k=4, depth=24, factor=1.0, min_prob=0.1, cached=10) -> SuffixProposer:
    return SuffixProposer(SpeculativeConfig(
        method="suffix", num_speculative_tokens=k, suffix_decoding_max_tree_depth=depth,
        suffix_decoding_max_spec_factor=factor, suffix_decoding_min_token_prob=min_prob,
        suffix_decoding_max_cached_requests=cached))


def followers(sequences: list[list[int]], context: list[int]) -> list[tuple[int, tuple[int, int]]]:
    """(next token, where it is) for every occurrence of `context` followed by a token, by plain scanning."""
    n = len(context)
    return [(seq[i], (s, i)) for s, seq in enumerate(sequences) for i in range(n, len(seq)) if seq[i - n:i] == context]


def reference_walk(sequences, context, cap, min_prob) -> tuple[list[int], list[float]]:
    tokens, probs, prob = [], [], 1.0
    while len(tokens) < cap:
        found = followers(sequences, context + tokens)
        if not found:
            break
        counts: dict[int, int] = {}
        latest: dict[int, tuple[int, int]] = {}
        for token, where in found:
            counts[token] = counts.get(token, 0) + 1
            latest[token] = max(latest.get(token, where), where)
        token = max(counts, key=lambda t: (counts[t], latest[t]))
        prob *= counts[token] / len(found)
        if prob < min_prob:
            break
        tokens.append(token)
        probs.append(prob)
    return tokens, probs


def reference(sequences, sequence, k, depth, factor, min_prob, shortest) -> tuple[list[int], list[float], int]:
    """The best-scoring draft over every match length from `shortest` to `depth` (ties: the longer match)."""
    best: tuple[list[int], list[float], int] = ([], [], 0)
    for n in range(shortest, min(depth, len(sequence)) + 1):
        tokens, probs = reference_walk(sequences, sequence[-n:], min(k, int(n * factor + 1e-6)), min_prob)
        if tokens and sum(probs) >= sum(best[1]):
            best = (tokens, probs, n)
    return best


def expected_draft(sequence, cache, k, depth, factor, min_prob):
    own = reference([sequence], sequence, k, depth, factor, min_prob, 1)
    cached = reference(cache, sequence, k, depth, factor, min_prob, 2)
    return cached if sum(cached[1]) > sum(own[1]) else own


def test_the_most_frequent_continuation_of_the_longest_useful_match():
    # After [1, 2] (the longest suffix seen before) come 3 three times and 4 once; after [1, 2, 3], 5 twice and 7
    # once; after [1, 2, 3, 5] always 6.
    sequence = [1, 2, 3, 5, 6, 1, 2, 4, 9, 1, 2, 3, 7, 8, 1, 2, 3, 5, 6, 0, 1, 2]
    draft = proposer(k=3, factor=2.0).draft(FakeRequest(sequence))
    assert draft.token_ids == [3, 5, 6] and draft.match_len == 2
    assert draft.probs == pytest.approx([3 / 4, 3 / 4 * 2 / 3, 3 / 4 * 2 / 3])
    # A higher floor stops the draft where the estimated probability falls under it.
    assert proposer(k=3, factor=2.0, min_prob=0.6).draft(FakeRequest(sequence)).token_ids == [3]


@pytest.mark.parametrize("pairs", [(2, 3), (3, 2)])
def test_a_tie_goes_to_the_token_seen_last(pairs):
    # 1 is followed 40 times by each of two tokens (more than the proposer counts in Python): the later block wins.
    first, last = pairs
    sequence = [1, first] * 40 + [1, last] * 40 + [4, 1]
    draft = proposer(k=1, min_prob=0.5).draft(FakeRequest(sequence))
    assert (draft.token_ids, draft.probs, draft.match_len) == ([last], [0.5], 1)


def test_a_match_of_n_tokens_drafts_at_most_factor_times_n():
    sequence = [4, 5, 6, 7, 8, 9, 1, 2, 3, 0, 4, 5]  # the longest match is [4, 5]: two tokens
    assert proposer(k=8).draft(FakeRequest(sequence)).token_ids == [6, 7]
    assert proposer(k=8, factor=2.0).draft(FakeRequest(sequence)).token_ids == [6, 7, 8, 9]
    assert proposer(k=8, factor=0.5).draft(FakeRequest(sequence)).token_ids == [6]
    assert proposer(k=3, factor=2.0).draft(FakeRequest(sequence), max_tokens=2).token_ids == [6, 7]


@pytest.mark.parametrize("seed, trials, longest, deepest", [(seed, 60, 40, 10) for seed in range(6)]
                         + [(6, 30, 400, 3)])
def test_drafts_match_the_brute_force_reference(seed, trials, longest, deepest):
    """Short sequences, and long ones matched shallowly, whose matches recur more than 64 times (the proposer's
    NumPy path)."""
    rng = random.Random(seed)
    for _ in range(trials):
        vocab = rng.randint(2, 6)
        k, depth = rng.randint(1, 8), rng.randint(1, deepest)
        factor, min_prob = rng.choice([0.5, 1.0, 1.5, 3.0]), rng.choice([0.0, 0.1, 0.3, 0.6])
        p = proposer(k=k, depth=depth, factor=factor, min_prob=min_prob, cached=3)
        cache = []
        for _ in range(rng.randint(0, 5)):  # finished requests: the last three outputs stay cached
            output = [rng.randrange(vocab) for _ in range(rng.randint(1, longest // 2))]
            p.cache.add(output)
            cache = (cache + [output])[-3:]
        sequence = [rng.randrange(vocab) for _ in range(rng.randint(1, longest))]
        request = FakeRequest(sequence[:len(sequence) // 2])
        p.draft(request)  # then the rest arrives: the request's array grows
        request.all_token_ids = sequence
        draft = p.draft(request)
        tokens, probs, match_len = expected_draft(sequence, cache, k, depth, factor, min_prob)
        assert (draft.token_ids, draft.match_len) == (tokens, match_len), (sequence, cache)
        assert draft.probs == pytest.approx(probs)


def test_finished_outputs_are_cached_up_to_the_bound_oldest_first():
    p = proposer(k=4, cached=2)
    requests = [FakeRequest([9, 9], output_token_ids=[10 * i + j for j in range(5)]) for i in range(1, 4)]
    for request in requests:
        p.draft(request)
    p.step_planned()
    assert p.cache.outputs == []  # still running
    for request in requests:
        request.status = RequestStatus.FINISHED_STOPPED
        p.step_planned()
    assert p.cache.outputs == [[20, 21, 22, 23, 24], [30, 31, 32, 33, 34]]
    assert p.sequences == {}
    # A new request ending in a cached pair continues it; the evicted output's pair finds nothing.
    assert p.draft(FakeRequest([5, 31, 32])).token_ids == [33, 34]
    assert p.draft(FakeRequest([5, 11, 12])).token_ids == []
    # Many more: the array is compacted, the index follows it.
    for i in range(200):
        p.cache.add([1000 + i, 2000 + i, 3000 + i])
    assert p.cache.outputs == [[1198, 2198, 3198], [1199, 2199, 3199]]
    assert p.cache.size < 64
    assert p.draft(FakeRequest([1199, 2199])).token_ids == [3199]
    assert p.draft(FakeRequest([1100, 2100])).token_ids == []
    none = proposer(cached=0)
    none.cache.add([1, 2, 3])
    assert none.cache.outputs == [] and none.draft(FakeRequest([1, 2])).token_ids == []


def test_the_cache_counts_a_pairs_latest_occurrences(monkeypatch):
    monkeypatch.setattr(suffix_proposer, "CACHE_OCCURRENCES", 2)
    p = proposer(k=1, factor=1.0, min_prob=0.0)
    for follower in (7, 7, 8, 8, 9):  # (1, 2) followed by 7 twice, then 8 twice, then 9
        p.cache.add([1, 2, follower])
    draft = p.draft(FakeRequest([5, 1, 2]))
    assert (draft.token_ids, draft.probs) == ([9], [0.5])  # the last two: 8 and 9, the tie to the later


@pytest.mark.parametrize("field_name, value", [("suffix_decoding_max_tree_depth", 0),
                                               ("suffix_decoding_max_spec_factor", 0.0),
                                               ("suffix_decoding_min_token_prob", 1.5),
                                               ("suffix_decoding_max_cached_requests", -1)])
def test_bad_settings_name_the_field(field_name, value):
    with pytest.raises(ValueError, match=field_name):
        SpeculativeConfig.from_dict({"method": "suffix", field_name: value})


# ---------------------------------------------------------------- end to end

@pytest.fixture
def fixed_draft_length(monkeypatch):
    """Every match drafts k tokens (the adaptive length follows this host's step times: see test_llm_spec_decode)."""
    monkeypatch.setattr(adaptive, "best_length", lambda rate, max_k, *_: max_k)


def test_greedy_output_is_transformers_and_drafts_are_accepted(tiny_model_factory, make_token_prompts,
                                                               fixed_draft_length):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    phrases = make_token_prompts([7, 11, 5, 13], seed=31)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"] * 4 + p["prompt_token_ids"][:3]} for p in phrases]
    llm = LLM(model=str(model_dir), max_model_len=256, block_size=16, kv_cache_memory_bytes=8 << 20,
              speculative_config={"method": "suffix", "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, output in zip(prompts, outputs):
        ids = prompt["prompt_token_ids"]
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False,
                                   pad_token_id=0)[0, len(ids):].tolist()
        assert list(output.outputs[0].token_ids) == expected
    scheduler = llm.llm_engine.engine_core.scheduler
    assert scheduler.spec_decoding_stats.num_accepted_tokens > 0
    scheduler.check_consistency()
    # The next step retires the finished requests: their outputs are the cache's.
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    cached = scheduler.planner.drafter.proposer.cache.outputs
    assert sorted(cached[:4]) == sorted(list(o.outputs[0].token_ids) for o in outputs)
