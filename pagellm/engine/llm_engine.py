"""LLMEngine: the synchronous engine behind the offline `LLM` API (input processing, EngineCore, outputs)."""
from __future__ import annotations

import time

from pagellm.beam_search import BeamSearchOutput
from pagellm.config import EngineConfig
from pagellm.core.request import RequestStatus
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.exceptions import RequestFailedError
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import BeamSearchParams, SamplingParams
from pagellm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 runs engine replicas behind `pagellm serve`; the offline LLM "
                             "drives one engine: use tensor_parallel_size, or one LLM per process.")
        self.config = config
        model_config = config.model_config
        self.tokenizer = get_tokenizer(model_config.tokenizer)
        self.engine_core = EngineCore(config)
        eos_token_ids = get_eos_token_ids(model_config.model, model_config.hf_config, self.tokenizer)
        self.input_processor = InputProcessor(config, self.engine_core.num_blocks, self.tokenizer, eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._beam_prompt_lens: dict[str, int] = {}  # live beam searches: request id -> prompt length

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0) -> int:
        """Validate and queue a request (`priority`: lower runs first, with --scheduling-policy priority); returns
        its prompt length. Raises ValueError on bad input."""
        request = self.input_processor.process(request_id, prompt, params, priority)
        self.engine_core.add_request(request)
        self.output_processor.add_request(request)
        return request.num_prompt_tokens

    def add_beam_search_request(self, request_id: str, prompt: PromptType, params: BeamSearchParams) -> int:
        """Queue a beam search; its result comes back from `step_outputs` when it finishes."""
        request, group = self.input_processor.process_beam_search(request_id, prompt, params)
        self.engine_core.add_request(request, group)
        self._beam_prompt_lens[request_id] = request.num_prompt_tokens
        return request.num_prompt_tokens

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)
        for request_id in request_ids:
            self._beam_prompt_lens.pop(request_id, None)

    def shutdown(self) -> None:
        """Stop the workers (worker processes with a multi-process executor)."""
        self.engine_core.shutdown()

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> tuple[list[RequestOutput | BeamSearchOutput], int]:
        """Run one step. Returns the outputs of requests that finished, and how many tokens were generated.
        Raises RequestFailedError as `step_outputs` does, with only the finished outputs in it."""
        try:
            outputs, num_generated = self.step_outputs()
        except RequestFailedError as exc:
            raise RequestFailedError(exc.errors, _finished(exc.outputs)) from None
        return _finished(outputs), num_generated

    def step_outputs(self, delta: bool = False) -> tuple[list[RequestOutput | BeamSearchOutput], int]:
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
            self.engine_core.finish_requests(list(processed.stopped), RequestStatus.FINISHED_STOPPED,
                                             stop_reasons=dict(processed.stopped))
        outputs: list[RequestOutput | BeamSearchOutput] = list(processed.request_outputs)
        for request_id, result in core_outputs.finished_beam_searches.items():
            num_prompt_tokens = self._beam_prompt_lens.pop(request_id)
            for sequence in result.sequences:
                generated = sequence.tokens[num_prompt_tokens:]
                if sequence.finish_reason == "stop":
                    generated = generated[:-1]
                sequence.text = self.tokenizer.decode(generated, skip_special_tokens=True)
            result.request_id = request_id
            outputs.append(result)
        failed = core_outputs.failed | processed.failed
        if failed:
            self.abort_request(list(failed))
            raise RequestFailedError(failed, outputs)
        return outputs, len(core_outputs.outputs)


def _finished(outputs: list[RequestOutput | BeamSearchOutput]) -> list[RequestOutput | BeamSearchOutput]:
    return [o for o in outputs if isinstance(o, BeamSearchOutput) or o.finished]
