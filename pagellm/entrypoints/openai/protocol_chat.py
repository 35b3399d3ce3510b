"""The request of `/v1/chat/completions`: messages (text parts, tool calls and their results), tools and
tool_choice, the chat template's variables and reasoning fields, on the sampling fields it shares with completions
(protocol.py); and the checks of the chat template's fields that /tokenize's chat form shares."""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol import MAX_TOOLS, NonNegativeInt64, PositiveInt64, SamplingRequest
from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagellm.entrypoints.openai.protocol_structured import (
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    ToolCall,
)
from pagellm.exceptions import InvalidRequestError
from pagellm.sampling_params import SamplingParams, StructuredOutputsParams


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessageParam(OpenAIBaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _tool_message_answers_a_call(self) -> ChatMessageParam:
        # As OpenAI: a tool result that names no call cannot be matched to one (templates render it by that id).
        if self.role == "tool" and self.tool_call_id is None:
            raise PydanticCustomError("invalid_field", "Missing required parameter: {field} (a tool message "
                                      "answers the call with that id)", {"field": "tool_call_id"})
        return self

    def to_template_message(self) -> dict[str, Any]:
        """The message as chat templates expect it: text parts joined into one string; tool-call arguments as
        objects (templates render them with `tojson`), as vLLM passes them."""
        content = self.content if not isinstance(self.content, list) else "\n".join(p.text for p in self.content)
        message: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments_object(call.function.arguments)}}
                for call in self.tool_calls]
        return message


def _arguments_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        raise InvalidRequestError(f"tool_calls arguments must be a JSON string, got {arguments!r:.100}.") from None


# apply_chat_template's own arguments: chat_template_kwargs may not name them (they would replace the server's).
TEMPLATE_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_template_fields(chat_template_kwargs: dict[str, Any] | None, add_generation_prompt: bool,
                          continue_final_message: bool) -> None:
    """What chat and tokenize requests pass to the chat template: kwargs that are only variables, and at most one
    way to end the prompt (as vLLM)."""
    for name in (chat_template_kwargs or {}):
        if name in TEMPLATE_ARGUMENTS:
            raise PydanticCustomError("invalid_field", "{field} cannot set {name!r}, which the server passes itself",
                                      {"field": "chat_template_kwargs", "name": name})
    if continue_final_message and add_generation_prompt:
        raise PydanticCustomError("invalid_field", "{field} continues the last message, and add_generation_prompt "
                                  "would start a new one; set add_generation_prompt to false",
                                  {"field": "continue_final_message"})


class ChatCompletionRequest(SamplingRequest):
    unsupported_fields: ClassVar[dict[str, str]] = {
        **SamplingRequest.unsupported_fields,
        **{name: "the legacy functions API is not supported; use tools and tool_choice"
           for name in ("functions", "function_call")},
        "audio": "audio output is not supported", "modalities": "only text output is supported",
        "prediction": "predicted outputs are not implemented",
        "web_search_options": "web search is not supported",
        "chat_template": "per-request chat templates are not accepted; start the server with --chat-template",
        "documents": "documents are not implemented",
        "echo": "echoing the last message is not implemented",
    }
    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {
        **SamplingRequest.neutral_values, "modalities": (["text"],)}

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: PositiveInt64 | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PositiveInt64 | None = None
    logprobs: bool = False
    top_logprobs: NonNegativeInt64 | None = None
    add_generation_prompt: bool = True
    # vLLM's: the last message left open for the model to continue (a prefilled answer); needs
    # add_generation_prompt false.
    continue_final_message: bool = False
    add_special_tokens: bool = False  # vLLM's: the template already holds the special tokens it wants
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    # OpenAI's default: "auto" with tools, "none" without.
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = None
    parallel_tool_calls: bool = True  # False: at most one call ("required" makes exactly one)
    # vLLM's: the chat template's own variables (Qwen3's {"enable_thinking": false}).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's; passed to templates that read a `reasoning_effort` variable (refused by others).
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's, with --reasoning-parser: false leaves reasoning_content out (the model still reasons).
    include_reasoning: bool = True
    # vLLM's, with --reasoning-parser: the end tag is forced after this many reasoning tokens.
    thinking_token_budget: NonNegativeInt64 | None = None

    @model_validator(mode="after")
    def _template_kwargs_are_variables(self) -> ChatCompletionRequest:
        check_template_fields(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message)
        if self.reasoning_effort is not None and "reasoning_effort" in (self.chat_template_kwargs or {}):
            raise PydanticCustomError("invalid_field", "{field} is set twice: as a field and in chat_template_kwargs; "
                                      "set it once", {"field": "reasoning_effort"})
        return self

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_field", "{field} requires logprobs to be true",
                                      {"field": "top_logprobs"})
        choice = self.tool_choice
        if choice not in (None, "none", "auto"):
            if not self.tools:
                raise PydanticCustomError("invalid_field", "{field} needs tools to choose from",
                                          {"field": "tool_choice"})
            if isinstance(choice, ChatCompletionNamedToolChoiceParam) and choice.function.name not in {
                    tool.function.name for tool in self.tools}:
                raise PydanticCustomError("invalid_field", "{field} names function {name!r}, which is not in tools",
                                          {"field": "tool_choice", "name": choice.function.name})
            if self.structured_outputs is not None or (self.response_format is not None
                                                       and self.response_format.type != "text"):
                raise PydanticCustomError("invalid_field", "{field} forces a tool call, which already constrains "
                                          "the output; drop response_format / structured_outputs",
                                          {"field": "tool_choice"})
        return self

    @property
    def effective_tool_choice(self) -> str | ChatCompletionNamedToolChoiceParam:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables: chat_template_kwargs, and reasoning_effort when set."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           structured_outputs: StructuredOutputsParams | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        params = super().to_sampling_params(max_tokens, logprobs, structured_outputs, prompt_logprobs)
        params.thinking_token_budget = self.thinking_token_budget  # validated as a NonNegativeInt64 above
        return params
