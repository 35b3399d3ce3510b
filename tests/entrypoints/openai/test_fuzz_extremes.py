"""Extreme values for every request field of POST /v1/completions, /v1/chat/completions, Anthropic's /v1/messages,
OpenAI's /v1/responses, /v1/embeddings, vLLM's /score and /rerank and /tokenize's chat form, against a live server.

Each Hypothesis example takes a small valid request (greedy, seeded sampling, min_tokens, streaming, logprobs,
n > 1) and replaces one to three of its fields with an extreme or ill-typed value: integers at and beyond the
32-bit, 64-bit signed and unsigned limits (both signs), NaN and +-Infinity as the raw JSON text `NaN`,
`Infinity`, `-Infinity` (and `1e400`, which Python's parser reads as infinity), huge lists and long strings,
lone surrogates, token ids outside the 49152-token vocabulary, odd message roles and contents, wrong types.

Every request must be answered in time with a 200 or an error body (400, 404 or 413; OpenAI's shape, Anthropic's
on /v1/messages), never a 5xx; /score and /rerank go to a server with a longer context (their prompts do not fit the
48-token one) and must also score some requests (MIN_SCORED); a
body holding a non-finite number must be refused with 400 (RFC 8259 JSON has none, and no field has a use for
one). Before and after the fuzzing, a fixed greedy request returns the same text, /health answers 200 and
/metrics drains to no running or waiting request and no KV block held: a value that kills the engine thread, or
leaks its requests or blocks, fails here even if its own response looked fine.
"""
from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from pagellm.entrypoints.openai.protocol_anthropic import AnthropicMessagesRequest
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_completion import CompletionRequest
from pagellm.entrypoints.openai.protocol_pooling import EmbeddingRequest, RerankRequest, ScoreRequest
from pagellm.entrypoints.openai.protocol_responses_api import ResponsesRequest
from pagellm.entrypoints.openai.protocol_tokenize import TokenizeChatRequest

VOCAB_SIZE = 49152  # the tiny model's (SmolLM2's tokenizer)
EXAMPLES_PER_ENDPOINT = 600
EXAMPLES_PER_PROMPT_ENDPOINT = 150  # the endpoints that only read a prompt (pooling, tokenize): fewer fields
REQUEST_TIMEOUT_S = 20  # the slowest legitimate request here takes a few seconds; past this it is a hang
DRAIN_TIMEOUT_S = 15
MIN_MUTATIONS_PER_FIELD = 3
MIN_SCORED = 5  # requests of each scoring endpoint answered 200 (10 and 12 of 150 now)
ERROR_STATUSES = {400, 404, 413}  # bad value, unknown model, body over the server's limit
GREEDY = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@dataclass(frozen=True)
class Big:
    """A large value with a short repr, so that Hypothesis' and the assertions' reports stay readable."""

    value: object
    label: str

    def __repr__(self) -> str:
        return f"<{self.label}>"


@dataclass(frozen=True)
class RawNumber:
    """A number sent as raw JSON text that json.dumps cannot produce itself (`1e400`: read as infinity)."""

    text: str

    def __repr__(self) -> str:
        return self.text


# ---- value palettes ---------------------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
NON_FINITE = [NAN, INF, -INF, RawNumber("1e400"), RawNumber("-1e400")]
BIG_INTS = [2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**53 + 1, 2**63 - 1, 2**63, -2**63, -2**63 - 1, 2**64 - 1,
            2**64, -2**64, 10**30, -10**30, Big(10**400, "10**400")]
SMALL_INTS = [-1, 0, 1, 2, 16]
FINITE_FLOATS = [1e308, -1e308, 5e-324, -5e-324, -0.0, 1e-300, 0.5, 1.5]
WRONG_TYPES = ["", "1", "abc", True, False, None, [], {}, [1], {"a": 1}]
NUMBERS = SMALL_INTS + BIG_INTS + NON_FINITE + FINITE_FLOATS + WRONG_TYPES
# A fixed palette rather than st.integers() for `n`: a mid-sized n (say 10**5) is a legitimate-looking request that
# an engine without bounds turns into gigabytes of allocations; the extremes are what this module is about.
TOKEN_IDS = [0, 1, 2, VOCAB_SIZE - 1, VOCAB_SIZE, VOCAB_SIZE + 1, -1, 2**31, 2**63 - 1, 2**63, 2**64, -2**64,
             10**30]
LONG_TEXT = Big("a" * 100_000, "'a' * 100_000")
STRINGS = ["", "hi", "\x00", "\ud800", "\udfff\ud800", "\U0010ffff", "{{ 7 * 7 }}{% raw %}", "<|im_end|>", LONG_TEXT]
BOOLS = [True, False, "true", "no", 0, 2, -1, None, NAN, [], {}]
ALL_TOKEN_IDS = Big(list(range(VOCAB_SIZE + 2)), f"list(range({VOCAB_SIZE + 2}))")


