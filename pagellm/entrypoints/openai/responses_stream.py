"""The Responses API's event sequence, built from a chat completion stream's chunks (serving_responses.py): each
output item (reasoning, message, function_call) opens with response.output_item.added (and, for text, a
content_part.added), grows by deltas (reasoning_text, output_text, function_call_arguments) and closes with its
`.done` events when the next item opens or the output ends; every event carries the next sequence_number. The
items' order and texts are those of the non-streamed response: the chat stream's deltas add up to its message."""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from pagellm.entrypoints.openai.protocol_responses import ChatCompletionStreamResponse, UsageInfo
from pagellm.entrypoints.openai.protocol_responses_api import FunctionCallItem, OutputText, ReasoningItem, ReasoningText
from pagellm.entrypoints.openai.protocol_responses_api_output import (
    ContentPartEvent,
    FunctionCallArgumentsEvent,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    ResponseErrorEvent,
    ResponseLifecycleEvent,
    ResponseObject,
    TextDeltaEvent,
    TextDoneEvent,
    new_id,
    sse_event,
)
from pagellm.entrypoints.openai.protocol_structured import DeltaToolCall


async def parse_chat_chunks(chunks: AsyncIterator[str]) -> AsyncGenerator[dict[str, Any], None]:
    """The chat stream's `data: {json}` events as objects, up to `[DONE]`."""
    async for chunk in chunks:
        data = chunk.removeprefix("data: ").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


class ResponseEvents:
    """One response's events. `output` holds the items as they were closed; `finish_reason` and `usage` are the
    chat stream's."""

    def __init__(self, response: ResponseObject) -> None:
        self.response = response
        self.output: list[OutputItem] = []
        self.finish_reason: str | None = None
        self.usage: UsageInfo | None = None
        self._sequence_number = -1
        self._open: OutputItem | None = None
        self._open_text = ""  # the open reasoning or message item's text so far

    def _next(self) -> int:
        self._sequence_number += 1
        return self._sequence_number

    def lifecycle(self, kind: str) -> str:
        return sse_event(ResponseLifecycleEvent(type=kind, sequence_number=self._next(), response=self.response))

    def error(self, message: str, code: str | None, param: str | None) -> str:
        return sse_event(ResponseErrorEvent(sequence_number=self._next(), code=code, message=message, param=param))

    def chunk(self, parsed: dict[str, Any]) -> list[str]:
        response = ChatCompletionStreamResponse.model_validate(parsed)
        events = []
        for choice in response.choices:
            if choice.delta.reasoning_content:
                events += self._text(choice.delta.reasoning_content, reasoning=True)
            if choice.delta.content:
                events += self._text(choice.delta.content, reasoning=False)
            for call in choice.delta.tool_calls:
                events += self._tool_call(call)
            self.finish_reason = choice.finish_reason or self.finish_reason
        self.usage = response.usage or self.usage
        return events

    def _add(self, item: OutputItem) -> list[str]:
        events = self.close()
        self._open, self._open_text = item, ""
        return [*events, sse_event(OutputItemEvent(type="response.output_item.added", sequence_number=self._next(),
                                                   output_index=len(self.output), item=item))]

    def _text(self, delta: str, reasoning: bool) -> list[str]:
        kind = ReasoningItem if reasoning else OutputMessage
        events: list[str] = []
        if not isinstance(self._open, kind):
            item = ReasoningItem(id=new_id("rs"), content=[], status="in_progress") if reasoning else \
                OutputMessage(id=new_id("msg"), status="in_progress")
            part = ReasoningText(text="") if reasoning else OutputText(text="")
            events = [*self._add(item), sse_event(ContentPartEvent(
                type="response.content_part.added", sequence_number=self._next(), item_id=item.id,
                output_index=len(self.output), content_index=0, part=part))]
        self._open_text += delta
        events.append(sse_event(TextDeltaEvent(
            type="response.reasoning_text.delta" if reasoning else "response.output_text.delta",
            sequence_number=self._next(), item_id=self._open.id, output_index=len(self.output), content_index=0,
            delta=delta, logprobs=None if reasoning else [])))
        return events

    def _tool_call(self, call: DeltaToolCall) -> list[str]:
        """A delta with an id opens a call (with its name); its arguments arrive whole or in pieces."""
        events = []
        if call.id is not None and call.function is not None and call.function.name is not None:
            events = self._add(FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.function.name,
                                                arguments="", status="in_progress"))
        if call.function is not None and call.function.arguments and isinstance(self._open, FunctionCallItem):
            self._open.arguments += call.function.arguments
            events.append(sse_event(FunctionCallArgumentsEvent(
                type="response.function_call_arguments.delta", sequence_number=self._next(),
                item_id=self._open.id, output_index=len(self.output), delta=call.function.arguments)))
        return events

    def close(self) -> list[str]:
        """Close the open item: complete, unless the output ends here cut short (a text item; a call cut short
        never opened)."""
        item, index = self._open, len(self.output)
        if item is None:
            return []
        self._open = None
        events = []
        if isinstance(item, FunctionCallItem):
            events.append(sse_event(FunctionCallArgumentsEvent(
                type="response.function_call_arguments.done", sequence_number=self._next(), item_id=item.id,
                output_index=index, arguments=item.arguments, name=item.name)))
            item.status = "completed"
        else:
            reasoning = isinstance(item, ReasoningItem)
            part = ReasoningText(text=self._open_text) if reasoning else OutputText(text=self._open_text)
            events += [
                sse_event(TextDoneEvent(type="response.reasoning_text.done" if reasoning else
                                        "response.output_text.done", sequence_number=self._next(), item_id=item.id,
                                        output_index=index, content_index=0, text=self._open_text,
                                        logprobs=None if reasoning else [])),
                sse_event(ContentPartEvent(type="response.content_part.done", sequence_number=self._next(),
                                           item_id=item.id, output_index=index, content_index=0, part=part))]
            item.content = [part]  # type: ignore[assignment]  # the part's type matches the item's
            ended = self.finish_reason is not None
            item.status = "incomplete" if ended and self.finish_reason == "length" else "completed"
        self.output.append(item)
        return [*events, sse_event(OutputItemEvent(type="response.output_item.done", sequence_number=self._next(),
                                                   output_index=index, item=item))]
