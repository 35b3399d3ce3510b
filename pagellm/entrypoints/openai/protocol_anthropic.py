"""Pydantic models of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`): the
requests as Anthropic's clients send them, the message, its stream events and the error body as they parse them.
serving_messages.py maps a request onto the chat path.

Validation as on the OpenAI routes: finite floats, Anthropic's ranges, content blocks told apart by their `type`
(an image, a document or a server tool is a 400 naming where it is), and fields that would change the result but
are not implemented are refused with a 400 naming them. Hints that change nothing here (`cache_control`,
`service_tier`, `metadata`, ...) are accepted."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol import (
    MAX_STOP_STRINGS,
    MAX_TOOLS,
    Int64,
    PositiveInt64,
    RequestModel,
)
from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel

AnthropicStopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# ---- content blocks (in requests and responses) -----------------------------------------------------------------
class AnthropicTextBlock(OpenAIBaseModel):
    type: Literal["text"] = "text"
    text: str


class AnthropicToolUseBlock(OpenAIBaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class AnthropicToolResultBlock(OpenAIBaseModel):
    type: Literal["tool_result"] = "tool_result"
    tool_use_id: str
    content: str | list[AnthropicTextBlock] = ""
    is_error: bool = False


class AnthropicThinkingBlock(OpenAIBaseModel):
    type: Literal["thinking"] = "thinking"
    thinking: str
    signature: str = ""  # Anthropic's proof that it wrote the thinking; nothing here checks one


class AnthropicRedactedThinkingBlock(OpenAIBaseModel):
    type: Literal["redacted_thinking"] = "redacted_thinking"
    data: str


AnthropicContentBlock = Annotated[AnthropicTextBlock | AnthropicToolUseBlock | AnthropicToolResultBlock
                                  | AnthropicThinkingBlock | AnthropicRedactedThinkingBlock,
                                  Field(discriminator="type")]
AnthropicResponseBlock = Annotated[AnthropicTextBlock | AnthropicToolUseBlock | AnthropicThinkingBlock,
                                   Field(discriminator="type")]


# ---- requests ---------------------------------------------------------------------------------------------------
class AnthropicMessageParam(OpenAIBaseModel):
    role: Literal["user", "assistant"]
    content: str | list[AnthropicContentBlock]

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> AnthropicMessageParam:
        allowed = {"user": {"text", "tool_result"},
                   "assistant": {"text", "tool_use", "thinking", "redacted_thinking"}}[self.role]
        for block in self.content if isinstance(self.content, list) else []:
            if block.type not in allowed:
                raise PydanticCustomError("invalid_field", "{field}: a {role} message cannot hold a {type} block",
                                          {"field": "content", "role": self.role, "type": block.type})
        return self


class AnthropicTool(OpenAIBaseModel):
    type: Literal["custom"] | None = None  # Anthropic's server tools (web search, ...) are not served here
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class AnthropicToolChoice(OpenAIBaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool = False


class AnthropicThinkingConfig(OpenAIBaseModel):
    """"enabled" needs the server's --reasoning-parser; "disabled" asks the template not to think (Qwen3's
    enable_thinking); "adaptive" leaves it to the template."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: PositiveInt64 | None = None  # vLLM's thinking_token_budget


class AnthropicMetadata(OpenAIBaseModel):
    user_id: str | None = Field(default=None, max_length=256)


class AnthropicPromptRequest(RequestModel):
    """What both routes read: the conversation, the tools and the thinking setting (count_tokens' whole body)."""

    # Field -> why it is refused when set to anything but None.
    unsupported_fields: ClassVar[dict[str, str]] = {
        "container": "code-execution containers are not supported",
        "mcp_servers": "MCP servers are not supported",
        "context_management": "context management is not implemented",
        "output_config": "output_config (effort, structured output formats) is not implemented",
    }

    model: str
    messages: list[AnthropicMessageParam] = Field(min_length=1)
    system: str | list[AnthropicTextBlock] | None = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinkingConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in cls.unsupported_fields.items():
                if data.get(name) is not None:
                    raise PydanticCustomError("unsupported_field", "{field} is not supported: {reason}",
                                              {"field": name, "reason": reason})
        return data

    @model_validator(mode="after")
    def _consistent(self) -> AnthropicPromptRequest:
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool"):
            if not self.tools:
                raise PydanticCustomError("invalid_field", "{field} needs tools to choose from",
                                          {"field": "tool_choice"})
            if choice.type == "tool" and choice.name not in {tool.name for tool in self.tools}:
                raise PydanticCustomError("invalid_field", "{field} names tool {name!r}, which is not in tools",
                                          {"field": "tool_choice", "name": choice.name})
        last = self.messages[-1]
        if last.role == "assistant":
            raise PydanticCustomError("unsupported_field", "{field}: a final assistant message (a prefill to "
                                      "continue) is not supported; end with a user message", {"field": "messages"})
        return self


