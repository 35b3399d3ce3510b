"""What every request model of the OpenAI-compatible API shares: the base that refuses unsupported fields and
invalid text, the integer ranges and list bounds, and the sampling fields of completions and chat completions
(OpenAI's names plus vLLM's extras) with their mapping to SamplingParams. The requests themselves are in
protocol_completion.py, protocol_chat.py, protocol_tokenize.py, protocol_pooling.py (and the Anthropic and
Responses APIs' modules).

Validation at the boundary: floats must be finite (NaN and Infinity are refused), integers carry their ranges
in the schema (64-bit where they reach torch), message roles are OpenAI's, and fields of OpenAI's or vLLM's API
that would change the result but are not implemented are refused with a 400 naming them, never ignored. Limits
that depend on the engine (vocabulary, context length, n against the KV pool) are checked by the engine's input
processor and SamplingParams."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagellm.entrypoints.openai.protocol_structured import (
    REMOVED_GUIDED_FIELDS,
    ResponseFormat,
    StructuredOutputsRequest,
)
from pagellm.exceptions import InvalidRequestError
from pagellm.sampling_params import INT64_MAX, INT64_MIN, SamplingParams, StructuredOutputsParams

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
