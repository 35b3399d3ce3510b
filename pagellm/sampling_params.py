"""User-facing sampling parameters (vLLM's names and semantics)."""
from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field
from typing import Any

from pagellm.exceptions import InvalidRequestError

_GREEDY_EPS = 1e-5
# Integers reach torch as int64 (seeds, top_k, token ids); larger ones are refused here, not overflowed there.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_int(name: str, value: object, low: int, high: int, what: str | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be {what or 'an integer'} in [{low}, {high}], got {value!r}.")


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text (vLLM's names): exactly one of `json` (a JSON schema, as a dict or its
    text), `regex`, `choice` (the output is one of these strings), `grammar` (Lark or GBNF/EBNF) and
    `json_object=True` (any JSON object). `disable_any_whitespace` makes JSON compact (no free whitespace between
    tokens), which also keeps weak models from emitting whitespace forever. `disable_additional_properties`: a
    schema's objects admit only the properties they name (unless the schema says otherwise); None takes the
    engine's default (on; `--no-structured-outputs-disable-additional-properties` turns it off)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool | None = None

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(f"structured_outputs must set exactly one of json, regex, choice, grammar and "
                                      f"json_object; got {', '.join(given) if given else 'none'}.")
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as exc:
                raise InvalidRequestError(f"structured_outputs.json is not valid JSON: {exc}.") from None
        if self.json is not None and not isinstance(self.json, (dict, bool)):
            raise InvalidRequestError(f"structured_outputs.json must be a JSON schema (an object), got "
                                      f"{type(self.json).__name__}.")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError(f"structured_outputs.choice must be a non-empty list of strings, got "
                                      f"{self.choice!r:.100}.")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"structured_outputs.{name} must be a non-empty string, got {value!r:.100}.")

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "regex", "choice", "grammar" or "json_object"."""
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text (a JSON schema or choice list as canonical JSON): the grammar cache's key."""
        value = getattr(self, self.kind)
        return value if isinstance(value, str) else _json.dumps(value, sort_keys=True)


@dataclass(frozen=True)
class ReasoningTokenIds:
    """A reasoning parser's tags as token ids (see pagellm/reasoning/): set on SamplingParams by the engine, from its
    --reasoning-parser, for requests with a thinking_token_budget."""

    start: tuple[int, ...]
    end: tuple[int, ...]