def _token_id_lists() -> st.SearchStrategy:
    return st.one_of(st.lists(st.sampled_from(TOKEN_IDS + NON_FINITE + ["1", None, 1.5]), min_size=1, max_size=3),
                     st.sampled_from([[], ALL_TOKEN_IDS, Big([VOCAB_SIZE] * 10_000, f"[{VOCAB_SIZE}] * 10_000")]))


def _string_lists() -> st.SearchStrategy:
    return st.one_of(st.lists(st.sampled_from(STRINGS + [1, None, NAN]), min_size=1, max_size=3),
                     st.sampled_from([[], Big(["s"] * 10_000, "['s'] * 10_000"),
                                      Big([f"w{i}" for i in range(2_000)], "['w0', ..., 'w1999']")]))


def _logit_bias() -> st.SearchStrategy:
    keys = st.sampled_from([str(t) for t in TOKEN_IDS] + ["abc", "1.5", " 1", "+1", "01", "", "NaN", "1e3", "-0"])
    values = st.sampled_from(NUMBERS)
    return st.one_of(st.dictionaries(keys, values, min_size=1, max_size=3),
                     st.sampled_from([{}, [], "x", 5, Big({str(i): 100 for i in range(VOCAB_SIZE)},
                                                          "{every token id: 100}"),
                                      Big({str(i): -100 for i in range(VOCAB_SIZE)}, "{every token id: -100}")]))


MESSAGE_ROLES = ["user", "assistant", "system", "tool", "function", "developer", "", "\ud800", "USER",
                 Big("r" * 10_000, "'r' * 10_000"), "{{ raise_exception('boom') }}", 5, None, NAN, []]
MESSAGE_CONTENTS = STRINGS + [None, 5, NAN, {"a": 1}, [], [{"type": "text", "text": "hi"}],
                              [{"type": "text"}], [{"type": "text", "text": NAN}],
                              [{"type": "image_url", "image_url": {"url": "http://example.com/x.png"}}],
                              [{"type": "text", "text": "a"}] * 50]


@st.composite
def _message(draw) -> dict:
    message = {"role": draw(st.sampled_from(MESSAGE_ROLES)), "content": draw(st.sampled_from(MESSAGE_CONTENTS))}
    if draw(st.booleans()):
        message["name"] = draw(st.sampled_from(["n", "", "\ud800", 5, None, LONG_TEXT]))
    return message


def _messages() -> st.SearchStrategy:
    return st.one_of(st.lists(_message(), min_size=1, max_size=3),
                     st.sampled_from([[], None, "hi", 5, [{}], [None], [{"role": "user"}], [{"content": "hi"}],
                                      Big([{"role": "user", "content": "a"}] * 500, "[user message] * 500")]))


def _prompts() -> st.SearchStrategy:
    return st.one_of(
        st.sampled_from(STRINGS),
        _token_id_lists(),
        st.lists(st.sampled_from(STRINGS[:-1]), min_size=1, max_size=8),  # batches of texts
        st.lists(st.lists(st.sampled_from(TOKEN_IDS), min_size=1, max_size=3), min_size=1, max_size=8),
        st.sampled_from([[[]], [["a"]], ["a", [1]], [[1], "a"], [1, "a"], [1.5], [True], None, 5, {"a": 1},
                         Big(list(range(100_000)), "list(range(100_000))"), Big(["hi"] * 1_000, "['hi'] * 1_000")]))


