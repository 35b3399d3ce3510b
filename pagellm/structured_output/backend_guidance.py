"""The llguidance backend (PyPI `llguidance`: a Rust Earley parser with a lazily built token lexer; it releases the
GIL while compiling and computing masks). JSON schemas, regexes, choices, Lark and GBNF grammars all become
llguidance grammars; an `LLMatcher` is one sequence's state.

Every grammar runs under GRAMMAR_LIMITS. llguidance meets a limit while it builds a lexer state or a parser row,
which may be only when a token its own mask allowed is consumed; the matcher then enters an error state for good
(and its masks allow only end-of-sequence). So a constraint is probed before it is queued (compiled, its first
mask computed and a few allowed tokens consumed, see `validate`), and a limit met later fails that request alone
with an InvalidRequestError naming it (see `GuidanceGrammar.accept_tokens`), never with a token the grammar does
not allow.

llguidance's masks can also allow tokens that do not spell the bytes a grammar forces next (seen with llguidance
1.9 where a choice or string needs a byte that no token of the model holds alone, such as 0x04 or 0xF1 in
SmolLM2's vocabulary: a byte token that continues some other character passes the mask), and consuming one then
fails. So when bytes are forced (only one spelling can follow), each token the mask allows is confirmed with the
matcher before the mask is used; a mask left with no token means no token can continue the output."""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.hf
import numpy as np

from pagellm.exceptions import InvalidRequestError
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar, grammar_cache_key
from pagellm.structured_output.json_schema import close_objects

_ANY_OBJECT = {"type": "object"}
# llguidance's resource limits, set here so that they are pagellm's documented bounds (README, Structured outputs).
GRAMMAR_LIMITS = {
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
    "max_items_in_row": 2_000,  # Earley items one parser row may hold (alternatives open at one position)
    "step_max_items": 50_000,  # Earley items one token's mask may build (~2.5 ms)
    "initial_lexer_fuel": 1_000_000,  # work to build the lexer's first regex states (~20 ms)
    "step_lexer_fuel": 200_000,  # lexer work one token's mask may do (~15 ms)
    "max_lexer_states": 250_000,  # lexer states one grammar may build (1-2 kB each)
}
LIMITS_HINT = ("pagellm's grammar limits: at most 500,000 grammar symbols, 2,000 alternatives open at one position, "
               "50,000 parser items and 200,000 units of lexer work per token, 250,000 lexer states; simplify the "
               "constraint (fewer alternatives, smaller repetition counts)")
# Tokens a constraint is advanced over before it is queued: enough to reach the limits that the first tokens of
# an oversized constraint meet (a huge repetition count, thousands of alternatives), cheap for every other one.
PROBE_TOKENS = 4
_VALIDATED_CACHE_SIZE = 256


def _limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(**GRAMMAR_LIMITS, verbose_errors=False)


