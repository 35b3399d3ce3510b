"""Validates and tokenizes what users submit, turning it into engine Requests. Everything that depends on this
engine (vocabulary, context length, sequence slots, KV pool size, max_logprobs, scheduling policy, prefix caching)
is checked here, so a request the engine could never serve is refused with an InvalidRequestError naming the field
and the limit, before it is queued. A pooling request (PoolingParams) gets the engine's pooler settings resolved on
a copy of its parameters, and a placeholder SamplingParams that samples nothing."""
from __future__ import annotations

import dataclasses
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_groups import blocks_needed, kv_cache_groups
from pagellm.core.kv.kv_cache_manager import cdiv
from pagellm.core.kv.sliding_window import num_skipped_blocks
from pagellm.core.request import Request
from pagellm.exceptions import InvalidRequestError
from pagellm.lora.registry import LoRARegistry
from pagellm.lora.request import LoRARequest
from pagellm.model_executor.layers.attention import layer_windows
from pagellm.model_executor.models.registry import is_encoder_only
from pagellm.pooling_params import PoolingParams
from pagellm.reasoning import get_reasoning_parser
from pagellm.sampling_params import BeamSearchParams, ReasoningTokenIds, SamplingParams, StructuredOutputsParams
from pagellm.structured_output.backend_guidance import GuidanceBackend
from pagellm.structured_output.manager import LazyBackend

# "text" | {"prompt": "text"} | {"prompt_token_ids": [...]}; a dict may add "cache_salt": "..." (vLLM's) and
# "lora_request": LoRARequest (how LLM.generate and the server hand a request its adapter).
PromptType = str | dict[str, Any]

# What a pooling request carries as its sampling parameters: it is never sampled (see Request.pooling_params).
_PREFILL_ONLY = SamplingParams(max_tokens=1, detokenize=False)
# How many of a prompt's last tokens are read to tell whether it closed reasoning (the tag and whitespace after it).
_PROMPT_TAIL_TOKENS = 16


