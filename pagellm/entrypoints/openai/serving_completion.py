"""POST /v1/completions: prompts (text or token ids, one or a batch) -> a completion response or an SSE stream,
with OpenAI's legacy logprobs shape. With `use_beam_search` (vLLM's), each prompt's `n` choices are the beams of
the engine's beam search (AsyncLLM.beam_search, the one LLM.beam_search runs), best first, sent when it ends."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import cast

from pagellm.entrypoints.openai.errors import OpenAIServingError, sse_error
from pagellm.entrypoints.openai.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
)
from pagellm.entrypoints.openai.serving_engine import (
    IndexedOutput,
    OpenAIServing,
    TokensPrompt,
    accumulate,
    chain_first,
    usage,
)
from pagellm.entrypoints.utils import merge_async_iterators
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int,
                        text_offset: int) -> CompletionLogProbs:
    """Per token: its text, logprob, the `num_top` most likely tokens (most likely first, plus the chosen one),
    and where its text starts in the completion."""
    result = CompletionLogProbs()
    for token_id, step in zip(token_ids, logprobs):
        chosen = step[token_id]
        token = chosen.decoded_token or ""
        ranked = sorted(step.items(), key=lambda item: -item[1].logprob)[:num_top]
        if token_id not in dict(ranked):
            ranked.append((token_id, chosen))
        result.tokens.append(token)
        result.token_logprobs.append(max(chosen.logprob, LOGPROB_FLOOR))
        result.top_logprobs.append({lp.decoded_token or "": max(lp.logprob, LOGPROB_FLOOR) for _, lp in ranked})
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self,
                                request: CompletionRequest) -> CompletionResponse | AsyncGenerator[str, None]:
        model = self.model_name(request.model)
        params = request.to_sampling_params(request.max_tokens, request.logprobs)
        truncating = params.truncate_prompt_tokens is not None
        prompts = [await self._prompt(p, request.add_special_tokens, truncating) for p in self._batch(request.prompt)]
        for prompt in prompts:
            self.check_length(prompt, params, "prompt")
        self.check_batch_size(prompts, params)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if request.use_beam_search:
            first, rest = await self._start_beam_search(prompts, request, request_id)
        else:
            first, rest = await self.start(prompts, params, request_id, request)
        if request.stream:
            return self._stream(request, request_id, model, first, rest)
        return await self._full(request, request_id, model, chain_first(first, rest))

    async def _start_beam_search(self, prompts: list[TokensPrompt], request: CompletionRequest,
                                 request_id: str) -> tuple[IndexedOutput, AsyncGenerator[IndexedOutput, None]]:
        """As `start`: submit a beam search per prompt and wait for the first to finish, so a bad request fails
        before any response is sent."""
        if request.cache_salt is not None:
            prompts = [{**prompt, "cache_salt": request.cache_salt} for prompt in prompts]
        merged = merge_async_iterators(*(self._beam_search(prompt, request, f"{request_id}-{i}")
                                         for i, prompt in enumerate(prompts)))
        try:
            first = await anext(merged)
        except BaseException:
            await merged.aclose()
            raise
        return first, merged

    async def _beam_search(self, prompt: TokensPrompt, request: CompletionRequest,
                           request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """One prompt's beam search as one finished RequestOutput whose completions are its beams, best first
        (token ids: what each beam generated, a final EOS included, as vLLM reports them)."""
        prompt_ids = prompt["prompt_token_ids"]
        params = request.to_beam_search_params(request.max_tokens or self.max_model_len - len(prompt_ids))
        async for result in self.engine.beam_search(prompt, params, request_id):
            beams = [CompletionOutput(index=i, text=beam.text or "", token_ids=beam.tokens[len(prompt_ids):],
                                      cumulative_logprob=beam.cum_logprob, finish_reason=beam.finish_reason)
                     for i, beam in enumerate(result.sequences)]
            yield RequestOutput(request_id, prompt.get("prompt"), prompt_ids, beams, finished=True)

    @staticmethod
    def _batch(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
        """The request's prompts: one text or token-id list, or a batch of either."""
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            return [cast(str | list[int], prompt)]
        return list(cast(list[str] | list[list[int]], prompt))

    async def _prompt(self, prompt: str | list[int], add_special_tokens: bool, truncating: bool) -> TokensPrompt:
        if isinstance(prompt, str):
            return await self.text_prompt(prompt, add_special_tokens, truncating=truncating)
        if not prompt:
            raise OpenAIServingError("prompt must not be empty.", param="prompt")
        return {"prompt": None, "prompt_token_ids": list(prompt)}

    def _choice(self, request: CompletionRequest, index: int, completion: CompletionOutput,
                text_offset: int) -> CompletionResponseChoice:
        logprobs = None
        if request.logprobs is not None and completion.logprobs is not None:
            logprobs = completion_logprobs(completion.token_ids, completion.logprobs, request.logprobs, text_offset)
        return CompletionResponseChoice(index=index, text=completion.text, logprobs=logprobs,
                                        finish_reason=completion.finish_reason, stop_reason=completion.stop_reason)

    async def _full(self, request: CompletionRequest, request_id: str, model: str,
                    outputs: AsyncGenerator[tuple[int, RequestOutput], None]) -> CompletionResponse:
        choices: dict[int, CompletionOutput] = {}
        latest: dict[int, RequestOutput] = {}  # per prompt
        async for prompt_index, output in outputs:
            latest[prompt_index] = output
            accumulate(choices, prompt_index * request.n, output)
        return CompletionResponse(
            id=request_id, model=model,
            choices=[self._choice(request, i, choices[i], 0) for i in sorted(choices)],
            usage=usage(latest, sum(len(c.token_ids) for c in choices.values())))

    async def _stream(self, request: CompletionRequest, request_id: str, model: str, first: tuple[int, RequestOutput],
                      rest: AsyncGenerator[tuple[int, RequestOutput], None]) -> AsyncGenerator[str, None]:
        created = int(time.time())
        latest: dict[int, RequestOutput] = {}  # per prompt
        completion_tokens = 0
        text_offsets: dict[int, int] = {}
        try:
            async for prompt_index, output in chain_first(first, rest):
                latest[prompt_index] = output
                choices = []
                for delta in output.outputs:
                    index = prompt_index * request.n + delta.index
                    choices.append(self._choice(request, index, delta, text_offsets.get(index, 0)))
                    text_offsets[index] = text_offsets.get(index, 0) + len(delta.text)
                    completion_tokens += len(delta.token_ids)
                chunk = CompletionResponse(id=request_id, created=created, model=model, choices=choices)
                yield f"data: {chunk.model_dump_json()}\n\n"
            if request.include_usage:
                chunk = CompletionResponse(id=request_id, created=created, model=model, choices=[],
                                           usage=usage(latest, completion_tokens))
                yield f"data: {chunk.model_dump_json()}\n\n"
        except Exception as exc:  # the response has started: report the error as the stream's last event
            yield sse_error(exc)
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"
