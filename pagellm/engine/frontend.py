"""EngineFrontend: the text side of an engine, built once and held by both front ends (`LLMEngine` for the offline
`LLM`, `AsyncLLM` for the server), as vLLM's `Processor` and `OutputProcessor` are.

It owns the tokenizer, the InputProcessor (tokenize and validate what users submit, into engine Requests), the
OutputProcessor (detokenize, stop strings, RequestOutputs) and the decoding of finished beam searches. It never
touches the engine core: the front end that holds it passes Requests in and core outputs back. One thread uses it
at a time (a Hugging Face fast tokenizer must not be shared across threads): the caller's with `LLMEngine`, the
event loop's with `AsyncLLM`, whose engine core runs on a thread or in processes of its own.
"""
from __future__ import annotations

from pagellm.beam_search import BeamSearchOutput
from pagellm.config import EngineConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.request import Request
from pagellm.engine.input_processor import InputProcessor, PromptType
from pagellm.engine.output_processor import OutputProcessor
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import BeamSearchParams, SamplingParams
from pagellm.transformers_utils.tokenizer import get_eos_token_ids, get_tokenizer


class EngineFrontend:
    def __init__(self, config: EngineConfig, num_blocks: int) -> None:
        """`num_blocks`: the KV blocks of the smallest engine core behind it (what one request may use at most)."""
        self.config = config
        model_config = config.model_config
        self.tokenizer = get_tokenizer(model_config.tokenizer)
        eos_token_ids = get_eos_token_ids(model_config.model, model_config.hf_config, self.tokenizer)
        self.input_processor = InputProcessor(config, num_blocks, self.tokenizer, eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._beam_prompt_lens: dict[str, int] = {}  # live beam searches: request id -> prompt length

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | PoolingParams,
                priority: int = 0) -> Request:
        """Validate and tokenize a request, generating or pooling (InvalidRequestError on bad input); `track` it
        once the core has it."""
        return self.input_processor.process(request_id, prompt, params, priority)

    def track(self, request: Request) -> None:
        """From here on, `process_outputs` turns the request's core outputs into RequestOutputs."""
        self.output_processor.add_request(request)

    def process_beam_search(self, request_id: str, prompt: PromptType,
                            params: BeamSearchParams) -> tuple[Request, BeamGroup]:
        """Validate a beam search: its first beam and the group for the core; `finish_beam_search` decodes its
        result."""
        request, group = self.input_processor.process_beam_search(request_id, prompt, params)
        self._beam_prompt_lens[request_id] = request.num_prompt_tokens
        return request, group

    def finish_beam_search(self, request_id: str, result: BeamSearchOutput) -> BeamSearchOutput:
        """Decode each beam's generated tokens (without a final EOS) into its text; `request_id` set."""
        num_prompt_tokens = self._beam_prompt_lens.pop(request_id)
        for sequence in result.sequences:
            generated = sequence.tokens[num_prompt_tokens:]
            if sequence.finish_reason == "stop":
                generated = generated[:-1]
            sequence.text = self.tokenizer.decode(generated, skip_special_tokens=True)
        result.request_id = request_id
        return result

    def abort(self, request_ids: list[str]) -> None:
        """Forget these requests (plain or beam search); unknown ids are ignored."""
        self.output_processor.abort_requests(request_ids)
        for request_id in request_ids:
            self._beam_prompt_lens.pop(request_id, None)
