"""The engine side of structured outputs (owned by the scheduler's EngineCore).

Grammars compile on a small thread pool, never on the engine thread: a constrained request waits in
WAITING_FOR_FSM until its grammar is ready while the rest of the batch runs. Compiled grammars are cached by their
text (LRU); each sequence takes its own copy of the cached, never-advanced grammar. The backend itself (llguidance's
view of the tokenizer, ~0.3 s) is built on first use, so engines that never see a constraint never pay for it.

Each step, `submit_bitmask` starts filling one packed row per constrained sequence that samples (one per verified
position for a sequence verifying a draft, see spec_decode/), on a thread of its own (llguidance releases the GIL
while it computes a mask), so the rows are computed while the workers run the forward pass; the rank that samples
waits for them only then (see engine/core.py and executor/). A row takes 30-70 us on this CPU (2.2 ms for 32
sequences of a JSON schema, see `pagellm bench structured`)."""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from pagellm.config import ModelConfig, StructuredOutputsConfig
from pagellm.sampling_params import StructuredOutputsParams
from pagellm.structured_output.backend_guidance import GuidanceBackend
from pagellm.structured_output.backend_types import (
    StructuredOutputBackend,
    StructuredOutputGrammar,
    bitmask_words,
    grammar_cache_key,
)
from pagellm.structured_output.request import StructuredOutputRequest
from pagellm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer

GRAMMAR_CACHE_SIZE = 256
NUM_COMPILE_THREADS = 2
# Bitmasks get their own thread: queued behind a long compilation, a step would wait for it.
NUM_BITMASK_THREADS = 1


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
    def __init__(self, model_config: ModelConfig, config: StructuredOutputsConfig) -> None:
        self.model_config = model_config
        self.config = config
        self.vocab_size = model_config.vocab_size
        self._executor = ThreadPoolExecutor(NUM_COMPILE_THREADS, thread_name_prefix="pagellm-grammar")
        self._bitmask_executor = ThreadPoolExecutor(NUM_BITMASK_THREADS, thread_name_prefix="pagellm-bitmask")
        self._backend = LazyBackend(self._build_backend)
        self._cache: OrderedDict[str, Future[StructuredOutputGrammar]] = OrderedDict()

    def _build_backend(self) -> GuidanceBackend:
        config = self.model_config
        tokenizer = get_tokenizer(config.tokenizer)
        return GuidanceBackend(tokenizer, self.vocab_size, get_eos_token_ids(config.model, config.hf_config, tokenizer),
                               self.config.disable_additional_properties)

    def _compile(self, params: StructuredOutputsParams) -> StructuredOutputGrammar:
        return self._backend.get().compile_grammar(params)

    def grammar_init(self, request: StructuredOutputRequest) -> None:
        """Start compiling the request's grammar (or share the cached compilation of the same text)."""
        params = request.params
        key = grammar_cache_key(params)
        compiled = self._cache.get(key)
        if compiled is not None and compiled.done() and compiled.exception() is None \
                and compiled.result().limit_reached:
            compiled = None  # spent by an earlier request: compile afresh
        if compiled is None:
            compiled = self._cache[key] = self._executor.submit(self._compile, params)
        self._cache.move_to_end(key)
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        request.compiled = compiled

    @staticmethod
    def wait_for_any(requests: list[StructuredOutputRequest], timeout_s: float) -> None:
        """Block until one of these requests' grammars is compiled (or the timeout passes): what an engine with
        nothing else to run does instead of spinning."""
        wait([r.compiled for r in requests if r.compiled is not None], timeout_s, return_when="FIRST_COMPLETED")

    def grammar_bitmask(self, grammars: list[StructuredOutputGrammar | None],
                        drafts: list[list[int]] | None = None) -> np.ndarray:
        """The packed rows of allowed tokens for each grammar, in order: one, or with speculative decoding one per
        verified position of its draft in `drafts` (1 + len(draft), see `fill_draft_bitmask`). None (a request
        that finished while its next step was already running, with async scheduling: that step's token is
        dropped) allows every token."""
        drafts = drafts or [[]] * len(grammars)
        bitmask = np.full((len(grammars) + sum(map(len, drafts)), bitmask_words(self.vocab_size)), -1,
                          dtype=np.int32)
        row = 0
        for grammar, draft in zip(grammars, drafts, strict=True):
            if grammar is not None and draft:
                grammar.fill_draft_bitmask(bitmask, row, draft)
            elif grammar is not None:
                grammar.fill_bitmask(bitmask, row)
            row += 1 + len(draft)
        return bitmask

    def submit_bitmask(self, grammars: list[StructuredOutputGrammar | None],
                       drafts: list[list[int]] | None = None) -> Future[np.ndarray]:
        """`grammar_bitmask(grammars, drafts)` on the bitmask thread. The grammars must not advance until it is
        done."""
        return self._bitmask_executor.submit(self.grammar_bitmask, grammars, drafts)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._bitmask_executor.shutdown(wait=False, cancel_futures=True)