@dataclass
class SamplingParams:
    """How to sample the completion of one prompt.

    temperature 0 means greedy. top_k -1 (or 0) disables top-k; top_p 1.0 disables nucleus sampling.
    A request with a `seed` gets its own random generator, so its tokens do not depend on what else runs.
    `stop` strings end generation when they appear in the detokenized text; the text is cut before the match
    (or after it, with `include_stop_str_in_output`) and `stop_reason` is the matched string.

    Logits processing, in vLLM's order: on the raw logits, repetition_penalty (over prompt + output tokens:
    positive logits divided, negative multiplied), frequency_penalty and presence_penalty (output tokens only,
    subtracted per occurrence / once), logit_bias (added; values clamped to [-100, 100] as OpenAI does),
    bad_words (a single-token word is always banned, a multi-token one only when the generated tokens end with
    its prefix; each word is tokenized with and without a leading space), and min_tokens (EOS and
    stop_token_ids masked until min_tokens tokens are generated); then temperature; then min_p (drop tokens
    whose probability is below min_p times the largest), top_k and top_p. Greedy rows take the argmax after the
    penalties.

    `logprobs=k` returns, per generated token, the top-k tokens plus the sampled one; `prompt_logprobs=k` does
    the same for every prompt token after the first. Both are computed from the *raw* model logits
    (log_softmax before temperature, penalties and masks), like vLLM's default "raw_logprobs" mode.
    `truncate_prompt_tokens=k` keeps only the last k prompt tokens.

    `structured_outputs` constrains the text (a JSON schema, regex, choice list or grammar): each step, tokens
    that cannot continue a valid output are masked out of the logits before everything else, so logprobs are
    those of the constrained distribution; the sequence stops ("stop") as soon as the output is complete.

    `n` sequences are sampled per prompt. The prompt is computed once and its KV blocks are shared by the n
    sequences (the last, partly filled block is copied when they first write to it). With a seed, sequence i
    draws from seed + i after the first token (as vLLM seeds its child requests).

    `thinking_token_budget=k` (vLLM's name; needs an engine with a reasoning parser): once k tokens have been
    generated inside reasoning (after a start tag the output or the end of the prompt opened), the end tag's tokens
    are forced, one per step, after every other logits processor. `reasoning_token_ids` holds the tags; the engine
    sets it.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 16
    ignore_eos: bool = False
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: str | list[str] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    thinking_token_budget: int | None = None
    reasoning_token_ids: ReasoningTokenIds | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = list(self.stop_token_ids or [])
        # Normalised to a list, as in vLLM, so the engine never has to care which form the user passed.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        if self.top_k == 0:
            self.top_k = -1
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError, OverflowError):
                raise InvalidRequestError(f"logit_bias must map token ids to numbers, got "
                                          f"{self.logit_bias!r}.") from None
            if not all(math.isfinite(b) for b in self.logit_bias.values()):
                raise InvalidRequestError("logit_bias values must be finite numbers (no NaN or Infinity).")
            self.logit_bias = {t: min(100.0, max(-100.0, b)) for t, b in self.logit_bias.items()}
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self._verify()

    def _verify(self) -> None:
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                     "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequestError(f"{name} must be a finite number, got {value!r}.")
        _check_int("n", self.n, 1, INT64_MAX)
        if self.temperature < 0.0:
            raise InvalidRequestError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k, -1, INT64_MAX, "-1 (disable), or at least 1")
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1, INT64_MAX)
        if self.seed is not None:
            _check_int("seed", self.seed, INT64_MIN, INT64_MAX)
            # Sequence i of an n > 1 request draws from seed + i.
            if self.seed + self.n - 1 > INT64_MAX:
                raise InvalidRequestError(f"seed must be at most {INT64_MAX - self.n + 1} with n={self.n} (sequence i "
                                 f"uses seed + i, a 64-bit integer), got {self.seed}.")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT64_MAX, "token ids (non-negative integers)")
        if any(not isinstance(s, str) for s in self.stop):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if any(s == "" for s in self.stop):
            raise InvalidRequestError("stop cannot contain an empty string.")
        if self.stop and not self.detokenize:
            raise InvalidRequestError("stop strings are only supported when detokenize is True; set detokenize=True "
                                      "or use stop_token_ids.")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}.")
        if not self.repetition_penalty > 0.0:
            raise InvalidRequestError(f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}.")
        _check_int("min_tokens", self.min_tokens, 0, INT64_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                                      f"got {self.min_tokens}.")
        if self.bad_words is not None and any(not isinstance(w, str) or not w for w in self.bad_words):
            raise InvalidRequestError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}.")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, INT64_MAX)
        if self.truncate_prompt_tokens is not None:
            _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, 1, INT64_MAX)
        if self.thinking_token_budget is not None:
            _check_int("thinking_token_budget", self.thinking_token_budget, 0, INT64_MAX)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError(f"structured_outputs must be a StructuredOutputsParams, got "
                                      f"{type(self.structured_outputs).__name__}.")

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


@dataclass
class BeamSearchParams:
    """Beam search (vLLM's names): keep the `beam_width` most likely sequences, extending each by its
    2 * beam_width most likely next tokens every step, for `max_tokens` steps. A candidate ending in EOS (unless
    `ignore_eos`) is set aside as finished; at the end, finished and live beams are ranked by
    cum_logprob / len(prompt + generated tokens, EOS excluded) ** length_penalty."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise InvalidRequestError(f"beam_width must be a positive integer, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be a positive integer, got {self.max_tokens!r}.")
        if isinstance(self.length_penalty, bool) or not isinstance(self.length_penalty, (int, float)) \
                or not math.isfinite(self.length_penalty):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}.")
