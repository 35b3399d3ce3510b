"""Tool-call extraction on its own: whole texts and the same texts streamed in every split give the same calls and
content (Hermes blocks under "auto"; under "required" the JSON array, parsed as it grows, whose calls stream as an
opening delta and argument fragments byte-equal to the non-streamed arguments; the same for a named function)."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.tool_calls import ToolCallStreamer, extract_tool_calls, tool_call_constraint

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def request(tool_choice) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=tool_choice)


def stream(mode: str, req: ChatCompletionRequest, pieces: list[str], engine_reason: str = "stop",
           deltas_per_call: dict[int, int] | None = None) -> tuple[str, list[tuple[str, str]], str]:
    """Feed the pieces; returns (content, (name, arguments) per call, finish reason). Under "required" and "named"
    every call's first delta must be its opening one (id, type, name, empty arguments) and the others bare argument
    fragments; `deltas_per_call` then gets each call's number of fragments."""
    streamer = ToolCallStreamer(mode, req)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta_content, deltas = streamer.feed(piece, i == len(pieces) - 1)
        content += delta_content or ""
        for delta in deltas:
            if mode in ("required", "named"):
                opening = delta.index not in calls
                assert (delta.id is not None, delta.type, delta.function.name is not None) == (
                    (True, "function", True) if opening else (False, None, False))
                assert delta.function.arguments == "" if opening else delta.function.arguments
                if not opening and deltas_per_call is not None:
                    deltas_per_call[delta.index] = deltas_per_call.get(delta.index, 0) + 1
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], streamer.finish_reason(engine_reason)


def splits(text: str) -> list[list[str]]:
    return [[text[i:i + size] for i in range(0, len(text), size)] for size in (1, 2, 3, 7, len(text))]


AUTO_TEXTS = [
    'Let me check. <tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>\n'
    '<tool_call>{"name": "g", "arguments": {}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"a": 1}}',  # unclosed at the end: still a call
    "No calls here, just a < sign and <tool",
    "<tool_call>not json</tool_call>",
]


@pytest.mark.parametrize("text", AUTO_TEXTS)
def test_auto_stream_equals_whole_text(text):
    req = request("auto")
    content, calls = extract_tool_calls("auto", req, text)
    expected_calls = [(c.function.name, c.function.arguments) for c in calls]
    for size in (1, 3, 7, len(text)):
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        got_content, got_calls, finish = stream("auto", req, pieces)
        assert got_content == (content or "") and got_calls == expected_calls
        assert finish == ("tool_calls" if calls else "stop")
    if "tool_call>{" in text:
        assert [json.loads(arguments) for _, arguments in expected_calls][0] == {"a": 1}
        assert content == ("Let me check. " if text.startswith("Let") else None)
    else:
        assert content == text and not calls


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
    content, calls = extract_tool_calls("required", req, text)
    assert content is None and [(c.function.name, c.function.arguments) for c in calls] == [
        (name, arguments) for name, arguments in expected]
    assert [json.loads(c.function.arguments) for c in calls] == [c["parameters"] for c in json.loads(text)]
    for pieces in splits(text):
        fragments: dict[int, int] = {}
        got = stream("required", req, pieces, deltas_per_call=fragments)
        assert got == ("", [(c.function.name, c.function.arguments) for c in calls], "tool_calls")
        if len(pieces) == len(text):  # a character at a time: the arguments arrive in pieces as they grow
            assert all(fragments[i] == len(arguments) for i, (_, arguments) in enumerate(expected))


def test_required_cut_short_or_not_calls():
    req = request("required")
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "f", "parameters": {"a": 2'
    assert extract_tool_calls("required", req, text) == (text, [])  # not streamed: content
    # Streamed, the calls went out as they came and cannot be taken back; the finish reason is the engine's.
    content, calls, finish = stream("required", req, [text[:30], text[30:]], engine_reason="length")
    assert (content, calls, finish) == ("", [("f", '{"a": 1}'), ("f", '{"a": 2')], "length")
    assert stream("required", req, [text[:30], text[30:]])[2] == "stop"  # e.g. a stop string: not "tool_calls"
    # Not a whole array of calls: content when not streamed; streamed, what began as a call stays one.
    for not_calls, streamed_calls in (('[{"name": "f", "param', [("f", "")]),
                                      ('[{"name": "f", "parameters": 1}] x', [("f", "1")]),
                                      ('{"name": "f", "parameters": {}}', []),
                                      ('[{"name": 1, "parameters": {}}]', [])):
        assert extract_tool_calls("required", req, not_calls) == (not_calls, [])
        content = "" if streamed_calls else not_calls
        assert stream("required", req, [not_calls]) == (content, streamed_calls, "stop")
    # A name after the parameters (not what the grammar generates): the arguments wait for it, then go at once.
    late = '[{"parameters": {"late": true}, "name": "f"}]'
    fragments: dict[int, int] = {}
    expected = [("f", '{"late": true}')]
    assert stream("required", req, list(late), deltas_per_call=fragments) == ("", expected, "tool_calls")
    assert fragments == {0: 1} and extract_tool_calls("required", req, late)[1][0].function.arguments == expected[0][1]
    schema = tool_call_constraint(req, "required").json
    assert schema["minItems"] == 1 and "maxItems" not in schema


def test_named_streams_its_arguments_as_they_grow():
    named = request({"type": "function", "function": {"name": "f"}})
    fragments: dict[int, int] = {}
    assert stream("named", named, ['{"a"', "", ": 1}"], deltas_per_call=fragments) == (
        "", [("f", '{"a": 1}')], "tool_calls")
    assert fragments == {0: 2}
    assert extract_tool_calls("named", named, '{"a": 1}')[1][0].function.arguments == '{"a": 1}'
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
    content, whole = extract_tool_calls("required", req, text)
    assert content is None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole] == [
        (call["name"], call["parameters"]) for call in calls]
    bounds = sorted({0, len(text), *(cut for cut in cuts if cut < len(text))})
    pieces = [text[start:end] for start, end in zip(bounds, bounds[1:])]
    assert stream("required", req, pieces) == ("", [(c.function.name, c.function.arguments) for c in whole],
                                               "tool_calls")