COMMON_FIELDS = {
    "model": st.sampled_from(STRINGS + ["tiny", "tiny-alias", 5, None, []]),
    "n": st.sampled_from(NUMBERS),
    "temperature": st.sampled_from(NUMBERS),
    "top_p": st.sampled_from(NUMBERS),
    "stop": st.one_of(st.sampled_from(STRINGS + [5, None, NAN]), _string_lists()),
    "stream": st.sampled_from(BOOLS),
    "stream_options": st.one_of(st.builds(lambda v: {"include_usage": v}, st.sampled_from(BOOLS)),
                                st.sampled_from([None, {}, [], "x", 5])),
    "seed": st.sampled_from(NUMBERS),
    "presence_penalty": st.sampled_from(NUMBERS),
    "frequency_penalty": st.sampled_from(NUMBERS),
    "logit_bias": _logit_bias(),
    "user": st.sampled_from(STRINGS + [5, None, []]),
    "top_k": st.sampled_from(NUMBERS),
    "min_p": st.sampled_from(NUMBERS),
    "repetition_penalty": st.sampled_from(NUMBERS),
    "ignore_eos": st.sampled_from(BOOLS),
    "min_tokens": st.sampled_from(NUMBERS),
    "stop_token_ids": st.one_of(_token_id_lists(), st.sampled_from(WRONG_TYPES)),
    "include_stop_str_in_output": st.sampled_from(BOOLS),
    "skip_special_tokens": st.sampled_from(BOOLS),
    "spaces_between_special_tokens": st.sampled_from(BOOLS),
    "bad_words": st.one_of(_string_lists(), st.sampled_from(WRONG_TYPES)),
    "truncate_prompt_tokens": st.sampled_from(NUMBERS),
    "prompt_logprobs": st.sampled_from(NUMBERS + [5, 20, 21]),
    "priority": st.sampled_from(NUMBERS),
    "cache_salt": st.sampled_from(STRINGS + WRONG_TYPES),
    "max_tokens": st.sampled_from(NUMBERS),
    "add_special_tokens": st.sampled_from(BOOLS),
    # No NaN inside these: they are free-form objects, where only the server's own checks can refuse one.
    "response_format": st.sampled_from([None, {}, "x", 5, [], {"type": "text"}, {"type": "json_object"},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
                                        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}]),
    "structured_outputs": st.sampled_from([None, {}, "x", 5, {"regex": "a+"}, {"regex": "a("}, {"choice": ["a", "b"]},
                                           {"choice": []}, {"json": {"type": "object"}}, {"json": "{"},
                                           {"grammar": 'start: "a"'}, {"grammar": "root ::= x"},
                                           {"json_object": True}, {"regex": "a", "choice": ["b"]}]),
}
COMPLETION_FIELDS = {
    **COMMON_FIELDS,
    "prompt": _prompts(),
    "logprobs": st.sampled_from(NUMBERS + [5, 20, 21]),
    "echo": st.sampled_from(BOOLS),
    "suffix": st.sampled_from(STRINGS + [5, None]),
    "best_of": st.sampled_from(NUMBERS),
    "use_beam_search": st.sampled_from(BOOLS),
    "length_penalty": st.sampled_from(NUMBERS),
}
CHAT_FIELDS = {
    **COMMON_FIELDS,
    "messages": _messages(),
    "max_completion_tokens": st.sampled_from(NUMBERS),
    "logprobs": st.sampled_from(BOOLS),
    "top_logprobs": st.sampled_from(NUMBERS + [5, 20, 21]),
    "add_generation_prompt": st.sampled_from(BOOLS),
    "tools": st.sampled_from([None, [], "x", 5, [{"type": "function", "function": {"name": "f"}}], [{}]]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required", "x", 5, {},
                                    {"type": "function", "function": {"name": "f"}},
                                    {"type": "function", "function": {"name": "g"}}]),
    "parallel_tool_calls": st.sampled_from(BOOLS),
    # Template variables that replace ones the template uses ("range", "bos_token") or the server's own ("tools").
    "chat_template_kwargs": st.sampled_from([None, {}, 5, "x", [], {"enable_thinking": False}, {"tools": []},
                                             {"range": 1}, {"bos_token": 5}, {"messages": NAN}, {"": "\ud800"}]),
    "reasoning_effort": st.sampled_from([None, "low", "high", "x", 5, ""]),
    "include_reasoning": st.sampled_from(BOOLS),
    "thinking_token_budget": st.sampled_from(NUMBERS),
    "continue_final_message": st.sampled_from(BOOLS),
}

ANTHROPIC_BLOCKS = [{"type": "text", "text": "hi"}, {"type": "text"}, {"type": "text", "text": NAN},
                    {"type": "tool_use", "id": "t", "name": "f", "input": {}}, {"type": "tool_use", "id": "t"},
                    {"type": "tool_result", "tool_use_id": "t", "content": "ok"},
                    {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "\ud800"}]},
                    {"type": "thinking", "thinking": "hm", "signature": ""}, {"type": "image", "source": {}}, {}]


@st.composite
def _anthropic_message(draw) -> dict:
    role = draw(st.sampled_from(["user", "assistant", "system", "tool", "", 5, None]))
    content = draw(st.one_of(st.sampled_from(STRINGS + [None, 5, [], {}]),
                             st.lists(st.sampled_from(ANTHROPIC_BLOCKS), min_size=1, max_size=3)))
    return {"role": role, "content": content}


