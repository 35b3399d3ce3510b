"""POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI's Responses API), served on the chat path: a
request becomes a ChatCompletionRequest (`instructions` -> a system message, message items -> messages,
`function_call` items -> an assistant's tool_calls, `function_call_output` items -> tool messages, flat function
tools -> chat tools, `text.format` -> response_format, `reasoning.effort` -> reasoning_effort), which
OpenAIServingChat serves (chat template, sampling, tool-call constraints and parsing, --reasoning-parser), and its
chat completion, or its stream of chunks, becomes a response object with output items (reasoning, message,
function_call), or the Responses API's event sequence.

Responses are stateless unless the request sets `store`: a stored response is kept, with the input items it saw,
in an in-memory LRU of `max_stored` entries (ServerConfig.max_stored_responses); `previous_response_id` continues
one (its input and output items come before the new input; its instructions do not carry over, as OpenAI's)."""
from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from pagellm.entrypoints.openai.errors import OpenAIServingError, to_error_body
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatMessageParam, TextContentPart
from pagellm.entrypoints.openai.protocol_responses import ChatMessage, UsageInfo
from pagellm.entrypoints.openai.protocol_responses_api import (
    DEFAULT_MAX_STORED_RESPONSES,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    InputItem,
    MessageItem,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponsesRequest,
    TextConfig,
)
from pagellm.entrypoints.openai.protocol_responses_api_output import (
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    ResponseDeleted,
    ResponseObject,
    ResponseUsage,
    new_id,
)
from pagellm.entrypoints.openai.protocol_structured import ToolCall
from pagellm.entrypoints.openai.responses_stream import ResponseEvents, parse_chat_chunks
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.logger import init_logger

logger = init_logger(__name__)

# The chat request's fields as this API names them, for errors the chat path raises.
_FIELD_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text",
                "reasoning_effort": "reasoning", "chat_template_kwargs": "reasoning"}


# What a conversation holds: the input items, and the output items of the responses it continues.
ConversationItem = InputItem | OutputItem


def _parts(text_parts: list[Any]) -> list[TextContentPart]:
    return [TextContentPart(type="text", text=part.text) for part in text_parts]


def chat_messages(instructions: str | None, items: list[ConversationItem]) -> list[ChatMessageParam]:
    """The conversation as chat messages. A function_call right after an assistant message (or another call) joins
    its tool_calls; earlier reasoning is dropped, as chat templates drop the reasoning of earlier turns."""
    messages = [ChatMessageParam(role="system", content=instructions)] if instructions else []
    for item in items:
        if isinstance(item, MessageItem | OutputMessage):
            content = item.content if isinstance(item.content, str) else _parts(item.content)
            messages.append(ChatMessageParam(role=item.role, content=content))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function={"name": item.name, "arguments": item.arguments})
            if messages and messages[-1].role == "assistant":
                messages[-1].tool_calls = [*(messages[-1].tool_calls or []), call]
            else:
                messages.append(ChatMessageParam(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessageParam(role="tool", tool_call_id=item.call_id, content=item.text))
    return messages


def to_chat_request(request: ResponsesRequest, items: list[ConversationItem]) -> ChatCompletionRequest:
    messages = chat_messages(request.instructions, items)
    if not messages:
        raise OpenAIServingError("input holds no message, function call or function call output (reasoning items "
                                 "are dropped); send at least one.", param="input")
    choice = request.tool_choice
    format_ = request.text.format if request.text is not None else None
    fields: dict[str, Any] = {
        "model": request.model, "messages": messages,
        "tools": [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                  for tool in request.tools] if request.tools else None,
        "tool_choice": {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, FunctionToolChoice) else choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "response_format": None if format_ is None or format_.type == "text" else (
            {"type": "json_object"} if format_.type == "json_object" else
            {"type": "json_schema", "json_schema": {"name": format_.name, "schema": format_.json_schema,
                                                    "strict": format_.strict}}),
        "max_completion_tokens": request.max_output_tokens, "temperature": request.temperature,
        "top_p": request.top_p, "user": request.user, "stream": request.stream,
        "stream_options": {"include_usage": True} if request.stream else None,
        "reasoning_effort": request.reasoning.effort if request.reasoning is not None else None}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # the Responses request's own checks should have caught it: still a 400
        raise RequestValidationError(exc.errors()) from exc


def renamed_error(exc: OpenAIServingError) -> OpenAIServingError:
    """An error of the chat path naming the field as this API does (max_tokens -> max_output_tokens, ...)."""
    param = _FIELD_NAMES.get(exc.param or "", exc.param)
    message = re.sub(r"\bmax_tokens\b", "max_output_tokens", exc.message)
    return OpenAIServingError(message, exc.status, param)


def output_items(message: ChatMessage, incomplete: bool) -> list[OutputItem]:
    """A chat message as output items: its reasoning, its text, its calls, in that order; the last text item is
    incomplete when the output was cut short."""
    items: list[OutputItem] = []
    if message.reasoning_content:
        items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=message.reasoning_content)],
                                   status="completed"))
    if message.content:
        items.append(OutputMessage(id=new_id("msg"), content=[OutputText(text=message.content)]))
    if incomplete and items and not message.tool_calls:  # the text cut short (a cut call is dropped whole)
        items[-1].status = "incomplete"
    items += [FunctionCallItem(id=new_id("fc"), call_id=call.id, name=call.function.name,
                               arguments=call.function.arguments, status="completed")
              for call in message.tool_calls]
    return items


