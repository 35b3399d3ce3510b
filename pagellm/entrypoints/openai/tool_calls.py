"""Tool calls for /v1/chat/completions: the constraint a forced call puts on the output, and turning the generated
text into OpenAI `tool_calls`, whole or as stream deltas.

- a named function (`tool_choice: {"type": "function", ...}`): the output is the arguments, constrained to the
  function's parameter schema; streamed as they are generated;
- `"required"`: the output is a JSON array of `{"name", "parameters"}` objects, one of the tools' schemas each (vLLM's
  format), parsed as it grows by tool_call_parser.py; a call's arguments are the raw text of its parameters;
- both are compact JSON (no free whitespace);
- both stream as OpenAI does: a call's first delta carries its index, id, type and name with empty arguments, the
  next ones its arguments in the pieces they were generated in, and the stream reassembles to the non-streamed
  call byte for byte;
- an array cut short (max_tokens, a stop string) returns the calls completed before the cut and drops the
  incomplete one, keeping the engine's finish reason ("tool_calls" only for a whole array). So that a stream
  agrees, a `"required"` call's deltas are held until its object closes, then sent together: a client never sees
  a call that does not complete, at the cost of receiving each call at once rather than as it is generated
  (OpenAI's stream has no way to take back a call that was announced);
- `"auto"` (when the chat template renders tools): free text, in which Hermes-style `<tool_call>{"name", "arguments"}
  </tool_call>` blocks become calls; text before the first block is content and is streamed at once, the rest
  is held until the end. A last block cut short (unterminated, its JSON incomplete) is dropped; a block that is
  not a call leaves the whole text content, as does a cut block with no whole call before it;
- `"none"`: plain content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_structured import (
    ChatCompletionNamedToolChoiceParam,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagellm.entrypoints.openai.tool_call_parser import RequiredCallsParser
from pagellm.sampling_params import StructuredOutputsParams

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


def tool_mode(request: ChatCompletionRequest, template_supports_tools: bool) -> str:
    """"named", "required", "auto" or "none" ("auto" falls back to "none" when the template ignores tools)."""
    choice = request.effective_tool_choice
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        return "named"
    if choice == "auto" and not template_supports_tools:
        return "none"
    return choice


def tool_call_constraint(request: ChatCompletionRequest, mode: str) -> StructuredOutputsParams | None:
    """The constraint a forced tool call puts on the output (None unless `mode` forces one). The JSON is compact, as
    OpenAI's arguments are: given free whitespace, a small model spends its tokens on newlines and indents (SmolLM2
    made valid calls within 64 tokens in 92% / 87% of `bench structured --workload tools` requests at temperature
    0 / 0.7 with it, 100% / 99% without)."""
    if mode == "named":
        name = request.tool_choice.function.name
        tool = next(t for t in request.tools if t.function.name == name)
        return StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT, disable_any_whitespace=True)
    if mode == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": t.function.parameters or _ANY_OBJECT},
                  "required": ["name", "parameters"]} for t in request.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not request.parallel_tool_calls:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array, disable_any_whitespace=True)
    return None


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _tool_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=text))


def _tool_finish_reason(engine_reason: str | None, whole_calls: bool) -> str | None:
    """"tool_calls" when the output was whole calls and ended on its own (calls cut short keep "length" or "stop")."""
    return "tool_calls" if engine_reason == "stop" and whole_calls else engine_reason


class ExtractedToolCalls(NamedTuple):
    content: str | None
    tool_calls: list[ToolCall]
    cut_short: bool = False  # an incomplete last call was dropped

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return _tool_finish_reason(engine_reason, bool(self.tool_calls) and not self.cut_short)


def _parse_required(text: str) -> ExtractedToolCalls:
    """The complete calls of the array; the text is content when it made none (or is not an array of calls)."""
    parser = RequiredCallsParser()
    parser.feed(text)
    calls = parser.complete_calls()
    if not calls:
        return ExtractedToolCalls(text, [])
    return ExtractedToolCalls(None, [_tool_call(call.name, call.arguments) for call in calls], not parser.finished)


def _parse_hermes(text: str) -> ExtractedToolCalls:
    """Content before the first block, and the blocks' calls."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return ExtractedToolCalls(text, [])
    calls, cut_short = [], False
    for match in _HERMES_CALL.finditer(text, start):
        terminated = match.group(1) is not None
        try:
            call = json.loads(match.group(1) if terminated else match.group(2))
        except ValueError:
            if terminated:
                return ExtractedToolCalls(text, [])
            cut_short = True  # the last block, cut mid-JSON
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return ExtractedToolCalls(text, [])
        calls.append(_tool_call(call["name"], call.get("arguments", {})))
    if not calls:
        return ExtractedToolCalls(text, [])
    return ExtractedToolCalls(text[:start] or None, calls, cut_short)


