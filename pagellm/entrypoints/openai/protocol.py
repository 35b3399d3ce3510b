"""Pydantic models of the OpenAI-compatible API (OpenAI's field names, plus vLLM's sampling extras), and the
mapping of a request's sampling fields to SamplingParams.

Validation at the boundary: floats must be finite (NaN and Infinity are refused), integers carry their ranges
in the schema (64-bit where they reach torch), message roles are OpenAI's, and fields of OpenAI's or vLLM's API
that would change the result but are not implemented are refused with a 400 naming them, never ignored. Limits
that depend on the engine (vocabulary, context length, n against the KV pool) are checked by the engine's input
processor and SamplingParams."""
from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagellm.entrypoints.openai.protocol_structured import (
    REMOVED_GUIDED_FIELDS,
    ChatCompletionNamedToolChoiceParam,
    ChatCompletionToolsParam,
    ResponseFormat,
    StructuredOutputsRequest,
    ToolCall,
)
from pagellm.exceptions import InvalidRequestError
from pagellm.sampling_params import INT64_MAX, INT64_MIN, BeamSearchParams, SamplingParams, StructuredOutputsParams

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
PositiveInt64 = Annotated[int, Field(ge=1, le=INT64_MAX)]
NonNegativeInt64 = Annotated[int, Field(ge=0, le=INT64_MAX)]

_NEUTRAL_VALUES = (None, False, "", [], {})
# Bounds on lists whose every item costs work per request or per step (tokenizing bad words on the event loop,
# stop strings searched in every new text, bans and biases applied every step).
MAX_BATCH_PROMPTS = 4096
MAX_STOP_STRINGS = 64
MAX_BAD_WORDS = 256
MAX_TOKEN_ID_ITEMS = 1024
MAX_TOOLS = 128
MAX_LENGTH_PENALTY = 10.0

# OpenAI's defaults for a request that leaves them out (the web chat shows them as the server's defaults).
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_P = 1.0


def _has_lone_surrogate(value: Any) -> bool:
    """JSON may escape half of a UTF-16 surrogate pair ("\\ud800"), which decodes to a string that is not valid
    Unicode: no tokenizer or encoder accepts it. Walked with a stack, not recursion: JSON nests ~1000 deep."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError:
                    return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(x for x in item if not isinstance(x, int))
    return False


class RequestModel(OpenAIBaseModel):
    """A request body: the text of its fields must be valid Unicode (unknown fields are ignored unread, except the
    known ones listed in `unsupported_fields`: refused when set to anything but a neutral value: None, false, "",
    [], {} or one of `neutral_values`)."""

    unsupported_fields: ClassVar[dict[str, str]] = {}  # field -> why it is refused
    neutral_values: ClassVar[dict[str, tuple[Any, ...]]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, reason in cls.unsupported_fields.items():
                value = data.get(name)
                if not any(value == neutral for neutral in _NEUTRAL_VALUES + cls.neutral_values.get(name, ())):
                    raise PydanticCustomError("unsupported_field", "{field} is not supported: {reason}",
                                              {"field": name, "reason": reason})
        return data

    @model_validator(mode="before")
    @classmethod
    def _refuse_invalid_text(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in cls.model_fields.keys() & data.keys():
                if _has_lone_surrogate(data[name]):
                    raise PydanticCustomError("invalid_text", "{field} holds text that is not valid Unicode (a lone "
                                              "UTF-16 surrogate such as \\ud800)", {"field": name})
        return data


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class SamplingRequest(RequestModel):
    """The fields completions and chat completions share."""

    unsupported_fields: ClassVar[dict[str, str]] = {
        **{name: f"it was removed (vLLM now ignores it and returns unconstrained text); use {replacement}"
           for name, replacement in REMOVED_GUIDED_FIELDS.items()},
        "logits_processors": "custom logits processors are not supported",
        "allowed_token_ids": "allowed_token_ids is not implemented; use logit_bias",
        "use_beam_search": "beam search is served on /v1/completions only",
        "length_penalty": "beam search is served on /v1/completions only",
        "return_tokens_as_token_ids": "return_tokens_as_token_ids is not implemented",
        "vllm_xargs": "vllm_xargs (custom logits-processor arguments) is not supported",
        "prompt_embeds": "prompt embeddings are not supported",
        "mm_processor_kwargs": "multimodal input is not supported",
    }

    model: str | None = None
    n: PositiveInt64 = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: Int64 | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_TOKEN_ID_ITEMS)] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: Int64 = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: NonNegativeInt64 = 0
    stop_token_ids: Annotated[list[NonNegativeInt64], Field(max_length=MAX_TOKEN_ID_ITEMS)] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    truncate_prompt_tokens: PositiveInt64 | None = None
    # vLLM's: per prompt token after the first, its logprob and the k most likely tokens (bounded by --max-logprobs
    # in the engine); not in streams, as vLLM.
    prompt_logprobs: NonNegativeInt64 | None = None
    priority: Int64 = 0  # lower runs first; non-zero only with --scheduling-policy priority
    cache_salt: str | None = None  # prompts share cached prefix blocks only with prompts of the same salt
    # Constraints on the output: OpenAI's response_format, or vLLM's structured_outputs (not both).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None

    @model_validator(mode="after")
    def _prompt_logprobs_not_streamed(self) -> SamplingRequest:
        if self.prompt_logprobs is not None and self.stream:
            raise PydanticCustomError("invalid_field", "{field} is not available when stream is true",
                                      {"field": "prompt_logprobs"})
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def structured_output_params(self) -> StructuredOutputsParams | None:
        if self.structured_outputs is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise InvalidRequestError("structured_outputs and response_format both constrain the output; set only "
                                      "one of them.")
        if self.structured_outputs is not None:
            return self.structured_outputs.to_params()
        return self.response_format.to_params() if self.response_format is not None else None

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           structured_outputs: StructuredOutputsParams | None = None,
                           prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises InvalidRequestError naming the field when a value is out of range. `structured_outputs`: a
        constraint of the caller's (tool calls) instead of the request's own; `prompt_logprobs`: the engine's
        count when the caller needs more than the request's own (echo)."""
        return SamplingParams(
            n=self.n, temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=DEFAULT_TOP_P if self.top_p is None else self.top_p, top_k=self.top_k, max_tokens=max_tokens,
            ignore_eos=self.ignore_eos, seed=self.seed, stop_token_ids=self.stop_token_ids or [], stop=self.stop,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, min_p=self.min_p, min_tokens=self.min_tokens,
            logit_bias=self.logit_bias, bad_words=self.bad_words, logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            structured_outputs=structured_outputs or self.structured_output_params())


