"""Speculative decoding: `SpeculativeConfig` (vLLM's --speculative-config) and its methods."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagellm.config.model import ModelConfig

SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative decoding settings (--speculative-config as JSON). `ngram`: prompt lookup, drafts copied
    from the prompt and output so far after the longest suffix n-gram (prompt_lookup_min..max tokens) seen before
    (see spec_decode/). `draft_model`: a smaller model (`model`, with the target's vocabulary) drafts greedily in
    the worker (worker/draft_proposer.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: the most draft tokens a request verifies a step (spec_decode/adaptive.py)
    # suffix (spec_decode/suffix_proposer.py): the longest suffix of the sequence matched; the most tokens a draft
    # has per matched token; the least estimated probability (frequency) of a drafted token given the match; the
    # finished requests whose outputs are searched too (0: none).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_max_cached_requests: int = 10000
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_model: the draft's checkpoint directory, .gguf file or hub id, and its tensor-parallel size (1 only).
    model: str | None = None
    draft_tensor_parallel_size: int | None = None
    # Resolved by EngineArgs from `model` (not a user field): the draft's ModelConfig.
    draft_model_config: ModelConfig | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{self.method!r}; fix --speculative-config.")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("speculative_config.model names the draft model of method 'draft_model', which needs "
                             f"it (got method {self.method!r}, model {self.model!r}); fix --speculative-config.")
        if self.draft_tensor_parallel_size not in (None, 1):
            raise ValueError(f"speculative_config.draft_tensor_parallel_size must be 1 (the draft runs on one rank), "
                             f"got {self.draft_tensor_parallel_size}; fix --speculative-config.")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"speculative_config.num_speculative_tokens must be at least 1, got "
                             f"{self.num_speculative_tokens}; fix --speculative-config.")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}; fix --speculative-config.")
        if self.suffix_decoding_max_tree_depth < 1:
            raise ValueError(f"speculative_config.suffix_decoding_max_tree_depth must be at least 1, got "
                             f"{self.suffix_decoding_max_tree_depth}; fix --speculative-config.")
        if not self.suffix_decoding_max_spec_factor > 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_spec_factor must be positive, got "
                             f"{self.suffix_decoding_max_spec_factor}; fix --speculative-config.")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ValueError(f"speculative_config.suffix_decoding_min_token_prob must be in [0, 1], got "
                             f"{self.suffix_decoding_min_token_prob}; fix --speculative-config.")
        if self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(f"speculative_config.suffix_decoding_max_cached_requests must not be negative, got "
                             f"{self.suffix_decoding_max_cached_requests}; fix --speculative-config.")

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        known = [f.name for f in fields(cls) if f.name != "draft_model_config"]
        unknown = set(values) - set(known)
        if unknown:
            raise ValueError(f"speculative_config has unknown fields {sorted(unknown)}; known: {', '.join(known)}.")
        return cls(**values)