def _anthropic_messages() -> st.SearchStrategy:
    return st.one_of(st.lists(_anthropic_message(), min_size=1, max_size=3),
                     st.sampled_from([[], None, "hi", 5, [{}], [{"role": "user"}],
                                      Big([{"role": "user", "content": "a"}] * 500, "[user message] * 500")]))


ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
MESSAGES_FIELDS = {
    "model": COMMON_FIELDS["model"],
    "messages": _anthropic_messages(),
    "max_tokens": st.sampled_from(NUMBERS),
    "system": st.one_of(st.sampled_from(STRINGS + [5, [], {}, [{"type": "text"}]]),
                        st.lists(st.sampled_from(ANTHROPIC_BLOCKS), min_size=1, max_size=2)),
    "stop_sequences": st.one_of(_string_lists(), st.sampled_from(WRONG_TYPES)),
    "temperature": st.sampled_from(NUMBERS),
    "top_p": st.sampled_from(NUMBERS),
    "top_k": st.sampled_from(NUMBERS),
    "metadata": st.sampled_from([None, {}, {"user_id": "u"}, {"user_id": LONG_TEXT}, {"user_id": 5}, "x", []]),
    "stream": st.sampled_from(BOOLS),
    "tools": st.sampled_from([None, [], "x", 5, [ANTHROPIC_TOOL], [{}], [{"name": "f"}],
                              [{"type": "web_search_20250305", "name": "web_search"}], [ANTHROPIC_TOOL] * 200]),
    "tool_choice": st.sampled_from([None, {}, "auto", 5, {"type": "auto"}, {"type": "any"}, {"type": "none"},
                                    {"type": "tool", "name": "f"}, {"type": "tool", "name": "g"}, {"type": "tool"},
                                    {"type": "any", "disable_parallel_tool_use": True}]),
    "thinking": st.sampled_from([None, {}, 5, {"type": "disabled"}, {"type": "adaptive"},
                                 {"type": "enabled", "budget_tokens": 1024}, {"type": "enabled", "budget_tokens": -1}]),
}
RESPONSES_ITEMS = [{"role": "user", "content": "hi"}, {"type": "message", "role": "assistant", "content": [
                       {"type": "output_text", "text": "hi"}]}, {"role": "user", "content": [{"type": "input_text"}]},
                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
                   {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"},
                   {"type": "function_call_output", "call_id": "c", "output": "ok"},
                   {"type": "function_call_output", "call_id": "c", "output": NAN},
                   {"type": "reasoning", "id": "r", "summary": []}, {"type": "input_image"}, {"role": 5}, {}]
RESPONSES_TOOL = {"type": "function", "name": "f", "parameters": {"type": "object"}}
RESPONSES_FIELDS = {
    "model": COMMON_FIELDS["model"],
    "input": st.one_of(st.sampled_from(STRINGS + [None, 5, [], {}]),
                       st.lists(st.sampled_from(RESPONSES_ITEMS), min_size=1, max_size=3)),
    "instructions": st.sampled_from(STRINGS + [5, [], None]),
    "max_output_tokens": st.sampled_from(NUMBERS),
    "temperature": st.sampled_from(NUMBERS),
    "top_p": st.sampled_from(NUMBERS),
    "stream": st.sampled_from(BOOLS),
    "store": st.sampled_from(BOOLS),
    "previous_response_id": st.sampled_from(STRINGS + [5, None]),
    "tools": st.sampled_from([None, [], "x", 5, [RESPONSES_TOOL], [{}], [{"type": "web_search"}],
                              [RESPONSES_TOOL] * 200]),
    "tool_choice": st.sampled_from([None, "none", "auto", "required", "x", 5, {}, {"type": "function", "name": "f"},
                                    {"type": "function", "name": "g"}]),
    "parallel_tool_calls": st.sampled_from(BOOLS),
    "text": st.sampled_from([None, {}, 5, {"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                             {"format": {"type": "json_schema", "name": "x", "schema": {}}},
                             {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}},
                             {"format": {"type": "xml"}}]),
    "reasoning": st.sampled_from([None, {}, 5, {"effort": "low"}, {"effort": "x"}, {"summary": "auto"}]),
    "truncation": st.sampled_from([None, "disabled", "auto", 5]),
    "metadata": st.sampled_from([None, {}, {"k": "v"}, {"k": 5}, {str(i): "v" for i in range(17)}, "x"]),
    "user": COMMON_FIELDS["user"],
    "service_tier": st.sampled_from(STRINGS + [5, None]),
}

TEXTS = st.one_of(st.sampled_from(STRINGS + [None, 5, {}]), _string_lists())
EMBEDDING_FIELDS = {
    "model": COMMON_FIELDS["model"],
    "input": _prompts(),
    "encoding_format": st.sampled_from(STRINGS + ["float", "base64", "FLOAT", 5, None]),
    "dimensions": st.sampled_from(NUMBERS + [8, 64, 65]),
    "user": COMMON_FIELDS["user"],
    "add_special_tokens": st.sampled_from(BOOLS),
    "priority": COMMON_FIELDS["priority"],
    "normalize": st.sampled_from(BOOLS),
}
SCORE_FIELDS = {"model": COMMON_FIELDS["model"], "text_1": TEXTS, "text_2": TEXTS,
                "priority": COMMON_FIELDS["priority"]}
RERANK_FIELDS = {
    "model": COMMON_FIELDS["model"],
    "query": st.sampled_from(STRINGS + [None, 5, [], ["q"]]),
    "documents": TEXTS,
    "top_n": st.sampled_from(NUMBERS),
    "return_documents": st.sampled_from(BOOLS),
    "priority": COMMON_FIELDS["priority"],
}
TOKENIZE_CHAT_FIELDS = {
    "model": COMMON_FIELDS["model"],
    "messages": _messages(),
    **{name: st.sampled_from(BOOLS)
       for name in ("add_generation_prompt", "continue_final_message", "add_special_tokens", "return_token_strs")},
    "tools": CHAT_FIELDS["tools"],
    "chat_template_kwargs": CHAT_FIELDS["chat_template_kwargs"],
}

# For the names a request model declares it refuses (`unsupported_fields`: OpenAI or vLLM parameters that are not
# implemented): anything at all, since any value but a neutral one must be a 400.
ANY_VALUE = st.sampled_from(NUMBERS + STRINGS + BOOLS + [{"type": "json_object"}, {"type": "text"}, ["text"], "none",
                                                         "auto", [{"type": "function", "function": {"name": "f"}}]])


def declared_fields(model) -> set[str]:
    """The names a request model reads: its fields, and those it refuses (`unsupported_fields`) if it has any."""
    return set(model.model_fields) | set(getattr(model, "unsupported_fields", {}))


def fuzzed_fields(model, tailored: dict[str, st.SearchStrategy]) -> dict[str, st.SearchStrategy]:
    """`tailored` plus ANY_VALUE for each name in `model.unsupported_fields` that has no tailored strategy."""
    return {**tailored, **{name: ANY_VALUE for name in sorted(declared_fields(model) - set(tailored))}}


# Valid requests the mutations start from, so that each sampling path (greedy, seeded sampling, min_tokens' masks,
# streaming, logprobs, forking into n sequences) meets the extreme values.
SHARED_BASES = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"min_tokens": 1, "temperature": 0.8},
                {"stream": True, "stream_options": {"include_usage": True}}, {"n": 2, "temperature": 1.0}]
