"""One sequence's constraint: its parameters, the compilation it waits for, then its own grammar state.

With a reasoning parser (vLLM's way) the constraint holds the content after the reasoning: while `reasoning_end`
is set, reasoning is open, the grammar neither advances nor masks (`active_grammar` is None), and the token that
completes the end tag closes it; the grammar starts with the next token. A prompt that already closed reasoning
(thinking turned off by the chat template) leaves `reasoning_end` None: the grammar applies from the first token.
Speculative decoding verifies a draft only as far as the grammar allows it (`draft_length`)."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_types import StructuredOutputGrammar


@dataclass(slots=True, eq=False)
class StructuredOutputRequest:
    params: StructuredOutputsParams
    # The shared, never-advanced compiled grammar (from the manager's cache), until `grammar` is taken from it.
    compiled: Future[StructuredOutputGrammar] | None = None
    grammar: StructuredOutputGrammar | None = None
    # The reasoning end tag's token ids while the output is inside reasoning (the grammar waits for it).
    reasoning_end: tuple[int, ...] | None = None

    @property
    def is_compiled(self) -> bool:
        return self.grammar is not None or (self.compiled is not None and self.compiled.done())

    @property
    def active_grammar(self) -> StructuredOutputGrammar | None:
        """The grammar that constrains the next token; None while reasoning is open (every token allowed)."""
        return self.grammar if self.reasoning_end is None else None

    def take_grammar(self) -> None:
        """Once compiled: this sequence's own copy of the grammar. Raises the compilation's error."""
        self.grammar = self.compiled.result().fork()
        self.compiled = None

    def accept_token(self, output_token_ids: Sequence[int], token: int) -> None:
        """Advance over the sequence's next token (`output_token_ids`: its output before it). Raises, as the
        grammar's `accept_tokens` does, for a token the grammar refuses."""
        end = self.reasoning_end
        if end is None:
            self.grammar.accept_tokens([token])
        elif _completes(end, output_token_ids, token):
            self.reasoning_end = None  # the end tag is complete: the grammar starts with the next token

    def draft_length(self, output_token_ids: Sequence[int], draft: Sequence[int]) -> int:
        """Speculative decoding: how many of the draft's first tokens a verify step may take. Under the grammar,
        those it allows one after another (one it forbids could never be accepted). Inside reasoning, those before
        the token that would close it: the grammar would constrain the positions after it, and a step's bitmask
        rows hold one state (constrained or not) for all its positions. A negative id is a placeholder that the
        worker fills (spec_decode/draft_model.py): not known here, so neither are the tokens after it."""
        draft = draft[:next((i for i, token in enumerate(draft) if token < 0), len(draft))]
        end = self.reasoning_end
        if end is None:
            return self.grammar.validate_tokens(draft)
        before = list(output_token_ids[max(0, len(output_token_ids) - len(end) + 1):])
        for index, token in enumerate(draft):
            if _completes(end, before, token):
                return index
            before.append(token)
        return len(draft)

    def fork(self) -> StructuredOutputRequest:
        """For a sequence forked from this one (n > 1): the same position, advanced independently from now on."""
        return StructuredOutputRequest(self.params, grammar=self.grammar.fork(), reasoning_end=self.reasoning_end)


def _completes(end: tuple[int, ...], before: Sequence[int], token: int) -> bool:
    """Whether `token`, after the tokens `before`, completes the reasoning end tag `end`."""
    return (token == end[-1] and len(before) >= len(end) - 1
            and tuple(before[len(before) - len(end) + 1:]) == end[:-1])