# Beam search (vLLM's `use_beam_search` on /v1/completions) ranks beams by their logprobs alone: the sampling fields
# that would change that are refused with it unless left at these values (besides their defaults).
BEAM_SEARCH_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "temperature": (0.0,), "top_p": (1.0,), "top_k": (0,), "min_p": (), "presence_penalty": (),
    "frequency_penalty": (), "repetition_penalty": (), "seed": (), "logit_bias": ({},), "min_tokens": (),
    "stop": ([],), "stop_token_ids": ([],), "include_stop_str_in_output": (), "bad_words": ([],),
    "truncate_prompt_tokens": (), "priority": (), "response_format": (), "structured_outputs": (), "logprobs": (),
    "skip_special_tokens": (), "spaces_between_special_tokens": (), "echo": (), "prompt_logprobs": ()}


class CompletionRequest(SamplingRequest):
    unsupported_fields: ClassVar[dict[str, str]] = {
        **{name: reason for name, reason in SamplingRequest.unsupported_fields.items()
           if name not in ("use_beam_search", "length_penalty")},
        "suffix": "insertion (suffix) is not implemented",
    }

    prompt: (list[int] | Annotated[list[list[int]], Field(max_length=MAX_BATCH_PROMPTS)] | str
             | Annotated[list[str], Field(max_length=MAX_BATCH_PROMPTS)])
    max_tokens: NonNegativeInt64 | None = 16  # 0 only with echo: score the prompt, generate nothing (as vLLM)
    logprobs: NonNegativeInt64 | None = None
    # The prompt comes first in each choice's text and, with logprobs, its tokens first in the logprobs (the first
    # token's logprob null): what evaluation harnesses (lm-eval's local-completions) score prompts with.
    echo: bool = False
    best_of: PositiveInt64 | None = None
    add_special_tokens: bool = True  # vLLM's: add the tokenizer's special tokens (BOS) to text prompts
    # vLLM's beam search: `n` beams (the beam width), ranked by cum_logprob / length ** length_penalty.
    use_beam_search: bool = False
    # Bounded so that length ** length_penalty stays a finite, non-zero float for any context length.
    length_penalty: Annotated[float, Field(ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)] = 1.0

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise PydanticCustomError("unsupported_field", "{field} is not supported: only best_of == n",
                                      {"field": "best_of"})
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("invalid_field", "{field} must be at least 1 (0 only with echo)",
                                      {"field": "max_tokens"})
        if self.length_penalty != 1.0 and not self.use_beam_search:
            raise PydanticCustomError("unsupported_field", "{field} applies only with use_beam_search",
                                      {"field": "length_penalty"})
        if self.use_beam_search:
            for name, neutral in BEAM_SEARCH_NEUTRAL.items():
                value = getattr(self, name)
                if value != type(self).model_fields[name].default and value not in neutral:
                    raise PydanticCustomError("unsupported_field", "{field} is not supported with use_beam_search "
                                              "(beams are ranked by their logprobs alone)", {"field": name})
        return self

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: the response holds the prompt alone (the engine still samples one token)."""
        return self.echo and self.max_tokens == 0

    def completion_sampling_params(self) -> SamplingParams:
        """With echo and logprobs, the prompt tokens need as many top logprobs as the generated ones."""
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(self.logprobs, prompt_logprobs or 0)
        return self.to_sampling_params(1 if self.echo_only else self.max_tokens, self.logprobs,
                                       prompt_logprobs=prompt_logprobs)

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        return BeamSearchParams(beam_width=self.n, max_tokens=max_tokens, length_penalty=self.length_penalty,
                                ignore_eos=self.ignore_eos)


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


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    """vLLM's chat form of /tokenize: the prompt the chat endpoint would render for these fields."""

    unsupported_fields: ClassVar[dict[str, str]] = {
        name: ChatCompletionRequest.unsupported_fields[name]
        for name in ("chat_template", "documents", "mm_processor_kwargs")}

    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_fields(self) -> TokenizeChatRequest:
        check_template_fields(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
