"""Structured outputs end to end on a tiny random-weight Llama: every output matches its constraint (checked with
jsonschema and re, not with the grammar library), greedy and sampled, n > 1, with every sampling parameter, under
and preemption; constrained logprobs equal a masked log-softmax of transformers' logits;
bad constraints are refused before anything is queued.

A random-weight model has no wish to close a JSON object, so the schemas bound every string, number and array
and use compact JSON (`disable_any_whitespace`): then the grammar itself ends the output well inside max_tokens.
(`json_object`, which bounds nothing, is checked with SmolLM2 in tests/entrypoints/openai/.)
"""
from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.sampling_params import StructuredOutputsParams

MAX_MODEL_LEN = 256
BIG_KV = 8 << 20
MAX_TOKENS = 120
TOL = 1e-3

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "name": {"type": "string", "maxLength": 6},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": -9, "maximum": 9}, "maxItems": 3},
        "where": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0, "maximum": 1}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["id", "tag", "ok", "name", "scores", "where"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,5}-[0-9]{2}"
CHOICES = ["apple pie", "banana", "cherry tart"]
LARK = 'start: GREETING " " NAME\nGREETING: "hi" | "hello"\nNAME: /[a-z]{3}/'


def _valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


CONSTRAINTS = {
    "json": (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True), _valid_json),
    "regex": (StructuredOutputsParams(regex=REGEX), lambda text: re.fullmatch(REGEX, text) is not None),
    "choice": (StructuredOutputsParams(choice=CHOICES), lambda text: text in CHOICES),
    "grammar": (StructuredOutputsParams(grammar=LARK), lambda text: re.fullmatch(r"(hi|hello) [a-z]{3}", text)),
}



@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=BIG_KV)


@pytest.fixture(scope="module")
def prompts(make_token_prompts):
    return make_token_prompts([3, 11, 24], seed=5)


def variants(constraint: StructuredOutputsParams) -> list[SamplingParams]:
    """Greedy, seeded sampling with n > 1, and sampling under every logits-processing parameter."""
    common = dict(max_tokens=MAX_TOKENS, structured_outputs=constraint)
    return [SamplingParams(temperature=0.0, **common),
            SamplingParams(temperature=1.0, seed=7, n=3, **common),
            SamplingParams(temperature=0.8, top_p=0.9, top_k=50, min_p=0.01, repetition_penalty=1.2,
                           presence_penalty=0.5, frequency_penalty=0.3, logit_bias={17: 5.0}, seed=3, **common)]


def check_outputs(kind: str, outputs) -> None:
    checker = CONSTRAINTS[kind][1]
    for output in outputs:
        for completion in output.outputs:
            text = completion.text
            assert completion.finish_reason == "stop", (kind, text)
            assert checker(text), (kind, text)


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_every_output_matches_its_constraint(kind, llm, prompts, no_leaks):
    params = variants(CONSTRAINTS[kind][0])
    outputs = llm.generate([p for p in prompts for _ in params], params * len(prompts), use_tqdm=False)
    check_outputs(kind, outputs)
    assert [len(o.outputs) for o in outputs] == [p.n for p in params] * len(prompts)
    no_leaks(llm)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_constraints_mixed_with_free_requests_and_preemption(preemption_mode, model_dir, llm, prompts, pool_bytes,
                                                             no_leaks):
    """A small pool preempts constrained sequences mid-output (their K/V recomputed or swapped to the host tier):
    every output still matches, and greedy ones equal the big pool's (the grammar state survived preemption). Free
    requests run beside them."""
    block_size, max_model_len = 4, 160
    small = LLM(model=str(model_dir), max_model_len=max_model_len, block_size=block_size,
                kv_cache_memory_bytes=pool_bytes(model_dir, block_size, max_model_len // block_size + 2),
                max_num_batched_tokens=32, preemption_mode=preemption_mode)
    kinds = ["json", "regex", "choice", "grammar"]
    batch, params = [], []
    for kind in kinds:
        for prompt in prompts:
            batch.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                         structured_outputs=CONSTRAINTS[kind][0]))
    free = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    batch += prompts * 2
    params += [free] * len(prompts) * 2
    outputs = small.generate(batch, params, use_tqdm=False)
    assert small.llm_engine.engine_core.scheduler.num_preemptions_total > 0
    for i, kind in enumerate(kinds):
        check_outputs(kind, outputs[i * len(prompts):(i + 1) * len(prompts)])
    expected = llm.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
    no_leaks(small)


