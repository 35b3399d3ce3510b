"""The engine side of structured outputs (owned by the scheduler's EngineCore).

Grammars compile on a small thread pool, never on the engine thread: a constrained request waits in
WAITING_FOR_FSM until its grammar is ready while the rest of the batch runs. Compiled grammars are cached by their
text (LRU); each sequence takes its own copy of the cached, never-advanced grammar. The backend itself (llguidance's
view of the tokenizer, ~0.3 s) is built on first use, so engines that never see a constraint never pay for it.

Each step, `grammar_bitmask` fills one packed row per constrained sequence that samples; the scheduler puts the
rows and their request ids in the SchedulerOutput and the workers mask the logits with them. llguidance computes a
row in 30-70 us on this CPU (2.2 ms for 32 sequences of a JSON schema, against a ~136 ms decode step; see
`pagellm bench structured`), so it runs inline in `schedule()` rather than beside the forward pass: on a 2-core
CPU a second thread would only take cores from the forward pass's OpenMP threads, and the SchedulerOutput stays
plain data that any executor can send."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from pagellm.config import ModelConfig
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_guidance import GuidanceBackend
from pagellm.structured_output.backend_types import StructuredOutputBackend, StructuredOutputGrammar, bitmask_words
from pagellm.structured_output.request import StructuredOutputRequest
from pagellm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer

GRAMMAR_CACHE_SIZE = 256
NUM_COMPILE_THREADS = 2


class LazyBackend:
    """The grammar backend of one tokenizer, built when first asked for (llguidance's view of the tokenizer takes
    ~0.4 s), once, whichever threads ask at the same time. The engine's input processor holds one to validate
    constraints before queueing; the manager holds one to compile them."""

    def __init__(self, build: Callable[[], StructuredOutputBackend]) -> None:
        self._build = build
        self._backend: StructuredOutputBackend | None = None
        self._lock = threading.Lock()

    def get(self) -> StructuredOutputBackend:
        with self._lock:
            if self._backend is None:
                self._backend = self._build()
            return self._backend


class StructuredOutputManager:
    def __init__(self, model_config: ModelConfig) -> None:
        self.model_config = model_config
        self.vocab_size = model_config.vocab_size
        self._executor = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="pagellm-grammar")
        self._backend = LazyBackend(self._build_backend)
        self._cache: OrderedDict[str, Future[StructuredOutputGrammar]] = OrderedDict()

    def _build_backend(self) -> GuidanceBackend:
        config = self.model_config
        tokenizer = get_tokenizer(config.tokenizer)
        return GuidanceBackend(tokenizer, self.vocab_size, get_eos_token_ids(config.model, config.hf_config, tokenizer))

    def _compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        return self._backend.get().compile_grammar(params)

    def grammar_init(self, request: StructuredOutputRequest) -> None:
        """Start compiling the request's grammar (or share the cached compilation of the same text)."""
        params = request.params
        key = f"{params.kind}:{int(params.disable_any_whitespace)}:{params.spec}"
        compiled = self._cache.get(key)
        if compiled is None:
            compiled = self._cache[key] = self._executor.submit(self._compile, params)
            if len(self._cache) > GRAMMAR_CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        request.compiled = compiled

    @staticmethod
    def wait_for_any(requests: list[StructuredOutputRequest], timeout_s: float) -> None:
        """Block until one of these requests' grammars is compiled (or the timeout passes): what an engine with
        nothing else to run does instead of spinning."""
        wait([r.compiled for r in requests if r.compiled is not None], timeout_s, return_when="FIRST_COMPLETED")

    def grammar_bitmask(self, grammars: list[StructuredOutputGrammar]) -> np.ndarray:
        """One packed row of allowed tokens per grammar, in order."""
        bitmask = np.empty((len(grammars), bitmask_words(self.vocab_size)), dtype=np.int32)
        for row, grammar in enumerate(grammars):
            grammar.fill_bitmask(bitmask, row)
        return bitmask

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