class InputProcessor:
    def __init__(self, config: EngineConfig, num_blocks: int, tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.model_config = config.model_config
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.scheduling_policy = config.scheduler_config.scheduling_policy
        self.enable_prefix_caching = config.cache_config.enable_prefix_caching
        self.block_size = config.cache_config.block_size
        self.num_blocks = num_blocks
        # The windows of the KV cache groups, each holding a block table (None: full attention): capacity checks
        # count every group's blocks, as the scheduler does.
        self.group_windows = [group.window for group in kv_cache_groups(
            layer_windows(self.model_config.hf_config, self.model_config.num_layers))]
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.reasoning_parser = config.structured_outputs_config.reasoning_parser
        # With --enable-lora: the served adapters by name, and the check of each request's adapter.
        self.loras = LoRARegistry(config.lora_config, self.model_config) if config.lora_config.enable_lora else None
        # Validates constraints against this tokenizer before queueing (special tokens a grammar names included).
        self.grammar_backend = LazyBackend(lambda: GuidanceBackend(
            tokenizer, self.model_config.vocab_size, eos_token_ids,
            config.structured_outputs_config.disable_additional_properties))

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return self.tokenize(prompt["prompt"])
        raise InvalidRequestError(f"A prompt must be a string, {{'prompt': str}} or "
                                  f"{{'prompt_token_ids': [int, ...]}}; got {type(prompt).__name__}.")

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                priority: int = 0) -> Request:
        if isinstance(params, PoolingParams):
            return self._process_pooling(request_id, prompt, params, priority)
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        self._check_generates()
        self._validate_priority(priority)
        cache_salt = self._cache_salt(prompt)
        lora_request = self._lora_request(prompt)
        text, token_ids = self.tokenize(prompt)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        self.validate_prompt_tokens(token_ids)
        bad_words_token_ids = self._validate_params(params)
        params = self._with_reasoning_token_ids(params)
        self._check_capacity(len(token_ids), params)
        # The scheduler also stops every request at max_model_len tokens in all.
        max_tokens = params.max_tokens or self.model_config.max_model_len
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=params,
                          eos_token_ids=self.eos_token_ids, max_tokens=max_tokens, prompt=text, priority=priority,
                          cache_salt=cache_salt, bad_words_token_ids=bad_words_token_ids, lora_request=lora_request)
        if request.structured_output_request is not None and self._opens_reasoning(token_ids):
            # The constraint holds the content after the reasoning (see structured_output/request.py).
            request.structured_output_request.reasoning_end = self._reasoning_tags().end
        return request

    def _process_pooling(self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int) -> Request:
        """A prefill-only request: its prompt is pooled (see model_executor/layers/pooler.py), nothing sampled."""
        self._validate_priority(priority)
        cache_salt = self._cache_salt(prompt)
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt_tokens(token_ids)
        params = self.resolve_pooling_params(params)
        # No capacity check: the pool holds one max_model_len prompt (the worker checks it at start), and nothing
        # grows past the prompt.
        return Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=_PREFILL_ONLY,
                       eos_token_ids=frozenset(), max_tokens=1, prompt=text, priority=priority, cache_salt=cache_salt,
                       pooling_params=params, lora_request=self._lora_request(prompt))

    def resolve_pooling_params(self, params: PoolingParams) -> PoolingParams:
        """A copy of `params` with what the engine decides: the pooling type (the engine's; classify reads the last
        position), normalisation by default, and whether the prefix cache may be read (LAST only). Checks dimensions
        against the hidden size and returned_token_ids against the vocabulary."""
        pooler = self.model_config.pooler_config
        hidden_size = self.model_config.hf_config.hidden_size
        if params.dimensions is not None and params.dimensions > hidden_size:
            raise InvalidRequestError(f"dimensions must be at most {hidden_size}, this model's embedding size; got "
                                      f"{params.dimensions}.")
        vocab = self.model_config.vocab_size
        bad = [t for t in params.returned_token_ids or [] if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"returned_token_ids token id {bad[0]} is out of range: ids must be in "
                                      f"[0, {vocab}).")
        pooling_type = pooler.pooling_type if params.task == "embed" else "LAST"
        normalize = pooler.normalize if params.normalize is None else params.normalize
        return dataclasses.replace(params, pooling_type=pooling_type, normalize=normalize,
                                   skip_reading_prefix_cache=pooling_type != "LAST")

    def process_beam_search(self, request_id: str, prompt: PromptType,
                            params: BeamSearchParams) -> tuple[Request, BeamGroup]:
        """The first beam (the prompt) and its group. Every beam samples greedily and reports its
        2 * beam_width most likely next tokens; the group's EOS handling replaces the per-request one."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        self._check_generates()
        cache_salt = self._cache_salt(prompt)
        text, token_ids = self.tokenize(prompt)
        self.validate_prompt_tokens(token_ids)
        if params.beam_width > self.max_num_seqs:
            raise InvalidRequestError(f"beam_width={params.beam_width} is more than max_num_seqs="
                                      f"{self.max_num_seqs}; lower beam_width or raise --max-num-seqs.")
        # The group must fit the pool on its own, even if no block were shared.
        length = min(len(token_ids) + params.max_tokens, self.model_config.max_model_len)
        needed = params.beam_width * blocks_needed(self.group_windows, length - 1, 1, self.block_size)
        if needed > self.num_blocks:
            raise InvalidRequestError(f"beam_width={params.beam_width} beams of up to {length} tokens need {needed} KV "
                                      f"blocks, more than the {self.num_blocks} in the pool; lower beam_width or "
                                      f"max_tokens, or raise the KV cache memory (--kv-cache-memory).")
        sampling = SamplingParams(temperature=0.0, max_tokens=params.max_tokens, ignore_eos=True, detokenize=False,
                                  logprobs=min(2 * params.beam_width, self.model_config.vocab_size))
        request = Request(request_id=request_id, prompt_token_ids=token_ids, sampling_params=sampling,
                          eos_token_ids=self.eos_token_ids, max_tokens=params.max_tokens, prompt=text,
                          cache_salt=cache_salt, lora_request=self._lora_request(prompt))
        return request, BeamGroup(request_id, params, self.eos_token_ids)

    def _check_generates(self) -> None:
        if self.model_config.runner == "pooling":
            encoder = is_encoder_only(self.model_config.architecture)
            fix = "It is an encoder-only model, which cannot generate" if encoder else (
                "Start it with --runner generate to generate")
            raise InvalidRequestError(f"This model is served for pooling (--runner pooling): it computes embeddings "
                                      f"and scores, not completions. {fix}.")

    def _validate_priority(self, priority: int) -> None:
        """As vLLM: a priority only means something to the priority policy, so any other policy refuses one
        rather than silently serving the request in another order."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r:.50}.")
        if priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority must be 0 unless priority scheduling is enabled, got {priority} "
                                      f"(the scheduling policy is {self.scheduling_policy}); start the engine with "
                                      f"--scheduling-policy priority (scheduling_policy='priority').")

    def _cache_salt(self, prompt: PromptType) -> str | None:
        """The prompt's cache_salt (None without one). Without prefix caching a salt would be silently
        meaningless, so it is refused."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is None:
            return None
        if not isinstance(salt, str) or not salt:
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {salt!r:.50}.")
        if not self.enable_prefix_caching:
            raise InvalidRequestError("cache_salt needs prefix caching, which this engine has off "
                                      "(--no-enable-prefix-caching); drop cache_salt or enable prefix caching.")
        return salt

    def _lora_request(self, prompt: PromptType) -> LoRARequest | None:
        """The prompt's adapter (None: the base model), checked against the base model and --max-lora-rank."""
        lora = prompt.get("lora_request") if isinstance(prompt, dict) else None
        if lora is None:
            return None
        if self.loras is None:
            raise InvalidRequestError("lora_request needs LoRA enabled (--enable-lora, enable_lora=True).")
        try:
            self.loras.check(lora)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from exc
        return lora

    def _check_capacity(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """The n sequences of a request must fit max_num_seqs, and the KV pool must hold them at their first
        token (sharing the prompt's full blocks). Beyond that they may outgrow the pool: preemption keeps their
        tokens and one sequence always fits, so they finish."""
        if params.n > self.max_num_seqs:
            raise InvalidRequestError(f"n must be at most max_num_seqs={self.max_num_seqs}, got {params.n}; lower n "
                                      f"or raise --max-num-seqs.")
        needed = 0
        for window in self.group_windows:  # a sliding group holds only its window's blocks
            skipped = num_skipped_blocks(num_prompt_tokens, window, self.block_size)
            shared = max(0, num_prompt_tokens // self.block_size - skipped)
            needed += shared + params.n * (cdiv(num_prompt_tokens + 1, self.block_size) - skipped - shared)
        if needed > self.num_blocks:
            raise InvalidRequestError(
                f"n is too large for the KV cache: {params.n} sequences of {num_prompt_tokens + 1} tokens need "
                f"{needed} KV blocks, more than the {self.num_blocks} in the pool; lower n, or raise the KV cache "
                f"memory (--kv-cache-memory).")

    def _validate_params(self, params: SamplingParams) -> list[list[int]]:
        """Check the token ids params name against the vocabulary, and logprobs against max_logprobs; returns
        bad_words tokenized."""
        vocab = self.model_config.vocab_size
        if params.logit_bias:
            bad = [t for t in params.logit_bias if not 0 <= t < vocab]
            if bad:
                raise InvalidRequestError(f"logit_bias token id {bad[0]} is out of range: ids must be in [0, {vocab}).")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise InvalidRequestError(f"stop_token_ids token id {bad[0]} is out of range: ids must be in [0, {vocab}).")
        max_logprobs = self.model_config.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise InvalidRequestError(f"{name} must be at most {max_logprobs} (--max-logprobs), got {value}.")
        if params.structured_outputs is not None:
            self.validate_structured_outputs(params.structured_outputs)
        bad_words_token_ids = self.tokenize_bad_words(params.bad_words or [])
        for ids in bad_words_token_ids:
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"bad_words tokenize to ids outside the vocabulary [0, {vocab}): {ids}.")
        return bad_words_token_ids

    def _with_reasoning_token_ids(self, params: SamplingParams) -> SamplingParams:
        """A request with a thinking budget gets a copy of its parameters holding the reasoning parser's tags as
        token ids (the worker forces the end tag with them)."""
        if params.thinking_token_budget is None or params.reasoning_token_ids is not None:
            return params
        if self.reasoning_parser is None:
            raise InvalidRequestError("thinking_token_budget needs a reasoning parser to know where reasoning ends; "
                                      "start the engine with --reasoning-parser (reasoning_parser=...).")
        return dataclasses.replace(params, reasoning_token_ids=self._reasoning_tags())

    def _reasoning_tags(self) -> ReasoningTokenIds:
        tags = get_reasoning_parser(self.reasoning_parser)
        return ReasoningTokenIds(*(tuple(self.tokenizer.encode(tag, add_special_tokens=False))
                                   for tag in (tags.start_tag, tags.end_tag)))

    def _opens_reasoning(self, prompt_token_ids: list[int]) -> bool:
        """With a reasoning parser, whether the output starts in reasoning: unless the prompt's end closes it (the
        parser's rule, on the text of its last tokens: a tag and the whitespace after it fit in them)."""
        if self.reasoning_parser is None:
            return False
        tail = self.tokenizer.decode(prompt_token_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        return not get_reasoning_parser(self.reasoning_parser).closes_reasoning(tail)

    def validate_structured_outputs(self, params: StructuredOutputsParams) -> None:
        """Compile and probe a constraint (see structured_output/backend_guidance.py): a grammar too large for its
        limits can take a second, so a server calls this off its event loop before `process`, which then finds it
        validated."""
        self.grammar_backend.get().validate(params)

    def tokenize_bad_words(self, words: list[str]) -> list[list[int]]:
        """As vLLM: each word without and with a leading space (the latter only when the space gives a different
        first token and the same number of tokens, i.e. a distinct word-start variant)."""
        result: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if plain:
                result.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
                result.append(spaced)
        return result

    def validate_prompt_tokens(self, token_ids: list[int]) -> None:
        """A prompt's token ids: at least one, each in the vocabulary, no more than max_model_len."""
        if not token_ids:
            raise InvalidRequestError("The prompt is empty: it must contain at least one token.")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            bad = next(t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab)
            raise InvalidRequestError(f"Prompt token id {bad!r} is out of range: ids must be integers in [0, {vocab}).")
        max_model_len = self.model_config.max_model_len
        if len(token_ids) > max_model_len:
            raise InvalidRequestError(f"The prompt is {len(token_ids)} tokens long, more than max_model_len "
                                      f"({max_model_len}). Shorten the prompt or raise max_model_len "
                                      f"(--max-model-len).")
