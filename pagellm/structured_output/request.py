"""One sequence's constraint: its parameters, the compilation it waits for, then its own grammar state."""
from __future__ import annotations

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

    @property
    def is_compiled(self) -> bool:
        return self.grammar is not None or (self.compiled is not None and self.compiled.done())

    def take_grammar(self) -> None:
        """Once compiled: this sequence's own copy of the grammar. Raises the compilation's error."""
        self.grammar = self.compiled.result().fork()
        self.compiled = None

    def fork(self) -> StructuredOutputRequest:
        """For a sequence forked from this one (n > 1): the same position, advanced independently from now on."""
        return StructuredOutputRequest(self.params, grammar=self.grammar.fork())
