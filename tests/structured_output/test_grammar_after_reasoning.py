"""Structured outputs after reasoning (vLLM's way): with a reasoning parser the grammar neither masks nor advances
while reasoning is open, and starts with the token after the end tag; a prompt that closed reasoning is constrained
from its first token. Run on the tiny random Qwen3 with Qwen3's `<think>` / `</think>` tokens, scripted by the
thinking budget (which forces `</think>`) or a logit_bias on `</think>`. Checked independently: the reasoning
tokens are transformers' greedy tokens on the same weights (nothing masked them), every token after the end tag is
allowed at its position by an llguidance matcher this test builds on the schema itself, and a finished output
validates with jsonschema."""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

VOCAB = 49154
EOS = 2
USER = "<|im_start|>user\nGive me a JSON object.<|im_end|>\n<|im_start|>assistant\n"
OPENED = USER + "<think>\n"  # the template opened reasoning
CLOSED = USER + "<think>\n\n</think>\n\n"  # thinking turned off: the template closed it empty
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}
# Compact JSON: free whitespace would let a weak model emit it forever (the reference grammar below allows it).
JSON = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)


@pytest.fixture(scope="module")
def hf(qwen3_thinking_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_thinking_dir), dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(str(qwen3_thinking_dir)), model


@pytest.fixture(scope="module")
def end(hf) -> int:
    return hf[0].convert_tokens_to_ids("</think>")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async-scheduling"])
def llm(qwen3_thinking_dir, request):
    """Both step loops: with async scheduling a blind decode's grammar may start with the token in flight."""
    return LLM(model=str(qwen3_thinking_dir), reasoning_parser="qwen3", async_scheduling=request.param,
               kv_cache_memory_bytes=8 << 20, max_model_len=256)


@pytest.fixture(scope="module")
def reference_tokenizer(hf):
    return llguidance.hf.from_tokenizer(hf[0], n_vocab=VOCAB, eos_token=EOS)


def greedy(hf, prompt: str, num_tokens: int) -> list[int]:
    tokenizer, model = hf
    ids, output = tokenizer.encode(prompt), []
    with torch.no_grad():
        for _ in range(num_tokens):
            output.append(int(model(torch.tensor([ids + output])).logits[0, -1].argmax()))
    return output


def check_after(reference_tokenizer, grammar: str, tokens: list[int]) -> None:
    """Every token is allowed at its position by an independent matcher of `grammar`, EOS ending it."""
    matcher = llguidance.LLMatcher(reference_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    for step, token in enumerate(tokens):
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        assert (int(mask[token // 32]) >> (token % 32)) & 1, (step, token, tokens)
        if token == EOS:
            return
        assert matcher.consume_token(token), matcher.get_error()


def content_after(tokens: list[int], end: int) -> list[int]:
    return tokens[tokens.index(end) + 1:]


def valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_reasoning_is_free_and_the_content_holds_the_schema(llm, hf, end, reference_tokenizer):
    """The budget closes reasoning after 3 tokens: those are the model's own greedy tokens, then the grammar."""
    params = SamplingParams(temperature=0, max_tokens=48, thinking_token_budget=3,
                            structured_outputs=JSON)
    output = llm.generate([OPENED], params, use_tqdm=False)[0].outputs[0]
    tokens = list(output.token_ids)
    assert tokens[:4] == greedy(hf, OPENED, 3) + [end]
    # Unconstrained, the schema's grammar allows none of them (its first token opens the object).
    check_after(reference_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), tokens[4:])
    assert output.finish_reason == "stop", output.text
    reasoning, _, content = output.text.partition("</think>")
    assert reasoning == hf[0].decode(tokens[:3])
    assert valid(content), content


def test_a_biased_end_tag_closes_reasoning_and_cannot_break_the_mask(llm, end, reference_tokenizer):
    """A +100 bias on </think> makes it the first token; after it the mask removes it every step."""
    pattern = "[a-z]{2,6}"
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=16, logit_bias={end: 100},
                            structured_outputs=StructuredOutputsParams(regex=pattern))
    for output in llm.generate([OPENED], params, use_tqdm=False)[0].outputs:
        tokens = list(output.token_ids)
        assert tokens[0] == end and end not in tokens[1:]
        check_after(reference_tokenizer, llguidance.LLMatcher.grammar_from_regex(pattern), tokens[1:])
        assert output.finish_reason == "stop" and re.fullmatch(pattern, output.text.partition("</think>")[2])


def test_a_prompt_that_closed_reasoning_is_constrained_from_the_first_token(llm, reference_tokenizer):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=48,
                            structured_outputs=JSON)
    output = llm.generate([CLOSED], params, use_tqdm=False)[0].outputs[0]
    check_after(reference_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA), list(output.token_ids))
    assert output.finish_reason == "stop" and valid(output.text), output.text


def test_reasoning_never_closed_is_never_constrained(llm, hf):
    """The model writes no </think> in 6 greedy tokens: all of them are its own, unmasked."""
    params = SamplingParams(temperature=0, max_tokens=6, structured_outputs=JSON)
    output = llm.generate([OPENED], params, use_tqdm=False)[0].outputs[0]
    assert list(output.token_ids) == greedy(hf, OPENED, 6)
    assert output.finish_reason == "length"


CONSTRAINTS = [
    (JSON, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)),
    (StructuredOutputsParams(regex="(ab|c[0-9])+x"), llguidance.LLMatcher.grammar_from_regex("(ab|c[0-9])+x")),
    (StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
     llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no" | "maybe so"')),
]


@settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(constraint=st.sampled_from(CONSTRAINTS), budget=st.integers(0, 4), closed=st.booleans(),
       temperature=st.sampled_from([0.0, 1.0]), bias=st.sampled_from([0.0, 5.0, 100.0]))
def test_the_mask_holds_every_token_after_the_end_tag(llm, end, reference_tokenizer, constraint, budget, closed,
                                                      temperature, bias):
    """Whatever closes reasoning (the budget, the model pushed by a bias, or the prompt), each token after the end
    tag is the grammar's, for both sequences of n = 2."""
    params, grammar = constraint
    sampling = SamplingParams(temperature=temperature, seed=7, n=2, max_tokens=24, thinking_token_budget=budget,
                              logit_bias={end: bias}, structured_outputs=params)
    for output in llm.generate([CLOSED if closed else OPENED], sampling, use_tqdm=False)[0].outputs:
        tokens = list(output.token_ids)
        if not closed:
            assert end in tokens[:budget + 1], tokens  # the budget closes it at the latest
            tokens = content_after(tokens, end)
        check_after(reference_tokenizer, grammar, tokens)
