"""LLMEngine: the synchronous engine behind the offline `LLM` API: the shared front end (engine/frontend.py) over
one EngineCore, stepped by the caller."""
from __future__ import annotations

import time
from typing import Any

from pagellm.beam_search import BeamSearchOutput
from pagellm.config import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.frontend import EngineFrontend
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.exceptions import RequestFailedError
from pagellm.outputs import PoolingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import BeamSearchParams, SamplingParams

StepOutput = RequestOutput | PoolingRequestOutput | BeamSearchOutput


class LLMEngine:
    """An EngineCore stepped by the caller, behind the shared front end (engine/frontend.py)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs engine replicas behind `pagellm serve`; the offline LLM "
                             "drives one engine: use tensor_parallel_size, or one LLM per process.")
        self.config = config
        self.engine_core = EngineCore(config)
        self.frontend = EngineFrontend(config, self.engine_core.num_blocks)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    @property
    def tokenizer(self):
        return self.frontend.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.frontend.input_processor

    @property
    def output_processor(self) -> OutputProcessor:
        return self.frontend.output_processor

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                    priority: int = 0) -> int:
        """Validate and queue a request, generating (SamplingParams) or pooling (PoolingParams: one
        PoolingRequestOutput when its prefill is done); `priority`: lower runs first, with --scheduling-policy
        priority. Returns its prompt length. Raises ValueError on bad input."""
        request = self.frontend.process(request_id, prompt, params, priority)
        self.engine_core.add_request(request)
        self.frontend.track(request)
        return request.num_prompt_tokens

    def add_beam_search_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams) -> int:
        """Queue a beam search; its result comes back from `step_outputs` when it finishes."""
        request, group = self.frontend.process_beam_search(request_id, prompt, params)
        try:
            self.engine_core.add_request(request, group)
        except BaseException:
            self.frontend.abort([request_id])
            raise
        return request.num_prompt_tokens

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self.frontend.abort(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        """Run an `@utility` method of the engine core (see engine/core.py), as AsyncLLM.call_utility does."""
        return self.engine_core.call_utility(method, *args)

    def shutdown(self) -> None:
        """Stop the workers (worker processes with a multi-process executor)."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> tuple[list[StepOutput], int]:
        """Run one step. Returns the outputs of requests that finished, and how many tokens were generated.
        Raises RequestFailedError as `step_outputs` does, with only the finished outputs in it."""
        try:
            outputs, num_generated = self.step_outputs()
        except RequestFailedError as exc:
            raise RequestFailedError(exc.errors, _finished(exc.outputs)) from None
        return _finished(outputs), num_generated

    def step_outputs(self, delta: bool = False) -> tuple[list[StepOutput], int]:
        """Run one step. Returns a RequestOutput for every request that got a token (for streaming: unfinished
        ones carry only text no stop string can retract; `delta` gives only what is new since the last
        step), a BeamSearchOutput (with `request_id` set) for every beam search that finished, and how many
        tokens were generated. When requests failed inside the engine, they are freed and RequestFailedError is
        raised instead, holding the step's other outputs."""
        core_outputs = self.engine_core.step()
        start = time.perf_counter()
        processed = self.output_processor.process_outputs(core_outputs.outputs, delta=delta)
        self.engine_core.step_timings.add({"output_processing": time.perf_counter() - start})
        if processed.stopped:
            # A stop string ended these: finish them in the core now so their KV blocks go back to the pool.
            self.engine_core.finish_stopped(processed.stopped)
        outputs: list[StepOutput] = list(processed.request_outputs)
        for request_id, result in core_outputs.finished_beam_searches.items():
            outputs.append(self.frontend.finish_beam_search(request_id, result))
        failed = core_outputs.failed | processed.failed
        if failed:
            self.abort_request(list(failed))
            raise RequestFailedError(failed, outputs)
        return outputs, sum(1 for output in core_outputs.outputs if output.new_token_ids)


def _finished(outputs: list[StepOutput]) -> list[StepOutput]:
    return [o for o in outputs if isinstance(o, BeamSearchOutput) or o.finished]
