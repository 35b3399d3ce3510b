"""The thinking budget's forced token (model_executor/layers/logits_processors.py) against a reference that replays
the tokens one at a time, and the sampler taking forced tokens in greedy and sampled rows alike."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.model_executor.layers.logits_processors import thinking_budget_token
from pagellm.model_executor.layers.sampler import Sampler, SamplingTensors

S, E = 7, 8  # single-token tags, as Qwen3's <think> and </think>


def replayed(prompt: list[int], output: list[int], budget: int) -> int | None:
    """Walk the tokens in order: a start tag outside reasoning opens it (counting from zero), an end tag closes it,
    any other token inside counts (a start tag too)."""
    tags = [t for t in prompt if t in (S, E)]
    inside, count = bool(tags) and tags[-1] == S, 0
    for token in output:
        if token == E:
            inside = False
        elif inside:
            count += 1
        elif token == S:
            inside, count = True, 0
    return E if inside and count >= budget else None


tokens = st.lists(st.sampled_from([1, 2, 3, S, E]), max_size=10)


@settings(max_examples=500, deadline=None)
@given(prompt=tokens, output=tokens, budget=st.integers(0, 6))
def test_single_token_tags_match_the_replay(prompt, output, budget):
    assert thinking_budget_token(prompt, output, [S], [E], budget) == replayed(prompt, output, budget)


def test_a_multi_token_end_tag_is_forced_one_token_per_step():
    start, end = [5, 6], [3, 4, 9]  # tags spelled over several tokens
    prompt = [1, 5, 6]  # the prompt opens reasoning
    output: list[int] = []
    while (token := thinking_budget_token(prompt, output, start, end, 2)) is not None or len(output) < 2:
        output.append(1 if token is None else token)
    assert output == [1, 1, 3, 4, 9]  # two reasoning tokens, then the whole end tag
    assert thinking_budget_token(prompt, output + [1] * 5, start, end, 2) is None  # content is never forced
    # No budget is spent before the output opens reasoning itself when the prompt did not.
    assert thinking_budget_token([1], [1, 1, 1], start, end, 0) is None
    assert thinking_budget_token([1], [1, 5, 6], start, end, 0) == 3


def test_the_sampler_takes_forced_tokens_in_greedy_and_sampled_rows():
    vocab = 32
    logits = torch.randn(3, vocab)
    logits[:, 5] = -50.0  # the forced token is the least likely one
    tensors = SamplingTensors(
        temperature=torch.tensor([0.0, 1.0, 1.0]), top_p=torch.tensor([1.0, 0.5, 1.0]),
        top_k=torch.tensor([vocab, 2, vocab]), all_greedy=False, needs_top_k=True, needs_top_p=True, generators={},
        num_logprobs=[0, None, None], forced_tokens=(torch.tensor([0, 1]), torch.tensor([5, 5])))
    output = Sampler()(logits, tensors)
    assert output.sampled[:2].tolist() == [5, 5]
    assert output.sampled[2].item() != 5
    # Logprobs stay the model's own (raw) ones: the forced token's is its log-softmax before forcing.
    assert abs(output.logprobs[0][1][0] - logits[0].log_softmax(-1)[5].item()) < 1e-5


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_forces_the_end_tag_after_the_budget(qwen3_thinking_dir, async_scheduling):
    """Offline, with a prompt that opens reasoning: the first `budget` tokens are transformers' greedy ones, then
    </think>, then greedy again; n = 2 sequences alike. A request without a budget is not forced."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagellm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(str(qwen3_thinking_dir))
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_thinking_dir), dtype=torch.float32).eval()
    prompt = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"
    end = tokenizer.convert_tokens_to_ids("</think>")
    ids, expected = tokenizer.encode(prompt), []
    with torch.no_grad():
        for position in range(6):
            token = end if position == 2 else int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            expected.append(token)
    llm = LLM(model=str(qwen3_thinking_dir), reasoning_parser="qwen3", async_scheduling=async_scheduling,
              kv_cache_memory_bytes=4 << 20, max_model_len=256)
    budgeted, free = llm.generate([prompt, prompt], [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, thinking_token_budget=2, n=2),
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)], use_tqdm=False)
    assert [list(o.token_ids) for o in budgeted.outputs] == [expected, expected]
    # Unforced, the model would not have closed reasoning there: the budget made the difference.
    assert list(free.outputs[0].token_ids[:2]) == expected[:2] and free.outputs[0].token_ids[2] != end