def extract_tool_calls(mode: str, request: ChatCompletionRequest, text: str) -> ExtractedToolCalls:
    """The content and tool calls of a whole generated text."""
    if mode == "named":
        return ExtractedToolCalls(None, [_tool_call(request.tool_choice.function.name, text)])
    if mode == "required":
        return _parse_required(text)
    if mode == "auto":
        return _parse_hermes(text)
    return ExtractedToolCalls(text, [])


def _opening_delta(index: int, name: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=_call_id(), type="function",
                         function=DeltaFunctionCall(name=name, arguments=""))


def _arguments_delta(index: int, arguments: str) -> DeltaToolCall:
    return DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=arguments))


def _whole_delta(index: int, call: ToolCall) -> DeltaToolCall:
    return DeltaToolCall(index=index, id=call.id, type="function",
                         function=DeltaFunctionCall(name=call.function.name, arguments=call.function.arguments))


def _partial_start(text: str) -> int:
    """Where a suffix of `text` that could begin TOOL_CALL_START starts (len(text) if none)."""
    for size in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if TOOL_CALL_START.startswith(text[-size:]):
            return len(text) - size
    return len(text)


@dataclass
class ToolCallStreamer:
    """One choice's stream: turns text deltas into (content delta, tool-call deltas)."""

    mode: str
    request: ChatCompletionRequest
    text: str = ""  # everything generated so far
    num_sent_calls: int = 0
    arguments_sent: int = 0  # named: characters of the arguments sent
    content_sent: int = 0  # auto: characters of `text` already sent as content
    calls_started: bool = False  # auto: TOOL_CALL_START seen
    cut_short: bool = False  # auto: the last block was cut short and dropped
    parser: RequiredCallsParser = field(default_factory=RequiredCallsParser)  # required
    # required: per call not yet sent, the length of its arguments after each delta that grew them (from 0)
    held_ends: list[list[int]] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if self.mode == "none":
            return delta, []
        self.text += delta
        if self.mode == "named":
            return None, self._feed_named()
        if self.mode == "required":
            return self._feed_required(delta, finished)
        return self._feed_auto(finished)

    def _feed_named(self) -> list[DeltaToolCall]:
        deltas = []
        if not self.num_sent_calls:
            self.num_sent_calls = 1
            deltas.append(_opening_delta(0, self.request.tool_choice.function.name))
        if len(self.text) > self.arguments_sent:
            deltas.append(_arguments_delta(0, self.text[self.arguments_sent:]))
            self.arguments_sent = len(self.text)
        return deltas

    def _feed_required(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.parser.feed(delta)
        for index in range(self.num_sent_calls, len(self.parser.calls)):
            if index == len(self.held_ends):
                self.held_ends.append([0])
            if len(self.parser.calls[index].arguments) > self.held_ends[index][-1]:
                self.held_ends[index].append(len(self.parser.calls[index].arguments))
        deltas = []
        for call in self.parser.complete_calls()[self.num_sent_calls:]:  # each call once it completes
            ends = self.held_ends[self.num_sent_calls]
            deltas.append(_opening_delta(self.num_sent_calls, call.name))
            deltas += [_arguments_delta(self.num_sent_calls, call.arguments[start:end])
                       for start, end in zip(ends, ends[1:])]
            self.num_sent_calls += 1
        if finished and not self.num_sent_calls:  # no call completed: the text is content, as when not streamed
            return self.text, []
        return None, deltas

    def _feed_auto(self, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if not self.calls_started:
            start = self.text.find(TOOL_CALL_START, self.content_sent)
            self.calls_started = start >= 0
            safe = start if start >= 0 else (len(self.text) if finished else _partial_start(self.text))
            content, self.content_sent = self.text[self.content_sent:safe], safe
            if not finished or not self.calls_started:
                return content or None, []
        else:
            content = ""
            if not finished:
                return None, []
        tail = self.text[self.content_sent:]
        extracted = _parse_hermes(tail)
        if not extracted.tool_calls:
            return (content + tail) or None, []
        self.num_sent_calls, self.cut_short = len(extracted.tool_calls), extracted.cut_short
        return content or None, [_whole_delta(i, call) for i, call in enumerate(extracted.tool_calls)]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.mode == "required":
            return _tool_finish_reason(engine_reason, self.parser.finished)
        return _tool_finish_reason(engine_reason, self.num_sent_calls > 0 and not self.cut_short)
