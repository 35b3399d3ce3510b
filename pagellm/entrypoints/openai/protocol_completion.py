"""The request of `/v1/completions` (OpenAI's fields, plus vLLM's echo with max_tokens 0 and beam search), on the
sampling fields it shares with chat (protocol.py)."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator
from pydantic_core import PydanticCustomError

from pagellm.entrypoints.openai.protocol import MAX_BATCH_PROMPTS, NonNegativeInt64, PositiveInt64, SamplingRequest
from pagellm.sampling_params import BeamSearchParams, SamplingParams

MAX_LENGTH_PENALTY = 10.0


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
