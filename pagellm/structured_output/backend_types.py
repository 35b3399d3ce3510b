"""The interface between the engine and a grammar library (llguidance today; xgrammar or outlines-core could be
added beside it): a backend compiles a constraint into a grammar, and a grammar is one sequence's matcher state.

Bitmasks are packed int32 rows, bit `t % 32` of word `t // 32` set when token `t` is allowed (llguidance's and
xgrammar's layout), so a row for a 50k vocabulary is 6 KB and a step's mask is plain data the workers receive."""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from pagellm.sampling_params import StructuredOutputsParams


def bitmask_words(vocab_size: int) -> int:
    """int32 words in one bitmask row."""
    return (vocab_size + 31) // 32


class StructuredOutputGrammar(ABC):
    """One sequence's position in its grammar."""

    @abstractmethod
    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance over sampled tokens; False (the grammar unchanged past the first bad token) if one is not
        allowed."""

    @abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]` (int32 words, see the module docstring)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: nothing but the end of the sequence may follow."""

    @abstractmethod
    def fork(self) -> StructuredOutputGrammar:
        """An independent copy at the same position (for a sequence forked from this one)."""


class StructuredOutputBackend(ABC):
    """A grammar library bound to one model's tokenizer."""

    @abstractmethod
    def validate(self, params: StructuredOutputsParams) -> None:
        """Raise InvalidRequestError with the library's message if the constraint cannot be compiled for this
        tokenizer (special tokens and token ids a grammar names included). Cheap, so it runs before a request is
        queued."""

    @abstractmethod
    def compile_grammar(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        """The constraint's grammar at its start. Slow for big grammars: called on the manager's thread pool."""
