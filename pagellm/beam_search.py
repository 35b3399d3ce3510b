"""Beam search results (vLLM's shapes) and the score that ranks finished beams."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class BeamSearchSequence:
    """One beam. `tokens` holds the prompt followed by the generated tokens (as in vLLM); `text` is the
    generated part only, decoded, without a final EOS."""

    tokens: list[int]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (ended with EOS) or "length"


@dataclass
class BeamSearchOutput:
    """The beams of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)
    request_id: str = ""


def get_beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: frozenset[int],
                          length_penalty: float = 1.0) -> float:
    """cum_logprob / length ** length_penalty, where length counts prompt and generated tokens but not a final
    EOS (vLLM's definition)."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)