def grammar_spec(params: StructuredOutputsParams, disable_additional_properties: bool) -> str:
    """The constraint as an llguidance grammar definition. Raises InvalidRequestError for a grammar that does not
    even convert (GBNF with an unknown rule, say). `disable_additional_properties`: the engine's default for a
    schema's objects (see json_schema.py), unless the request sets its own."""
    kind = params.kind
    if kind == "json":
        schema = params.json
        strict = params.disable_additional_properties
        if strict if strict is not None else disable_additional_properties:
            schema = close_objects(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": not params.disable_any_whitespace})
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            _ANY_OBJECT, defaults={"whitespace_flexible": not params.disable_any_whitespace})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        # One lexeme (a terminal), not one parser alternative per choice: thousands of choices stay a single
        # regex for the lexer instead of thousands of Earley items in a row.
        return llguidance.LLMatcher.grammar_from_lark(
            "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in params.choice))
    try:
        return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark
    except ValueError as exc:
        raise InvalidRequestError(f"structured_outputs.grammar is invalid: {exc}") from None


def _error(matcher: llguidance.LLMatcher) -> str:
    return matcher.get_error().replace("<non-verbose/>", "").strip()


def _token_allowed(mask_row: np.ndarray, token: int) -> bool:
    return 0 <= token < 32 * len(mask_row) and (int(mask_row[token >> 5]) >> (token & 31)) & 1 == 1


def _set_tokens(words: np.ndarray):
    """The token ids whose bits are set in a packed row."""
    for word in np.flatnonzero(words).tolist():
        bits = int(words[word]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            yield 32 * word + low.bit_length() - 1
            bits ^= low


class _Compilation:
    """What the copies of one compiled grammar share: llguidance's lexer, whose state budget they all draw on."""
    __slots__ = ("limit_reached",)

    def __init__(self) -> None:
        self.limit_reached = False


class GuidanceGrammar(StructuredOutputGrammar):
    __slots__ = ("matcher", "kind", "compilation", "masks")

    def __init__(self, matcher: llguidance.LLMatcher, kind: str, compilation: _Compilation) -> None:
        self.matcher = matcher
        self.kind = kind
        self.compilation = compilation
        # The rows last filled, one per position, that the next tokens accepted were sampled under (a verify step's
        # rows after its rejected positions stay unused: the next fill replaces them).
        self.masks: list[np.ndarray] = []

    def accept_tokens(self, tokens: list[int]) -> None:
        masks, self.masks = self.masks[:len(tokens)], self.masks[len(tokens):]
        for token, mask in zip(tokens, masks):
            if not mask.any():
                raise InvalidRequestError(f"structured_outputs.{self.kind} cannot be continued: no token of this "
                                          f"model spells what the grammar requires next.")
            if not _token_allowed(mask, token):
                raise RuntimeError(f"Sampled token {token} is outside the grammar bitmask it was sampled under.")
        if not self.matcher.consume_tokens(tokens):
            error = _error(self.matcher)
            if not masks or "doesn't satisfy the grammar" in error:
                raise RuntimeError(f"Tokens {tokens} are not allowed by the grammar: {error}")
            # The mask allowed the token (checked above), so the matcher met one of its limits advancing over it.
            self.compilation.limit_reached = True
            raise InvalidRequestError(
                f"structured_outputs.{self.kind} exceeded a grammar limit during generation "
                f"({_error(self.matcher)}); {LIMITS_HINT}.")

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self._compute_mask(bitmask[row])
        self.masks = [bitmask[row]]

    def validate_tokens(self, tokens: Sequence[int]) -> int:
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def fill_draft_bitmask(self, bitmask: np.ndarray, row: int, draft: Sequence[int]) -> None:
        # Advance over the draft computing each position's row, then roll back. A stopped matcher is not advanced:
        # llguidance accepts EOS there without counting it, so a rollback would go one token too far.
        consumed = 0
        try:
            for index in range(len(draft) + 1):
                if index and not self.matcher.is_stopped():
                    if not self.matcher.consume_token(draft[index - 1]):
                        raise RuntimeError(f"Draft token {draft[index - 1]} was verified against a grammar that "
                                           f"does not allow it: {_error(self.matcher)}")
                    consumed += 1
                if consumed == index:
                    self._compute_mask(bitmask[row + index])
                else:
                    bitmask[row + index] = bitmask[row + index - 1]
        finally:
            if consumed and not self.matcher.is_error() and not self.matcher.rollback(consumed):
                raise RuntimeError(f"The grammar could not roll back over a draft: {_error(self.matcher)}")
        self.masks = list(bitmask[row:row + len(draft) + 1])

    def _compute_mask(self, words: np.ndarray) -> None:
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self.matcher.compute_ff_bytes():  # forced bytes: the mask may allow tokens that do not spell them
            bits = words.view(np.uint32)
            for token in list(_set_tokens(words)):
                if self.matcher.validate_tokens([token]) == 0:
                    bits[token >> 5] &= np.uint32(~(1 << (token & 31)) & 0xFFFFFFFF)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()

    @property
    def limit_reached(self) -> bool:
        return self.compilation.limit_reached

    def fork(self) -> GuidanceGrammar:
        fork = GuidanceGrammar(self.matcher.deep_copy(), self.kind, self.compilation)
        fork.masks = list(self.masks)  # a request's sequences sample their first tokens together
        return fork


class GuidanceBackend(StructuredOutputBackend):
    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: frozenset[int],
                 disable_additional_properties: bool) -> None:
        # ~0.3 s for a 50k vocabulary: built on first use (see manager.LazyBackend).
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size,
                                                         eos_token=sorted(eos_token_ids) or None)
        self.vocab_size = vocab_size
        self.disable_additional_properties = disable_additional_properties
        self._validated: OrderedDict[str, None] = OrderedDict()  # cache keys of constraints that passed
        self._validated_lock = threading.Lock()

    def validate(self, params: StructuredOutputsParams) -> None:
        key = grammar_cache_key(params)
        with self._validated_lock:
            if key in self._validated:
                self._validated.move_to_end(key)
                return
        spec = grammar_spec(params, self.disable_additional_properties)
        try:
            error = llguidance.LLMatcher.validate_grammar(spec, self.ll_tokenizer, limits=_limits())
        except (ValueError, TypeError) as exc:  # e.g. a JSON schema that is `true` rather than an object
            error = str(exc)
        if error:
            raise InvalidRequestError(f"structured_outputs.{params.kind} cannot be compiled: {error.strip()}")
        self._probe(params.kind, self._matcher(params.kind, spec))
        with self._validated_lock:
            self._validated[key] = None
            if len(self._validated) > _VALIDATED_CACHE_SIZE:
                self._validated.popitem(last=False)

    def _probe(self, kind: str, matcher: llguidance.LLMatcher) -> None:
        """Advance a fresh matcher over up to PROBE_TOKENS allowed tokens (the highest id that the matcher confirms
        each time: the longest merges, which reach a repetition's limits first); raise InvalidRequestError naming a
        limit met."""
        for _ in range(PROBE_TOKENS):
            mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.int32)
            if matcher.is_error() or matcher.is_stopped():
                break
            allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:self.vocab_size])
            token = next((int(t) for t in allowed[::-1] if matcher.validate_tokens([int(t)]) == 1), None)
            if token is None or not matcher.consume_token(token):
                break
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs.{kind} exceeds a grammar limit ({_error(matcher)}); "
                                      f"{LIMITS_HINT}.")

    def _matcher(self, kind: str, spec: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, spec, log_level=0, limits=_limits())
        if matcher.is_error():  # errors that need the tokenizer (special tokens named in a grammar)
            raise InvalidRequestError(f"structured_outputs.{kind} cannot be compiled: {_error(matcher)}")
        return matcher

    def compile_grammar(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        return GuidanceGrammar(self._matcher(params.kind, grammar_spec(params, self.disable_additional_properties)),
                               params.kind, _Compilation())
