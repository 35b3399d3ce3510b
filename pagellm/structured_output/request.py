"""One sequence's constraint: its parameters, the compilation it waits for, then its own grammar state.

With a reasoning parser (vLLM's way) the constraint holds the content after the reasoning: while `reasoning_end`
is set, reasoning is open, the grammar neither advances nor masks (`active_grammar` is None), and the token that
completes the end tag closes it; the grammar starts with the next token. A prompt that already closed reasoning
(thinking turned off by the chat template) leaves `reasoning_end` None: the grammar applies from the first token."""
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
        elif token == end[-1] and len(output_token_ids) >= len(end) - 1 \
                and tuple(output_token_ids[len(output_token_ids) - len(end) + 1:]) == end[:-1]:
            self.reasoning_end = None  # the end tag is complete: the grammar starts with the next token

    def fork(self) -> StructuredOutputRequest:
        """For a sequence forked from this one (n > 1): the same position, advanced independently from now on."""
        return StructuredOutputRequest(self.params, grammar=self.grammar.fork(), reasoning_end=self.reasoning_end)
