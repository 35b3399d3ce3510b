"""Tool calls for /v1/chat/completions: the constraint a forced call puts on the output, and turning the generated
text into OpenAI `tool_calls`, whole or as stream deltas.

- a named function (`tool_choice: {"type": "function", ...}`): the output is the arguments, constrained to the
  function's parameter schema;
- `"required"`: the output is a JSON array of `{"name", "parameters"}` objects, one of the tools' schemas each (vLLM's
  format), parsed as it grows by tool_call_parser.py; a call's arguments are the raw text of its parameters;
- both stream as OpenAI does: a call's first delta carries its index, id, type and name with empty arguments, the
  next ones its arguments as they are generated, and the stream reassembles to the non-streamed call byte for
  byte;
- `"auto"` (when the chat template renders tools): free text, in which Hermes-style `<tool_call>{"name", "arguments"}
  </tool_call>` blocks become calls; text before the first block is content and is streamed at once, the rest
  is held until the end. Text that does not parse as calls stays content;
- `"none"`: plain content.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_structured import (ChatCompletionNamedToolChoiceParam, DeltaFunctionCall,
                                                            DeltaToolCall, FunctionCall, ToolCall)
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
    """The constraint a forced tool call puts on the output (None unless `mode` forces one)."""
    if mode == "named":
        name = request.tool_choice.function.name
        tool = next(t for t in request.tools if t.function.name == name)
        return StructuredOutputsParams(json=tool.function.parameters or _ANY_OBJECT)
    if mode == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                 "parameters": t.function.parameters or _ANY_OBJECT},
                  "required": ["name", "parameters"]} for t in request.tools]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not request.parallel_tool_calls:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)
    return None


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _tool_call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=_call_id(), function=FunctionCall(name=name, arguments=text))


def _parse_required(text: str) -> list[ToolCall] | None:
    """The calls of a whole array; None when it was cut short (max_tokens, a stop string): the text stays content."""
    parser = RequiredCallsParser()
    parser.feed(text)
    calls = parser.complete_calls()
    return [_tool_call(call.name, call.arguments) for call in calls] if calls else None


def _parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """(content before the first call, calls); ([text], []) if any block is not a call."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for match in _HERMES_CALL.finditer(text, start):
        try:
            call = json.loads(match.group(1) if match.group(1) is not None else match.group(2))
            calls.append(_tool_call(call["name"], call.get("arguments", {})))
        except (ValueError, TypeError, KeyError):
            return text, []
    return text[:start] or None, calls


def extract_tool_calls(mode: str, request: ChatCompletionRequest, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, tool calls) of a whole generated text."""
    if mode == "named":
        return None, [_tool_call(request.tool_choice.function.name, text)]
    if mode == "required":
        calls = _parse_required(text)
        return (None, calls) if calls else (text, [])
    if mode == "auto":
        return _parse_hermes(text)
    return text, []


def _delta(index: int, call: ToolCall) -> DeltaToolCall:
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
    content_sent: int = 0  # auto: characters of `text` already sent as content
    calls_started: bool = False  # auto: TOOL_CALL_START seen
    parser: RequiredCallsParser = field(default_factory=RequiredCallsParser)  # required
    arguments_sent: list[int] = field(default_factory=list)  # named, required: per call, characters sent

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        if self.mode == "none":
            return delta, []
        self.text += delta
        if self.mode == "named":
            return None, self._call_deltas(0, self.request.tool_choice.function.name, self.text)
        if self.mode == "required":
            return self._feed_required(delta, finished)
        return self._feed_auto(finished)

    def _feed_required(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.parser.feed(delta)
        deltas = [d for index, call in enumerate(self.parser.calls)
                  for d in self._call_deltas(index, call.name, call.arguments)]
        if finished and not self.num_sent_calls:  # no call began: the text is content, as when not streamed
            return self.text, []
        return None, deltas

    def _call_deltas(self, index: int, name: str | None, arguments: str) -> list[DeltaToolCall]:
        """What is new of call `index`: its opening delta once its name is known, then its new arguments text."""
        deltas = []
        if index == self.num_sent_calls:
            if name is None:
                return []
            self.num_sent_calls += 1
            self.arguments_sent.append(0)
            deltas.append(DeltaToolCall(index=index, id=_call_id(), type="function",
                                        function=DeltaFunctionCall(name=name, arguments="")))
        if len(arguments) > self.arguments_sent[index]:
            deltas.append(DeltaToolCall(index=index, function=DeltaFunctionCall(
                arguments=arguments[self.arguments_sent[index]:])))
            self.arguments_sent[index] = len(arguments)
        return deltas

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
        _, calls = _parse_hermes(tail)
        if not calls:
            return (content + tail) or None, []
        self.num_sent_calls = len(calls)
        return content or None, [_delta(i, call) for i, call in enumerate(calls)]

    def finish_reason(self, engine_reason: str | None) -> str | None:
        # "required": "tool_calls" only for a whole array, as when not streamed (a stop string may cut it short).
        made_calls = self.parser.complete_calls() is not None if self.mode == "required" else self.num_sent_calls > 0
        return tool_finish_reason(engine_reason, made_calls)


def tool_finish_reason(engine_reason: str | None, made_calls: bool) -> str | None:
    """"tool_calls" when calls were made and the output was not cut short (a truncated call keeps "length")."""
    return "tool_calls" if engine_reason == "stop" and made_calls else engine_reason
