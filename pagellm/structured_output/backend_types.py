"""The interface between the engine and a grammar library (llguidance today; xgrammar or outlines-core could be
added beside it): a backend compiles a constraint into a grammar, and a grammar is one sequence's matcher state.

Bitmasks are packed int32 rows, bit `t % 32` of word `t // 32` set when token `t` is allowed (llguidance's and
xgrammar's layout), so a row for a 50k vocabulary is 6 KB and a step's mask is plain data the workers receive. A
sequence verifying draft tokens (speculative decoding) gets one row per verified position."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import numpy as np

from pagellm.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row."""
    return (vocab_size + 31) // 32


def grammar_cache_key(params: StructuredOutputsParams) -> str:
    """What makes two constraints compile to the same grammar (in one engine, whose defaults are fixed)."""
    return (f"{params.kind}:{int(params.disable_any_whitespace)}:{params.disable_additional_properties}:"
            f"{params.spec}")


class StructuredOutputGrammar(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> None:
        """Advance over sampled tokens. Raises RuntimeError if one was not allowed by the row it was sampled under
        (the rows of the last fill, in order, one per token accepted since: an engine bug, the mask was not in
        force) or, past those rows, if the grammar does not allow them; raises InvalidRequestError naming the
        limit if the grammar met a resource limit advancing."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, see the module docstring); the next
        `accept_tokens` checks its token against that row."""

    @abstractmethod
    def validate_tokens(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, the grammar allows one after another from its position (it does
        not advance)."""

    @abstractmethod
    def fill_draft_bitmask(self, bitmask: np.ndarray, row: int, draft: Sequence[int]) -> None:
        """Speculative decoding: the rows of a verify step, `bitmask[row + i]` for i in 0..len(draft) holding the
        tokens allowed after the grammar advanced over `draft[:i]` (a draft it allows, see `validate_tokens`); the
        grammar ends where it started. Rows past a point where the grammar completed repeat that point's row (the
        sequence stops there). The next `accept_tokens` checks its tokens against these rows in order."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: nothing but the end of the sequence may follow."""

    @property
    def limit_reached(self) -> bool:
        """A copy of this compilation met a resource limit that all its copies share (llguidance's lexer states):
        new requests get a fresh compilation."""
        return False

    @abstractmethod
    def fork(self) -> StructuredOutputGrammar:
        """An independent copy at the same position (for a sequence forked from this one)."""


class StructuredOutputBackend(ABC):
    """A grammar library bound to one model's tokenizer."""

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError with the library's message if the constraint cannot be compiled for this
        tokenizer (special tokens and token ids a grammar names included) or meets a resource limit on its first
        tokens. Runs before a request is queued (off the event loop when serving); a constraint that passed is
        remembered, so asking again is free."""

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """The constraint's grammar at its start. Slow for big grammars: called on the manager's thread pool."""
