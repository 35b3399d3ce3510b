"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API), served on the chat path: a request
becomes a ChatCompletionRequest (`system` -> a system message, an assistant's `tool_use` blocks -> its tool_calls,
`tool_result` blocks -> tool messages, Anthropic's tools and tool_choice -> OpenAI's), which OpenAIServingChat
serves (chat template, sampling, tool-call constraints and parsing), and its chat completion, or its stream of
chunks, becomes Anthropic's message or Anthropic's event sequence. With --reasoning-parser, the chat path's
reasoning_content becomes a `thinking` block before the others (its signature empty: nothing here signs it)."""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from http import HTTPStatus
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from pydantic_core import from_json

from pagellm.entrypoints.openai.anthropic_errors import anthropic_error
from pagellm.entrypoints.openai.errors import OpenAIServingError, to_error_body
from pagellm.entrypoints.openai.protocol_anthropic import (
    AnthropicContentBlockDeltaEvent,
    AnthropicContentBlockStartEvent,
    AnthropicContentBlockStopEvent,
    AnthropicCountTokensRequest,
    AnthropicInputJSONDelta,
    AnthropicMessage,
    AnthropicMessageDelta,
    AnthropicMessageDeltaEvent,
    AnthropicMessagesRequest,
    AnthropicMessageStartEvent,
    AnthropicMessageStopEvent,
    AnthropicPingEvent,
    AnthropicPromptRequest,
    AnthropicResponseBlock,
    AnthropicStopReason,
    AnthropicTextBlock,
    AnthropicTextDelta,
    AnthropicThinkingBlock,
    AnthropicThinkingDelta,
    AnthropicTokenCount,
    AnthropicToolUseBlock,
    AnthropicUsage,
    sse_event,
)
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatMessageParam, TextContentPart
from pagellm.entrypoints.openai.protocol_responses import ChatCompletionStreamResponse, UsageInfo
from pagellm.entrypoints.openai.protocol_structured import DeltaToolCall, FunctionCall, ToolCall
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.tool_calls import tool_mode
from pagellm.logger import init_logger

logger = init_logger(__name__)

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}  # "tool" names one: OpenAI's named choice


def _text_parts(content: str | list[AnthropicTextBlock]) -> str | list[TextContentPart]:
    return content if isinstance(content, str) else [TextContentPart(type="text", text=b.text) for b in content]


def chat_messages(request: AnthropicPromptRequest) -> list[ChatMessageParam]:
    """The conversation as chat messages. A user message's tool results become tool messages, in their order
    among its text; an assistant's earlier thinking is dropped, as Anthropic drops it from earlier turns."""
    messages = []
    if request.system:
        messages.append(ChatMessageParam(role="system", content=_text_parts(request.system)))
    for message in request.messages:
        blocks = [AnthropicTextBlock(text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            calls = [ToolCall(id=b.id, function=FunctionCall(name=b.name, arguments=json.dumps(b.input)))
                     for b in blocks if isinstance(b, AnthropicToolUseBlock)]
            messages.append(ChatMessageParam(role="assistant", tool_calls=calls or None, content=[
                TextContentPart(type="text", text=b.text) for b in blocks if isinstance(b, AnthropicTextBlock)]))
            continue
        text: list[TextContentPart] = []
        for block in blocks:
            if isinstance(block, AnthropicTextBlock):
                text.append(TextContentPart(type="text", text=block.text))
                continue
            if text:
                messages.append(ChatMessageParam(role="user", content=text))
                text = []
            messages.append(ChatMessageParam(role="tool", tool_call_id=block.tool_use_id,
                                             content=_text_parts(block.content)))
        if text:
            messages.append(ChatMessageParam(role="user", content=text))
    return messages


def to_chat_request(request: AnthropicPromptRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `request` (with its sampling fields if it is a messages request)."""
    choice = request.tool_choice
    fields: dict[str, Any] = {
        "model": request.model, "messages": chat_messages(request),
        "tools": [{"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                    "parameters": tool.input_schema}}
                  for tool in request.tools] if request.tools else None,
        "tool_choice": None if choice is None else (
            {"type": "function", "function": {"name": choice.name}} if choice.type == "tool"
            else _TOOL_CHOICES[choice.type]),
        "parallel_tool_calls": choice is None or not choice.disable_parallel_tool_use}
    thinking = request.thinking
    if thinking is not None and thinking.type == "disabled":
        fields["chat_template_kwargs"] = {"enable_thinking": False}  # Qwen3's switch; other templates ignore it
    if thinking is not None and thinking.type == "enabled":
        fields["thinking_token_budget"] = thinking.budget_tokens
    if isinstance(request, AnthropicMessagesRequest):
        fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences, temperature=request.temperature,
                      top_p=request.top_p, top_k=-1 if request.top_k is None else request.top_k,
                      user=request.metadata.user_id if request.metadata else None, stream=request.stream,
                      stream_options={"include_usage": True} if request.stream else None)
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:  # the Anthropic request's own checks should have caught it: still a 400
        raise RequestValidationError(exc.errors()) from exc


def _check_thinking(chat: OpenAIServingChat, request: AnthropicPromptRequest) -> None:
    if request.thinking is not None and request.thinking.type == "enabled" and chat.reasoning_parser is None:
        raise OpenAIServingError("thinking is not supported: this server splits no reasoning from the output; start "
                                 "it with --reasoning-parser for a model that thinks.", param="thinking")


async def count_tokens(chat: OpenAIServingChat, request: AnthropicCountTokensRequest) -> AnthropicTokenCount:
    """The prompt's tokens as /v1/messages would run it: the chat template over the messages and, unless
    tool_choice is "none" (or the template ignores tools), the tools."""
    chat.model_name(request.model)
    _check_thinking(chat, request)
    chat_request = to_chat_request(request)
    mode = tool_mode(chat_request, chat.tokenizer.supports_tools)
    tools = [tool.model_dump(exclude_none=True) for tool in chat_request.tools] \
        if chat_request.tools and mode != "none" else None
    prompt = await chat.chat_prompt(chat_request.messages, add_generation_prompt=True, tools=tools,
                                    template_kwargs=chat_request.template_kwargs())
    return AnthropicTokenCount(input_tokens=len(prompt["prompt_token_ids"]))


async def create_message(chat: OpenAIServingChat,
                         request: AnthropicMessagesRequest) -> AnthropicMessage | AsyncGenerator[str, None]:
    model = chat.model_name(request.model)
    _check_thinking(chat, request)
    result = await chat.create_chat_completion(to_chat_request(request))
    message_id = f"msg_{uuid.uuid4().hex}"
    if isinstance(result, AsyncGenerator):
        return _stream(result, message_id, model)
    choice = result.choices[0]
    content: list[AnthropicResponseBlock] = []
    if choice.message.reasoning_content:
        content.append(AnthropicThinkingBlock(thinking=choice.message.reasoning_content))
    if choice.message.content:
        content.append(AnthropicTextBlock(text=choice.message.content))
    content += [AnthropicToolUseBlock(id=call.id, name=call.function.name, input=_tool_input(call.function.arguments))
                for call in choice.message.tool_calls]
    stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason)
    return AnthropicMessage(id=message_id, content=content, model=model, stop_reason=stop_reason,
                            stop_sequence=stop_sequence, usage=_usage(result.usage))


def _tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as its input object. Arguments cut short (max_tokens) are read as far as they go, as
    Anthropic's SDK reads a stream's partial JSON; arguments that are no object are an empty input."""
    try:
        value = from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _stop(finish_reason: str | None, stop_reason: int | str | None) -> tuple[AnthropicStopReason, str | None]:
    """Anthropic's stop_reason and stop_sequence for a chat choice's finish_reason and (vLLM's) stop_reason, which
    is the stop string that ended it, if one did."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(usage: UsageInfo) -> AnthropicUsage:
    cached = usage.prompt_tokens_details.cached_tokens
    return AnthropicUsage(input_tokens=usage.prompt_tokens - cached, output_tokens=usage.completion_tokens,
                          cache_read_input_tokens=cached)


class _ContentBlocks:
    """A stream's content blocks: each opens at its first delta and closes when the next opens or the message
    ends, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open_type: str | None = None

    def _start(self, block: AnthropicResponseBlock) -> list[str]:
        events = self.close()
        self.index += 1
        self.open_type = block.type
        return [*events, sse_event(AnthropicContentBlockStartEvent(index=self.index, content_block=block))]

    def thinking(self, text: str) -> list[str]:
        events = [] if self.open_type == "thinking" else self._start(AnthropicThinkingBlock(thinking=""))
        return [*events, sse_event(AnthropicContentBlockDeltaEvent(index=self.index,
                                                                   delta=AnthropicThinkingDelta(thinking=text)))]

    def text(self, text: str) -> list[str]:
        events = [] if self.open_type == "text" else self._start(AnthropicTextBlock(text=""))
        return [*events, sse_event(AnthropicContentBlockDeltaEvent(index=self.index,
                                                                   delta=AnthropicTextDelta(text=text)))]

    def tool_call(self, call: DeltaToolCall) -> list[str]:
        """A delta with an id opens a call (with its name); its arguments arrive whole or in pieces."""
        events = []
        if call.id is not None and call.function is not None and call.function.name is not None:
            events = self._start(AnthropicToolUseBlock(id=call.id, name=call.function.name, input={}))
        if call.function is not None and call.function.arguments:
            events.append(sse_event(AnthropicContentBlockDeltaEvent(
                index=self.index, delta=AnthropicInputJSONDelta(partial_json=call.function.arguments))))
        return events

    def close(self) -> list[str]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [sse_event(AnthropicContentBlockStopEvent(index=self.index))]


async def _stream(chunks: AsyncGenerator[str, None], message_id: str, model: str) -> AsyncGenerator[str, None]:
    """The chat stream's chunks (`data: {json}` events, an error as `{"error": ...}`, then `[DONE]`) as
    Anthropic's events. Its input tokens are known once the chat stream's usage chunk arrives: message_start
    reports 0 and message_delta the final counts (Anthropic's SDK takes a message_delta's counts as totals)."""
    blocks = _ContentBlocks()
    stop: tuple[AnthropicStopReason | None, str | None] = (None, None)
    usage = AnthropicUsage(input_tokens=0, output_tokens=0)
    try:
        yield sse_event(AnthropicMessageStartEvent(message=AnthropicMessage(id=message_id, content=[], model=model,
                                                                            usage=usage)))
        yield sse_event(AnthropicPingEvent())
        async for chunk in chunks:
            data = chunk.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            parsed = json.loads(data)
            if "error" in parsed:  # the chat stream failed after it started; nothing follows but [DONE]
                yield sse_event(anthropic_error(parsed["error"]["message"], parsed["error"]["code"]))
                return
            response = ChatCompletionStreamResponse.model_validate(parsed)
            for choice in response.choices:
                if choice.delta.reasoning_content:
                    for event in blocks.thinking(choice.delta.reasoning_content):
                        yield event
                if choice.delta.content:
                    for event in blocks.text(choice.delta.content):
                        yield event
                for call in choice.delta.tool_calls:
                    for event in blocks.tool_call(call):
                        yield event
                if choice.finish_reason is not None:
                    stop = _stop(choice.finish_reason, choice.stop_reason)
            if response.usage is not None:
                usage = _usage(response.usage)
        for event in blocks.close():
            yield event
        yield sse_event(AnthropicMessageDeltaEvent(delta=AnthropicMessageDelta(stop_reason=stop[0],
                                                                               stop_sequence=stop[1]), usage=usage))
        yield sse_event(AnthropicMessageStopEvent())
    except Exception as exc:  # the response has started: report the error as the stream's last event
        body = to_error_body(exc)
        if body.error.code == HTTPStatus.INTERNAL_SERVER_ERROR:
            logger.error("A streamed Anthropic message failed", exc_info=exc)
        yield sse_event(anthropic_error(body.error.message, body.error.code))
    finally:
        await chunks.aclose()