def test_stop_strings_cut_constrained_output(llm, prompts, no_leaks):
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=[" "],
                            structured_outputs=StructuredOutputsParams(choice=["apple pie", "cherry tart"]))
    for output in llm.generate(prompts, params, use_tqdm=False):
        completion = output.outputs[0]
        assert completion.text in ("apple", "cherry") and completion.stop_reason == " "
    no_leaks(llm)


def test_logprobs_are_the_masked_log_softmax_of_transformers(llm, hf_model, prompts, model_dir):
    """Reference: transformers' logits over prompt + output, masked with the tokens llguidance allows at each
    position (a matcher of the test's own, replayed over the output), then log-softmax."""
    from transformers import AutoTokenizer

    constraint = CONSTRAINTS["json"][0]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3, structured_outputs=constraint),
              SamplingParams(temperature=1.0, seed=1, max_tokens=MAX_TOKENS, logprobs=2,
                             structured_outputs=constraint)]
    outputs = llm.generate(prompts[:1] * 2, params, use_tqdm=False)
    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(model_dir)), n_vocab=49152)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    for output, p in zip(outputs, params):
        completion = output.outputs[0]
        tokens = completion.token_ids
        with torch.inference_mode():
            logits = hf_model(torch.tensor([output.prompt_token_ids + tokens])).logits[0].float()
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        mask = np.empty((1, 49152 // 32), dtype=np.int32)
        for step, (token, entry) in enumerate(zip(tokens, completion.logprobs)):
            matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
            allowed = torch.from_numpy(np.unpackbits(mask.view(np.uint8), bitorder="little").astype(bool))
            reference = logits[len(output.prompt_token_ids) - 1 + step].masked_fill(~allowed, float("-inf"))
            reference = reference.log_softmax(-1)
            assert entry[token].logprob == pytest.approx(reference[token].item(), abs=TOL)
            top = sorted((lp for t, lp in entry.items() if lp.rank <= p.logprobs), key=lambda lp: lp.rank)
            expected = reference.topk(p.logprobs).values.tolist()
            assert [lp.logprob for lp in top] == pytest.approx(expected, abs=TOL)
            assert matcher.consume_token(token)
        assert matcher.is_stopped()


@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, regex, choice, grammar and json_object; got none"),
    ({"json": SCHEMA, "regex": "a"}, "got json, regex"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"choice": []}, "choice must be a non-empty list of strings"),
])
def test_exactly_one_constraint(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize("constraint, message", [
    (StructuredOutputsParams(regex="a(b"), "(?s)structured_outputs.regex cannot be compiled: .*unclosed group"),
    (StructuredOutputsParams(json={"type": "objekt"}), "(?s)structured_outputs.json cannot be compiled: .*objekt"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "minimum"),
    (StructuredOutputsParams(grammar="root ::= missing"), "structured_outputs.grammar is invalid"),
])
def test_uncompilable_constraints_are_refused_before_queueing(constraint, message, llm, prompts, no_leaks):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts[:1], SamplingParams(structured_outputs=constraint), use_tqdm=False)
    no_leaks(llm)
    # The engine keeps serving.
    assert llm.generate(prompts[:1], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)


def test_chat_with_tools_and_a_constrained_call(llm):
    """LLM.chat hands `tools` to the template; a call constrained to the tool's schema parses as its arguments."""
    template = ("{% for tool in tools or [] %}[{{ tool.function.name }}]{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: ")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    [output] = llm.chat([{"role": "user", "content": "Weather?"}], params, use_tqdm=False, chat_template=template,
                        tools=[tool])
    assert output.prompt.startswith("[get_weather]user: Weather?")
    assert _valid_json(output.outputs[0].text)