COMPLETION_BASES = [{"model": "tiny", "prompt": "Hello", "max_tokens": 2, **base}
                    for base in SHARED_BASES + [{"logprobs": 2}, {"echo": True, "logprobs": 2}]]
CHAT_BASES = [{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **base}
              for base in SHARED_BASES + [{"logprobs": True, "top_logprobs": 2}]]
MESSAGES_BASES = [{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **base}
                  for base in [{"temperature": 0}, {"temperature": 1.0, "top_k": 5}, {"stream": True},
                               {"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "any"}, "max_tokens": 4}]]
EMBEDDING_BASES = [{"model": "tiny", "input": "Hi", **base}
                   for base in [{}, {"input": ["Hi", "there"]}, {"input": [[5, 6], [7]]}, {"encoding_format": "base64"},
                                {"dimensions": 8}]]
# /score and /rerank wrap each pair in the yes/no judgement's prompt (84 tokens with SmolLM2's), beyond this server's
# 48-token context: their fuzzing meets validation and the length check, and the engine stays sound after it.
SCORE_BASES = [{"model": "tiny", "text_1": "q", "text_2": ["a", "b"]}, {"model": "tiny", "text_1": ["q"] * 2,
                                                                        "text_2": ["a", "b"]}]
RERANK_BASES = [{"model": "tiny", "query": "q", "documents": ["a", "b"], **base}
                for base in [{}, {"top_n": 1}, {"return_documents": False}]]
TOKENIZE_CHAT_BASES = [{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], **base}
                       for base in [{}, {"return_token_strs": True}, {"add_generation_prompt": False,
                                                                      "continue_final_message": True}]]
RESPONSES_BASES = [{"model": "tiny", "input": "Hi", "max_output_tokens": 2, **base}
                   for base in [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.5}, {"stream": True},
                                {"store": True}, {"tools": [RESPONSES_TOOL], "tool_choice": "required",
                                                  "max_output_tokens": 4}]]


@dataclass(frozen=True)
class Mutation:
    """A valid base request and the fields replaced in it (Hypothesis prints this, so failures name the fields)."""

    base: dict
    changes: dict

    @property
    def body(self) -> dict:
        return {**self.base, **self.changes}

    def __repr__(self) -> str:
        return f"Mutation(base={self.base!r}, changes={self.changes!r})"


@st.composite
def _mutations(draw, bases: list[dict], fields: dict[str, st.SearchStrategy]) -> Mutation:
    # The first 1-3 names of a permutation: spreads the draws over the fields more evenly than sampled_from does.
    names = draw(st.permutations(sorted(fields)))[:draw(st.integers(1, 3))]
    return Mutation(base=draw(st.sampled_from(bases)), changes={name: draw(fields[name]) for name in names})


# ---- sending and judging ----------------------------------------------------------------------------------------
def _plain(value):
    """`value` with Big unwrapped and RawNumber as a placeholder string (replaced in the JSON text)."""
    if isinstance(value, Big):
        return _plain(value.value)
    if isinstance(value, RawNumber):
        return f"@@raw:{value.text}@@"
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def serialize(body: dict) -> str:
    """JSON text as a client might send it: json.dumps writes NaN and +-Infinity as bare `NaN`, `Infinity`."""
    text = json.dumps(_plain(body))
    for raw in ("1e400", "-1e400"):
        text = text.replace(f'"@@raw:{raw}@@"', raw)
    return text


def has_non_finite(value) -> bool:
    if isinstance(value, float):
        return value != value or value in (INF, -INF)
    if isinstance(value, RawNumber):
        return True
    if isinstance(value, Big):
        return has_non_finite(value.value)
    if isinstance(value, dict):
        return any(has_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(has_non_finite(v) for v in value)
    return False


def describe(body: dict) -> str:
    return json.dumps(body, default=repr)[:2000]


def _server_log_tail(server, lines: int = 40) -> str:
    return "\n".join(server.log().splitlines()[-lines:])


def _health(server) -> str:
    # A fresh connection: after an unhandled error the server may have closed the pooled one.
    try:
        response = httpx.get(f"{server.url}/health", timeout=5)
        return f"{response.status_code} {response.text[:200]}"
    except httpx.HTTPError as exc:
        return f"no answer ({exc!r})"


def assert_openai_error(response: httpx.Response, context: str) -> None:
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{context}: a {response.status_code} whose body is not JSON: {response.text[:500]!r}")
    assert isinstance(body, dict) and set(body) == {"error"}, f"{context}: not an OpenAI error body: {body}"
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, f"{context}: {body}"
    assert isinstance(error["message"], str) and error["message"], f"{context}: {body}"
    assert isinstance(error["type"], str) and (error["param"] is None or isinstance(error["param"], str)), \
        f"{context}: {body}"
    assert error["code"] == response.status_code, f"{context}: {body}"


def assert_anthropic_error(response: httpx.Response, context: str) -> None:
    try:
        body = response.json()
    except ValueError:
        pytest.fail(f"{context}: a {response.status_code} whose body is not JSON: {response.text[:500]!r}")
    assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", \
        f"{context}: not an Anthropic error body: {body}"
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], f"{context}: {body}"


def assert_message_answer(response: httpx.Response, context: str) -> None:
    """A 200 of /v1/messages: one message, or Anthropic's events from message_start to message_stop."""
    if response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        assert body.get("type") == "message" and isinstance(body.get("content"), list), f"{context}: {body}"
        return
    names = [line[len("event: "):] for line in response.text.splitlines() if line.startswith("event: ")]
    assert names[:1] == ["message_start"] and names[-1:] in (["message_stop"], ["error"]), \
        f"{context}: events {names}"
    assert "api_error" not in response.text and "overloaded_error" not in response.text, \
        f"{context}: {response.text[-500:]}"


def assert_response_answer(response: httpx.Response, context: str) -> None:
    """A 200 of /v1/responses: one response object, or its events from response.created to response.completed
    (or .incomplete), or to an error event that is not a server error."""
    if response.headers.get("content-type", "").startswith("application/json"):
        body = response.json()
        assert body.get("object") == "response" and isinstance(body.get("output"), list), f"{context}: {body}"
        return
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [event["sequence_number"] for event in events] == list(range(len(events))), f"{context}: {events[:3]}"
    assert events[0]["type"] == "response.created", f"{context}: {events[:3]}"
    last = events[-1]
    assert last["type"] in ("response.completed", "response.incomplete") or (
        last["type"] == "error" and int(last.get("code") or 500) < 500), f"{context}: the stream ended with {last}"


def assert_json_answer(response: httpx.Response, context: str) -> None:
    """A 200 of the prompt-only endpoints: one JSON object holding its result (embeddings, scores, ranking, ids)."""
    assert response.headers.get("content-type", "").startswith("application/json"), f"{context}: {response.headers}"
    body = response.json()
    assert isinstance(body, dict) and {"data", "results", "tokens"} & set(body), f"{context}: {response.text[:500]}"


PROMPT_ENDPOINTS = ("/v1/embeddings", "/score", "/rerank", "/tokenize")


def assert_completion_answer(response: httpx.Response, context: str) -> None:
    """A 200's body: one JSON object with choices, or server-sent events ending in [DONE] with no server error
    (a stream is told by its content type: pydantic reads "true" and 1 as a true `stream` too)."""
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("application/json"):
        body = response.json()
        assert isinstance(body.get("choices"), list) and body["choices"], f"{context}: {response.text[:500]}"
        return
    assert content_type.startswith("text/event-stream"), f"{context}: a 200 with content type {content_type!r}"
    events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", f"{context}: the stream did not end with [DONE]: {events[-3:]}"
    for event in events[:-1]:
        chunk = json.loads(event)
        error = chunk.get("error")
        assert error is None or error.get("code", 500) < 500, f"{context}: the stream ended with {event}"


def send_and_check(server, http: httpx.Client, path: str, body: dict, declared: set[str]) -> int:
    """Send `body` and judge the answer (`declared`: the request model's field names); returns its status."""
    text = serialize(body)
    context = f"POST {path} {describe(body)}"
    try:
        response = http.post(path, content=text, headers={"Content-Type": "application/json"},
                             timeout=REQUEST_TIMEOUT_S)
    except httpx.TimeoutException:
        pytest.fail(f"{context}\nhad no answer in {REQUEST_TIMEOUT_S} s (/health: {_health(server)}); server log:\n"
                    f"{_server_log_tail(server)}")
    except httpx.TransportError as exc:
        pytest.fail(f"{context}\nfailed: {exc!r} (/health: {_health(server)}); server log:\n{_server_log_tail(server)}")
    if response.status_code >= 500:
        # A 503 here usually means this request killed the engine thread; /health tells which.
        pytest.fail(f"{context}\nwas answered {response.status_code} {response.text[:500]} "
                    f"(/health: {_health(server)}); server log:\n{_server_log_tail(server)}")
    assert response.status_code == 200 or response.status_code in ERROR_STATUSES, \
        f"{context}\nwas answered {response.status_code} {response.text[:500]}"
    # Only in declared fields: an unknown field is ignored whatever it holds (the protocol's choice, as OpenAI's).
    if has_non_finite({name: value for name, value in body.items() if name in declared}):
        assert response.status_code == 400, \
            f"{context}\nholds a non-finite number but was answered {response.status_code} {response.text[:300]}"
    anthropic = path.startswith("/v1/messages")
    if response.status_code == 200:
        (assert_message_answer if anthropic else assert_response_answer if path == "/v1/responses"
         else assert_json_answer if path in PROMPT_ENDPOINTS else assert_completion_answer)(response, context)
    else:
        (assert_anthropic_error if anthropic else assert_openai_error)(response, context)
    return response.status_code


def fuzz(server, http: httpx.Client, path: str, model, bases: list[dict],
         fields: dict[str, st.SearchStrategy]) -> tuple[Counter, Counter]:
    """Run the Hypothesis fuzzer against `path`; returns how often each field was mutated, and each status."""
    mutated: Counter = Counter()
    statuses: Counter = Counter()
    declared = declared_fields(model)
    assert _health(server).startswith("200"), \
        f"the engine died before this test (see the earlier failure): /health {_health(server)}"

    # No shrinking: once a request has killed the engine every later one fails too, so a shrunk example would be
    # any request at all; the first failing example is the informative one, and each mutates only 1-3 fields.
    @settings(max_examples=EXAMPLES_PER_PROMPT_ENDPOINT if path in PROMPT_ENDPOINTS else EXAMPLES_PER_ENDPOINT,
              derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], print_blob=False,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example])
    @given(mutation=_mutations(bases, fields))
    def send(mutation: Mutation) -> None:
        mutated.update(mutation.changes.keys())
        statuses[send_and_check(server, http, path, mutation.body, declared)] += 1

    send()
    return mutated, statuses


