"""Tool-call extraction on its own: whole texts and the same texts streamed in every split give the same calls and
content (Hermes blocks under "auto", the JSON array under "required", argument fragments for a named function)."""
from __future__ import annotations

import json

import pytest

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.tool_calls import ToolCallStreamer, extract_tool_calls, tool_call_constraint

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def request(tool_choice) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice=tool_choice)


def stream(mode: str, req: ChatCompletionRequest, pieces: list[str]) -> tuple[str, list[tuple[str, str]], str]:
    streamer = ToolCallStreamer(mode, req)
    content, calls = "", {}
    for i, piece in enumerate(pieces):
        delta_content, deltas = streamer.feed(piece, i == len(pieces) - 1)
        content += delta_content or ""
        for delta in deltas:
            entry = calls.setdefault(delta.index, ["", ""])
            entry[0] += delta.function.name or ""
            entry[1] += delta.function.arguments or ""
    return content, [tuple(calls[i]) for i in sorted(calls)], streamer.finish_reason("stop")


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


def test_required_and_named():
    req = request("required")
    text = '[{"name": "f", "parameters": {"a": [1, 2]}}]'
    content, calls = extract_tool_calls("required", req, text)
    assert content is None and [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("f", {"a": [1, 2]})]
    assert stream("required", req, [text[:5], text[5:]])[1] == [(calls[0].function.name, calls[0].function.arguments)]
    assert extract_tool_calls("required", req, text[:-3]) == (text[:-3], [])  # cut short: content
    schema = tool_call_constraint(req, "required").json
    assert schema["minItems"] == 1 and "maxItems" not in schema
    named = request({"type": "function", "function": {"name": "f"}})
    assert stream("named", named, ['{"a"', ": 1}"]) == ("", [("f", '{"a": 1}')], "tool_calls")
    assert tool_call_constraint(named, "named").json == {"type": "object"}
