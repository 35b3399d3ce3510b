"""Tool calls. Extraction on its own: whole texts and the same texts streamed in every split give the same calls,
content and finish reason (Hermes blocks under "auto"; under "required" the JSON array, parsed as it grows, each
call streamed once its object closes as an opening delta and argument fragments byte-equal to the non-streamed
arguments; the same for a named function, as it grows). An array or a block cut short (max_tokens, a stop string)
keeps the calls completed before the cut and the engine's finish reason. Over HTTP: a tool message without
tool_call_id is a 400, and the default model's forced calls validate against their schema with jsonschema."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagellm.entrypoints.openai.tool_calls import ToolCallStreamer, extract_tool_calls, tool_call_constraint

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def request(tool_choice) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=tool_choice)


def stream(mode: str, req: ChatCompletionRequest, pieces: list[str], engine_reason: str = "stop",
           deltas_per_call: dict[int, int] | None = None,
           opened_at: dict[int, int] | None = None) -> tuple[str, list[tuple[str, str]], str]:
    """Feed the pieces; returns (content, (name, arguments) per call, finish reason). Under "required" and "named"
    every call's first delta must be its opening one (id, type, name, empty arguments) and the others bare argument
    fragments; `deltas_per_call` then gets each call's number of fragments, `opened_at` how many characters had
    been fed when each call opened."""
    streamer = ToolCallStreamer(mode, req)
    content, calls, fed = "", {}, 0
    for i, piece in enumerate(pieces):
        fed += len(piece)
        delta_content, deltas = streamer.feed(piece, i == len(pieces) - 1)
        content += delta_content or ""
        for delta in deltas:
            if mode in ("required", "named"):
                opening = delta.index not in calls
                assert (delta.id is not None, delta.type, delta.function.name is not None) == (
                    (True, "function", True) if opening else (False, None, False))
                assert delta.function.arguments == "" if opening else delta.function.arguments
                if opening and opened_at is not None:
                    opened_at[delta.index] = fed
                if not opening and deltas_per_call is not None:
                    deltas_per_call[delta.index] = deltas_per_call.get(delta.index, 0) + 1
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], streamer.finish_reason(engine_reason)


def splits(text: str) -> list[list[str]]:
    return [[text[i:i + size] for i in range(0, len(text), size)] for size in (1, 2, 3, 7, len(text))]


def whole_text_result(mode: str, req: ChatCompletionRequest, text: str,
                      engine_reason: str) -> tuple[str, list[tuple[str, str]], str]:
    """extract_tool_calls in the shape of `stream` (content "" for none)."""
    extracted = extract_tool_calls(mode, req, text)
    return (extracted.content or "", [(c.function.name, c.function.arguments) for c in extracted.tool_calls],
            extracted.finish_reason(engine_reason))


CUT_HERMES = 'Sure. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n<tool_call>{"name": "g", "argum'
AUTO_TEXTS = {  # text -> (content, (name, arguments as an object) per call, whether the calls are whole)
    'Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>': (
        "Let me check. ", [("f", {"a": 1})], True),
    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>': (None, [("f", {"a": 1}), ("g", {})], True),
    # Unclosed at the end but its JSON whole (the end tag was a stop string, or the model stopped): a call.
    '<tool_call>{"name": "f", "arguments": {"a": 1}}': (None, [("f", {"a": 1})], True),
    # Cut mid-block (max_tokens, a stop string): the call before it stands, the cut block is dropped.
    CUT_HERMES: ("Sure. ", [("f", {"a": 1})], False),
    # Cut before any whole call, or not calls: content.
    '<tool_call>{"name": "f", "argu': ('<tool_call>{"name": "f", "argu', [], False),
    "No calls here, just a < sign and <tool": ("No calls here, just a < sign and <tool", [], False),
    "<tool_call>not json</tool_call>": ("<tool_call>not json</tool_call>", [], False),
    '<tool_call>{"name": "f"}</tool_call><tool_call>[1]</tool_call>': (
        '<tool_call>{"name": "f"}</tool_call><tool_call>[1]</tool_call>', [], False),
}


@pytest.mark.parametrize("text, expected", list(AUTO_TEXTS.items()))
@pytest.mark.parametrize("engine_reason", ["stop", "length"])
def test_auto_stream_equals_whole_text(text, expected, engine_reason):
    req = request("auto")
    content, calls, whole = expected
    extracted = extract_tool_calls("auto", req, text)
    assert extracted.content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls] == calls
    finish = "tool_calls" if whole and engine_reason == "stop" else engine_reason
    assert extracted.finish_reason(engine_reason) == finish
    for pieces in splits(text):
        assert stream("auto", req, pieces, engine_reason) == whole_text_result("auto", req, text, engine_reason)


REQUIRED_TEXTS = {  # the output -> (name, arguments) of each call: the raw text of its parameters value
    r'[{"name": "f", "parameters": {"a": [1, 2]}}]': [("f", r'{"a": [1, 2]}')],
    # Whitespace, brackets and escapes inside strings, an extra key, a second call.
    r'[ {"name":"f","parameters":{"s":"}]\\\" {[","n":{"x":null}}} ,' '\n'
    r'{"name": "g", "parameters": {}, "x": [1]}]':
        [("f", r'{"s":"}]\\\" {[","n":{"x":null}}'), ("g", "{}")],
    # An escaped name, a key before the parameters, scalar parameters (a number, a string).
    r'[{"name": "f\u00e9", "x": "{", "parameters": -1.5e3}, {"name": "g", "parameters": "a\"b"}]':
        [("f\u00e9", "-1.5e3"), ("g", r'"a\"b"')],
}


@pytest.mark.parametrize("text, expected", list(REQUIRED_TEXTS.items()))
def test_required_calls_stream_byte_for_byte_as_the_whole_text(text, expected):
    req = request("required")
    extracted = extract_tool_calls("required", req, text)
    assert extracted.content is None and [(c.function.name, c.function.arguments) for c in extracted.tool_calls] == [
        (name, arguments) for name, arguments in expected]
    assert [json.loads(c.function.arguments) for c in extracted.tool_calls] == [
        c["parameters"] for c in json.loads(text)]
    for pieces in splits(text):
        fragments: dict[int, int] = {}
        got = stream("required", req, pieces, deltas_per_call=fragments)
        assert got == ("", [(c.function.name, c.function.arguments) for c in extracted.tool_calls], "tool_calls")
        if len(pieces) == len(text):  # a character at a time: the arguments arrive in the pieces they grew in
            assert all(fragments[i] == len(arguments) for i, (_, arguments) in enumerate(expected))


def test_required_text_that_is_not_calls():
    req = request("required")
    # Not an array of calls: content, streamed or not.
    for not_calls in ('[{"name": "f", "param', '{"name": "f", "parameters": {}}', '[{"name": 1, "parameters": {}}]',
                      '[{"parameters": {}}, {"name": "f", "parameters": {}}]'):
        assert extract_tool_calls("required", req, not_calls) == (not_calls, [], False)
        assert stream("required", req, [not_calls]) == (not_calls, [], "stop")
    # Text after the array (the grammar makes none): content when not streamed; streamed, the call went out when
    # its object closed and stands.
    trailing = '[{"name": "f", "parameters": 1}] x'
    assert extract_tool_calls("required", req, trailing) == (trailing, [], False)
    assert stream("required", req, list(trailing)) == ("", [("f", "1")], "stop")
    # A name after the parameters (not what the grammar generates): the call goes once its object closes.
    late = '[{"parameters": {"late": true}, "name": "f"}]'
    fragments: dict[int, int] = {}
    expected = [("f", '{"late": true}')]
    assert stream("required", req, list(late), deltas_per_call=fragments) == ("", expected, "tool_calls")
    assert fragments == {0: len(expected[0][1])}
    assert extract_tool_calls("required", req, late).tool_calls[0].function.arguments == expected[0][1]
    schema = tool_call_constraint(req, "required").json
    assert schema["minItems"] == 1 and "maxItems" not in schema


def test_named_streams_its_arguments_as_they_grow():
    named = request({"type": "function", "function": {"name": "f"}})
    fragments: dict[int, int] = {}
    assert stream("named", named, ['{"a"', "", ": 1}"], deltas_per_call=fragments) == (
        "", [("f", '{"a": 1}')], "tool_calls")
    assert fragments == {0: 2}
    assert extract_tool_calls("named", named, '{"a": 1}').tool_calls[0].function.arguments == '{"a": 1}'
    assert tool_call_constraint(named, "named").json == {"type": "object"}


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8)
CALLS = st.lists(st.fixed_dictionaries({"name": st.text(min_size=1, max_size=8), "parameters": JSON_VALUES}),
                 min_size=1, max_size=3)


@settings(max_examples=100, deadline=None)
@given(calls=CALLS, indent=st.sampled_from([None, 0, 2]), separators=st.sampled_from([(",", ":"), (", ", ": ")]),
       ascii_only=st.booleans(), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_any_array_of_calls_parses_and_streams_back(calls, indent, separators, ascii_only, cuts):
    """Any JSON array of calls, however json.dumps lays it out, in any split: each call's arguments are the text of
    its parameters (they parse back to them), streamed byte for byte as when not streamed."""
    text = json.dumps(calls, indent=indent, separators=separators, ensure_ascii=ascii_only)
    req = request("required")
    extracted = extract_tool_calls("required", req, text)
    assert extracted.content is None and not extracted.cut_short
    assert [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls] == [
        (call["name"], call["parameters"]) for call in calls]
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:])]
    assert stream("required", req, pieces) == ("", [(c.function.name, c.function.arguments)
                                                    for c in extracted.tool_calls], "tool_calls")


@settings(max_examples=150, deadline=None)
@given(calls=CALLS, separator=st.sampled_from([",", ", ", ",\n  "]), ascii_only=st.booleans(), data=st.data())
def test_an_array_cut_short_keeps_the_calls_before_the_cut(calls, separator, ascii_only, data):
    """An array cut anywhere (max_tokens, a stop string) gives the calls whose objects closed before the cut, their
    arguments parsing back to their parameters, and the engine's finish reason; streamed in any split, the same
    calls byte for byte, none sent before its object closed. With no call complete, the text is content."""
    objects = [json.dumps(call, ensure_ascii=ascii_only) for call in calls]
    text = "[" + separator.join(objects) + "]"
    ends = [len("[") + sum(len(o) for o in objects[:i + 1]) + i * len(separator) for i in range(len(objects))]
    cut = data.draw(st.integers(min_value=1, max_value=len(text) - 1), label="cut")
    engine_reason = data.draw(st.sampled_from(["length", "stop"]), label="engine_reason")
    num_complete = sum(end <= cut for end in ends)
    req = request("required")
    extracted = extract_tool_calls("required", req, text[:cut])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls] == [
        (call["name"], call["parameters"]) for call in calls[:num_complete]]
    assert extracted.content == (None if num_complete else text[:cut])
    assert extracted.finish_reason(engine_reason) == engine_reason
    sizes = data.draw(st.lists(st.integers(min_value=1, max_value=12), min_size=1, max_size=40), label="sizes")
    pieces, start = [], 0
    while start < cut:
        pieces.append(text[start:min(cut, start + sizes[len(pieces) % len(sizes)])])
        start += len(pieces[-1])
    opened_at: dict[int, int] = {}
    assert stream("required", req, pieces, engine_reason, opened_at=opened_at) == whole_text_result(
        "required", req, text[:cut], engine_reason)
    assert all(opened_at[i] >= ends[i] for i in opened_at)


# ---- over HTTP ------------------------------------------------------------------------------------------------
def test_a_tool_message_without_tool_call_id_is_400(server):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "content": "21 degrees"}]
    body = {"model": server.model_name, "messages": messages, "max_tokens": 2}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"}, timeout=30) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "messages" and error["code"] == 400 and error["type"] == "BadRequestError"
        assert "messages.2" in error["message"] and "tool_call_id" in error["message"]
        messages[2]["tool_call_id"] = "call_1"
        assert http.post("/v1/chat/completions", json=body).status_code == 200


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def default_model_client(smollm2_dir, start_server):
    """The default model with its own chat template (which does not render tools)."""
    for server in start_server(smollm2_dir, "--max-model-len", "512", "--kv-cache-memory", "64MiB"):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_default_model_required_call_validates(default_model_client):
    """With max_tokens=80 the default model makes at least one call, valid for the schema (it once wrote keys the
    schema does not name, began a second call and was cut off, and all came back as content), the same streamed
    and not."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "What is the weather in Lyon?"}],
                  tools=[WEATHER], tool_choice="required", max_tokens=80, temperature=0)
    choice = default_model_client.chat.completions.create(**kwargs).choices[0]
    assert choice.message.tool_calls and not choice.message.content
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    assert choice.finish_reason in ("tool_calls", "length")
    streamed, finish = {}, None
    for chunk in default_model_client.chat.completions.create(stream=True, **kwargs):
        for delta in chunk.choices[0].delta.tool_calls or []:
            entry = streamed.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [
        (call.function.name, call.function.arguments) for call in choice.message.tool_calls]
    assert finish == choice.finish_reason
