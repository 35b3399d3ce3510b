"""LLMEngine: the synchronous engine behind the offline `LLM` API (input processing, EngineCore, outputs)."""
from __future__ import annotations

from pagellm.config import EngineConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.core import EngineCore
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.engine.request import RequestStatus
from pagellm.outputs import RequestOutput
from pagellm.sampling_params import SamplingParams
from pagellm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        model_config = config.model_config
        self.tokenizer = get_tokenizer(model_config.tokenizer)
        eos_token_ids = get_eos_token_ids(model_config.model, model_config.hf_config, self.tokenizer)
        self.input_processor = InputProcessor(model_config, self.tokenizer, eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.engine_core = EngineCore(config)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams) -> int:
        """Validate and queue a request; returns its prompt length. Raises ValueError on bad input."""
        request = self.input_processor.process(request_id, prompt, params)
        self.output_processor.add_request(request)
        self.engine_core.add_request(request)
        return request.num_prompt_tokens

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)
        self.output_processor.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def step(self) -> tuple[list[RequestOutput], int]:
        """Run one step. Returns the outputs of requests that finished, and how many tokens were generated."""
        outputs, num_generated = self.step_outputs()
        return [o for o in outputs if o.finished], num_generated

    def step_outputs(self, delta: bool = False) -> tuple[list[RequestOutput], int]:
        """Run one step. Returns a RequestOutput for every request that got a token (for streaming: unfinished
        ones carry only text no stop string can retract; `delta` gives only what is new since the last
        step), and how many tokens were generated."""
        updated, _ = self.engine_core.step()
        processed = self.output_processor.process_outputs(updated, delta=delta)
        if processed.stopped:
            # A stop string ended these: finish them in the core now so their KV blocks go back to the pool.
            self.engine_core.finish_requests(list(processed.stopped), RequestStatus.FINISHED_STOPPED,
                                             stop_reasons=dict(processed.stopped))
        return processed.request_outputs, len(updated)