class AnthropicMessagesRequest(AnthropicPromptRequest):
    max_tokens: PositiveInt64
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None  # Anthropic's range; its default is 1
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_k: Int64 | None = None
    metadata: AnthropicMetadata | None = None
    stream: bool = False


class AnthropicCountTokensRequest(AnthropicPromptRequest):
    pass


# ---- responses --------------------------------------------------------------------------------------------------
class AnthropicUsage(OpenAIBaseModel):
    """Anthropic counts a prompt's cached tokens apart: the prompt is input + cache_read + cache_creation tokens
    (pagellm's prefix cache fills itself, so nothing is reported as written)."""

    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class AnthropicMessage(OpenAIBaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[AnthropicResponseBlock]
    model: str
    stop_reason: AnthropicStopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage


class AnthropicTokenCount(OpenAIBaseModel):
    input_tokens: int


# ---- stream events ----------------------------------------------------------------------------------------------
class AnthropicMessageStartEvent(OpenAIBaseModel):
    type: Literal["message_start"] = "message_start"
    message: AnthropicMessage


class AnthropicPingEvent(OpenAIBaseModel):
    type: Literal["ping"] = "ping"


class AnthropicContentBlockStartEvent(OpenAIBaseModel):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: AnthropicResponseBlock


class AnthropicTextDelta(OpenAIBaseModel):
    type: Literal["text_delta"] = "text_delta"
    text: str


class AnthropicInputJSONDelta(OpenAIBaseModel):
    type: Literal["input_json_delta"] = "input_json_delta"
    partial_json: str


class AnthropicThinkingDelta(OpenAIBaseModel):
    type: Literal["thinking_delta"] = "thinking_delta"
    thinking: str


AnthropicBlockDelta = AnthropicTextDelta | AnthropicInputJSONDelta | AnthropicThinkingDelta


class AnthropicContentBlockDeltaEvent(OpenAIBaseModel):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: AnthropicBlockDelta


class AnthropicContentBlockStopEvent(OpenAIBaseModel):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class AnthropicMessageDelta(OpenAIBaseModel):
    stop_reason: AnthropicStopReason | None = None
    stop_sequence: str | None = None


class AnthropicMessageDeltaEvent(OpenAIBaseModel):
    """Its usage holds the final counts, input tokens included (message_start's are not known yet: the prompt is
    tokenized on the chat path)."""

    type: Literal["message_delta"] = "message_delta"
    delta: AnthropicMessageDelta
    usage: AnthropicUsage


class AnthropicMessageStopEvent(OpenAIBaseModel):
    type: Literal["message_stop"] = "message_stop"


# ---- errors -----------------------------------------------------------------------------------------------------
class AnthropicErrorDetail(OpenAIBaseModel):
    type: str  # invalid_request_error, authentication_error, not_found_error, request_too_large, ...
    message: str


class AnthropicErrorResponse(OpenAIBaseModel):
    type: Literal["error"] = "error"
    error: AnthropicErrorDetail


AnthropicStreamEvent = (AnthropicMessageStartEvent | AnthropicPingEvent | AnthropicContentBlockStartEvent
                        | AnthropicContentBlockDeltaEvent | AnthropicContentBlockStopEvent
                        | AnthropicMessageDeltaEvent | AnthropicMessageStopEvent | AnthropicErrorResponse)


def sse_event(event: AnthropicStreamEvent) -> str:
    """One server-sent event as Anthropic sends it: its type as the event name, the JSON as its data."""
    return f"event: {event.type}\ndata: {event.model_dump_json()}\n\n"
