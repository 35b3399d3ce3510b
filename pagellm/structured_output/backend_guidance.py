"""The llguidance backend (PyPI `llguidance`: a Rust Earley parser with a lazily built token lexer; it releases the
GIL while compiling and computing masks). JSON schemas, regexes, choices, Lark and GBNF grammars all become
llguidance grammars; an `LLMatcher` is one sequence's state."""
from __future__ import annotations

import json

import llguidance
import llguidance.hf
import numpy as np

from pagellm.exceptions import InvalidRequestError
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar

_ANY_OBJECT = {"type": "object"}


def grammar_spec(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar definition. Raises InvalidRequestError for a grammar that does not
    even convert (GBNF with an unknown rule, say)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.json if kind == "json" else _ANY_OBJECT
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise InvalidRequestError(f"structured_outputs.grammar is invalid: {exc}") from None


class GuidanceGrammar(StructuredOutputGrammar):
    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def accept_tokens(self, tokens: list[int]) -> bool:
        return self.matcher.consume_tokens(tokens)

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        words = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    def fork(self) -> GuidanceGrammar:
        return GuidanceGrammar(self.matcher.deep_copy())


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        # ~0.3 s for a 50k vocabulary: built on first use (see manager.LazyBackend).
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                         eos_token=sorted(eos_token_ids) or None)

    def validate(self, params: StructuredOutputsParams) -> None:
        try:
            error = llguidance.LLMatcher.validate_grammar(grammar_spec(params), self.ll_tokenizer)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as exc:  # e.g. a JSON schema that is `true` rather than an object
            error = str(exc)
        if error:
            raise InvalidRequestError(f"structured_outputs.{params.kind} cannot be compiled: {error.strip()}")

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_spec(params), log_level=0)
        if matcher.is_error():  # errors that need the tokenizer (special tokens named in a grammar)
            raise InvalidRequestError(f"structured_outputs.{params.kind} cannot be compiled: "
                                      f"{matcher.get_error().strip()}")
        return GuidanceGrammar(matcher)
