"""The offline API: `LLM(...).generate(prompts, sampling_params)`, `.chat(messages)` and `.embed(prompts)`, vLLM's
names."""
from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from tqdm.auto import tqdm

from pagellm.beam_search import BeamSearchOutput
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.input_processor import PromptType
from pagellm.engine.llm_engine import LLMEngine
from pagellm.exceptions import InvalidRequestError
from pagellm.lora.request import LoRARequest
from pagellm.outputs import EmbeddingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import BeamSearchParams, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    """An engine for offline batched generation.

    Args mirror vLLM's: `model` is a checkpoint directory, a .gguf file or a hub id (None: SmolLM2-135M-Instruct);
    every other keyword argument is an `EngineArgs` field with its default there (`tokenizer`, `dtype`, `device`,
    `seed`, `max_model_len`, `block_size`, `kv_cache_memory_bytes` (default: a share of free RAM on CPU, or
    `gpu_memory_utilization` of the device on CUDA), `max_num_seqs`, `max_num_batched_tokens`,
    `enable_chunked_prefill`, `max_logprobs`, `enable_prefix_caching`, `scheduling_policy`, ...).
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any) -> None:
        args = EngineArgs(model=model, **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(args)
        self._request_counter = itertools.count()

    def shutdown(self) -> None:
        """Stop the engine's worker processes now (they also stop when the LLM is garbage collected)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate completions for all prompts together; outputs come back in input order. A prompt dict may
        carry a `cache_salt` (prompts share cached prefix blocks only with prompts of the same salt). `priority`:
        one per prompt, lower first (needs scheduling_policy="priority"). `lora_request`: the LoRA adapter for
        every prompt, or one (or None: the base model) per prompt (needs enable_lora=True)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = _with_lora(list(prompts), lora_request)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise InvalidRequestError(f"Got {len(params_list)} sampling_params for {len(prompts)} prompts; pass "
                                          f"one SamplingParams for all, or exactly one per prompt.")
        priority = _priorities(priority, len(prompts))
        return self._run(list(zip(prompts, params_list, priority)), use_tqdm, self.llm_engine.add_request)

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (`.outputs.embedding`, float32 values): the engine's pooling
        (--pooler-config: LAST by default) of the final-norm hidden states, L2-normalised unless
        `pooling_params.normalize` is False; `pooling_params.dimensions` keeps that many leading values before
        normalising (Matryoshka)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        params = pooling_params or PoolingParams()
        if not isinstance(params, PoolingParams) or params.task != "embed":
            raise InvalidRequestError(f"pooling_params must be a PoolingParams with task='embed', got {params!r:.80}.")
        priority = _priorities(priority, len(prompts))
        outputs = self._run([(prompt, params, p) for prompt, p in zip(prompts, priority)], use_tqdm,
                            self.llm_engine.add_request)
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def beam_search(self, prompts: PromptType | Sequence[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search for every prompt (run together, beams sharing KV blocks); one BeamSearchOutput per prompt
        whose `.sequences` are the beams, best first."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run([(prompt, params) for prompt in prompts], use_tqdm, self.llm_engine.add_beam_search_request)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: list[dict[str, Any]] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them (with `tools`, OpenAI-style
        function definitions, for templates that render them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tokenizer = self.get_tokenizer()
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("This model's tokenizer has no chat template; pass chat_template=... or use "
                                      "generate().")
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, tools=tools)
            # The template already holds any BOS; tokenizing without special tokens avoids a second one.
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, requests: list[tuple], use_tqdm: bool, add_request: Callable[..., int]) -> list:
        """Queue each request (`add_request(request_id, *arguments)`), then step until all have finished."""
        engine = self.llm_engine
        order: dict[str, int] = {}
        prompt_lens: dict[str, int] = {}
        try:
            for arguments in requests:
                request_id = str(next(self._request_counter))
                prompt_lens[request_id] = add_request(request_id, *arguments)
                order[request_id] = len(order)
        except Exception:
            engine.abort_request(list(order))  # all or nothing: nothing stays queued after bad input
            raise
        outputs: list[RequestOutput | BeamSearchOutput | None] = [None] * len(order)
        bar = tqdm(total=len(order), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start, input_tokens, output_tokens = time.perf_counter(), 0, 0
        try:
            while engine.has_unfinished_requests():
                finished, num_generated = engine.step()
                output_tokens += num_generated
                for output in finished:
                    outputs[order[output.request_id]] = output
                    input_tokens += prompt_lens[output.request_id]
                    bar.update(1)
                if finished and use_tqdm:
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {input_tokens / elapsed:.1f} toks/s, "
                                        f"output: {output_tokens / elapsed:.1f} toks/s")
        except BaseException:
            # Interrupted (Ctrl-C) or failed: release every request of this call so the engine stays usable.
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return outputs


def _priorities(priority: Sequence[int] | None, num_prompts: int) -> Sequence[int]:
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, Sequence) or len(priority) != num_prompts:
        raise InvalidRequestError(f"priority must be a list of one int per prompt, i.e. {num_prompts} ints; got "
                                  f"{priority!r:.60}.")
    return priority


def _with_lora(prompts: list[PromptType], lora_request: LoRARequest | Sequence[LoRARequest | None] | None
               ) -> list[PromptType]:
    """The prompts as dicts that carry their adapter (the engine's input processor checks it)."""
    if lora_request is None:
        return prompts
    requests = [lora_request] * len(prompts) if isinstance(lora_request, LoRARequest) else list(lora_request)
    if len(requests) != len(prompts):
        raise InvalidRequestError(f"Got {len(requests)} lora_request for {len(prompts)} prompts; pass one "
                                  f"LoRARequest for all, or exactly one (or None) per prompt.")
    return [prompt if lora is None else {**({"prompt": prompt} if isinstance(prompt, str) else prompt),
                                         "lora_request": lora}
            for prompt, lora in zip(prompts, requests)]