class ResponseStore:
    """Stored responses, each with the input items it saw (those of the responses it continues included), the
    least recently used dropped first beyond `max_size`."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._entries: OrderedDict[str, tuple[ResponseObject, list[ConversationItem]]] = OrderedDict()

    def put(self, response: ResponseObject, items: list[ConversationItem]) -> None:
        self._entries[response.id] = (response, items)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> tuple[ResponseObject, list[ConversationItem]]:
        entry = self._entries.get(response_id)
        if entry is None:
            raise OpenAIServingError(f"Response with id '{response_id}' not found (responses are kept only with "
                                     f"store: true, and the oldest are dropped beyond {self.max_size}).",
                                     HTTPStatus.NOT_FOUND, param)
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, max_stored: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        self.chat = chat
        self.store = ResponseStore(max_stored)

    def retrieve(self, response_id: str) -> ResponseObject:
        return self.store.get(response_id)[0]

    def delete(self, response_id: str) -> ResponseDeleted:
        self.store.delete(response_id)
        return ResponseDeleted(id=response_id)

    async def create_response(self, request: ResponsesRequest) -> ResponseObject | AsyncGenerator[str, None]:
        model = self.chat.model_name(request.model)
        history: list[ConversationItem] = []
        if request.previous_response_id is not None:
            previous, previous_items = self.store.get(request.previous_response_id, "previous_response_id")
            history = [*previous_items, *previous.output]
        new_items: list[ConversationItem] = [MessageItem(role="user", content=request.input)] \
            if isinstance(request.input, str) else list(request.input)
        items = [*history, *new_items]
        try:
            result = await self.chat.create_chat_completion(to_chat_request(request, items))
        except OpenAIServingError as exc:
            raise renamed_error(exc) from exc
        response = self._response(request, model, "in_progress")
        if isinstance(result, AsyncGenerator):
            return self._stream(request, response, items, result)
        choice = result.choices[0]
        incomplete = choice.finish_reason == "length"
        response.output = output_items(choice.message, incomplete)
        await self._finish(response, incomplete, result.usage, choice.message.reasoning_content)
        if request.store:
            self.store.put(response, items)
        return response

    @staticmethod
    def _response(request: ResponsesRequest, model: str, status: str) -> ResponseObject:
        return ResponseObject(
            id=new_id("resp"), status=status, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, model=model,
            parallel_tool_calls=request.parallel_tool_calls, previous_response_id=request.previous_response_id,
            reasoning=request.reasoning, store=request.store, temperature=request.temperature,
            text=request.text or TextConfig(),
            tool_choice=request.tool_choice or ("auto" if request.tools else "none"), tools=request.tools or [],
            top_p=request.top_p, user=request.user, metadata=request.metadata or {})

    async def _finish(self, response: ResponseObject, incomplete: bool, usage: UsageInfo,
                      reasoning: str | None) -> None:
        """The status, incomplete_details and usage of a response whose output is complete. Its reasoning tokens
        are counted by encoding the reasoning text again (the engine counts only all output tokens)."""
        response.status = "incomplete" if incomplete else "completed"
        response.incomplete_details = IncompleteDetails(reason="max_output_tokens") if incomplete else None
        reasoning_tokens = len(await self.chat.tokenizer.encode(reasoning, False)) if reasoning else 0
        response.usage = ResponseUsage(
            input_tokens=usage.prompt_tokens, output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens_details={"reasoning_tokens": min(reasoning_tokens, usage.completion_tokens)})

    async def _stream(self, request: ResponsesRequest, response: ResponseObject, items: list[ConversationItem],
                      chunks: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
        events = ResponseEvents(response)
        try:
            yield events.lifecycle("response.created")
            yield events.lifecycle("response.in_progress")
            async for parsed in parse_chat_chunks(chunks):
                if "error" in parsed:  # the chat stream failed after it started; nothing follows
                    yield events.error(parsed["error"]["message"], str(parsed["error"]["code"]),
                                       parsed["error"].get("param"))
                    return
                for event in events.chunk(parsed):
                    yield event
            for event in events.close():
                yield event
            incomplete = events.finish_reason == "length"
            response.output = events.output
            reasoning = "".join(item.content[0].text for item in response.output
                                if isinstance(item, ReasoningItem) and item.content)
            await self._finish(response, incomplete, events.usage or UsageInfo(), reasoning)
            if request.store:
                self.store.put(response, items)
            yield events.lifecycle("response.incomplete" if incomplete else "response.completed")
        except Exception as exc:  # the response has started: report the error as the stream's last event
            body = to_error_body(exc)
            if body.error.code == HTTPStatus.INTERNAL_SERVER_ERROR:
                logger.error("A streamed response failed", exc_info=exc)
            yield events.error(body.error.message, str(body.error.code), body.error.param)
        finally:
            await chunks.aclose()