# ---- the tests --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, headers={"Authorization": f"Bearer {fuzz_server.api_key}"},
                      timeout=REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def scoring_http(scoring_fuzz_server):
    with httpx.Client(base_url=scoring_fuzz_server.url,
                      headers={"Authorization": f"Bearer {scoring_fuzz_server.api_key}"},
                      timeout=REQUEST_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_text(http) -> str:
    """The fixed greedy request's text on the fresh server (computed on first use, before any fuzzing)."""
    response = http.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_sound(server, http: httpx.Client, greedy_text: str) -> None:
    """/health is 200, nothing runs, waits or holds a KV block once drained, and greedy output is unchanged."""
    health = _health(server)
    assert health.startswith("200"), f"/health: {health}\n{_server_log_tail(server)}"
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        metrics = server.metrics()
        held = {name: metrics[(name, ())] for name in ("pagellm:num_requests_running",
                                                       "pagellm:num_requests_waiting", "pagellm:kv_cache_used_blocks")}
        if not any(held.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not any(held.values()), f"not drained after {DRAIN_TIMEOUT_S} s: {held}"
    response = http.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == greedy_text


def test_every_request_field_is_fuzzed():
    # A field added to the protocol without a strategy here would go unfuzzed; this makes that a failure.
    assert set(CompletionRequest.model_fields) <= set(COMPLETION_FIELDS)
    assert set(ChatCompletionRequest.model_fields) <= set(CHAT_FIELDS)
    assert set(AnthropicMessagesRequest.model_fields) <= set(MESSAGES_FIELDS)
    assert set(ResponsesRequest.model_fields) <= set(RESPONSES_FIELDS)
    for model, fields in [(EmbeddingRequest, EMBEDDING_FIELDS), (ScoreRequest, SCORE_FIELDS),
                          (RerankRequest, RERANK_FIELDS), (TokenizeChatRequest, TOKENIZE_CHAT_FIELDS)]:
        assert set(model.model_fields) <= set(fields), model


def test_server_is_sound_before_fuzzing(fuzz_server, http, greedy_text):
    assert greedy_text  # 8 greedy tokens of random weights: some text
    assert_sound(fuzz_server, http, greedy_text)


@pytest.mark.parametrize("path, model, bases, fields", [
    ("/v1/completions", CompletionRequest, COMPLETION_BASES, fuzzed_fields(CompletionRequest, COMPLETION_FIELDS)),
    ("/v1/chat/completions", ChatCompletionRequest, CHAT_BASES, fuzzed_fields(ChatCompletionRequest, CHAT_FIELDS)),
    ("/v1/messages", AnthropicMessagesRequest, MESSAGES_BASES,
     fuzzed_fields(AnthropicMessagesRequest, MESSAGES_FIELDS)),
    ("/v1/responses", ResponsesRequest, RESPONSES_BASES, fuzzed_fields(ResponsesRequest, RESPONSES_FIELDS)),
    ("/v1/embeddings", EmbeddingRequest, EMBEDDING_BASES, fuzzed_fields(EmbeddingRequest, EMBEDDING_FIELDS)),
    ("/tokenize", TokenizeChatRequest, TOKENIZE_CHAT_BASES,
     fuzzed_fields(TokenizeChatRequest, TOKENIZE_CHAT_FIELDS)),
], ids=["completions", "chat", "messages", "responses", "embeddings", "tokenize-chat"])
def test_extreme_values_get_a_200_or_a_400(fuzz_server, http, greedy_text, path, model, bases, fields):
    mutated, statuses = fuzz(fuzz_server, http, path, model, bases, fields)
    check_coverage(path, fields, mutated, statuses)


@pytest.mark.parametrize("path, model, bases, fields", [
    ("/score", ScoreRequest, SCORE_BASES, fuzzed_fields(ScoreRequest, SCORE_FIELDS)),
    ("/rerank", RerankRequest, RERANK_BASES, fuzzed_fields(RerankRequest, RERANK_FIELDS)),
], ids=["score", "rerank"])
def test_extreme_scoring_values_get_a_200_or_a_400(scoring_fuzz_server, scoring_http, path, model, bases, fields):
    mutated, statuses = fuzz(scoring_fuzz_server, scoring_http, path, model, bases, fields)
    check_coverage(path, fields, mutated, statuses)
    assert statuses[200] >= MIN_SCORED, f"only {statuses[200]} requests reached a score"


def check_coverage(path: str, fields: dict, mutated: Counter, statuses: Counter) -> None:
    print(f"{path}: {sum(statuses.values())} requests, by status {dict(statuses)}; "
          f"{len(fields)} fields, each mutated {min(mutated.values())}-{max(mutated.values())} times")
    # A test of the test: every field met its extremes a few times (the draws are derandomized, so this is fixed).
    rare = {name: mutated[name] for name in fields if mutated[name] < MIN_MUTATIONS_PER_FIELD}
    assert not rare, f"fields mutated fewer than {MIN_MUTATIONS_PER_FIELD} times: {rare}"


def test_server_is_sound_after_fuzzing(fuzz_server, http, greedy_text):
    assert_sound(fuzz_server, http, greedy_text)


def test_scoring_server_is_sound_after_fuzzing(scoring_fuzz_server, scoring_http, greedy_text):
    """The same weights and greedy request: the same text as on the other server."""
    assert_sound(scoring_fuzz_server, scoring_http, greedy_text)
