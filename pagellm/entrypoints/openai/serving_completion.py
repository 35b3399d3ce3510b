"""POST /v1/completions: prompts (text or token ids, one or a batch) -> a completion response or an SSE stream,
with OpenAI's legacy logprobs shape, the prompt echoed before each choice with `echo` (its tokens' logprobs too,
as evaluation harnesses score prompts) and vLLM's `prompt_logprobs`. With `use_beam_search` (vLLM's), each
prompt's `n` choices are the beams of the engine's beam search (AsyncLLM.beam_search, the one LLM.beam_search
runs), best first, sent when it ends."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import cast

from pagellm.entrypoints.openai.completion_logprobs import completion_logprobs, prompt_logprobs_response
from pagellm.entrypoints.openai.errors import OpenAIServingError, sse_error
from pagellm.entrypoints.openai.protocol_completion import CompletionRequest
from pagellm.entrypoints.openai.protocol_responses import CompletionResponse, CompletionResponseChoice
from pagellm.entrypoints.openai.serving_engine import (
    IndexedOutput,
    OpenAIServing,
    TokensPrompt,
    accumulate,
    chain_first,
    first_and_rest,
    usage,
)
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.sampling_params import SamplingParams

PromptLogprobsList = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class Echo:
    """What echo puts before a prompt's choices: the prompt's text and token ids (as the engine runs them, after
    truncate_prompt_tokens), and its first token's text (the one position without a logprob)."""

    text: str
    token_ids: list[int]
    first_token_text: str


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self,
                                request: CompletionRequest) -> CompletionResponse | AsyncGenerator[str, None]:
        model = self.model_name(request.model)
        params = request.completion_sampling_params()
        truncating = params.truncate_prompt_tokens is not None
        prompts = [await self._prompt(p, request.add_special_tokens, truncating) for p in self._batch(request.prompt)]
        for prompt in prompts:
            self.check_length(prompt, params, "prompt")
        self.check_batch_size(prompts, params)
        # Before the requests start: nothing may fail between their start and the response that closes them.
        echoes = [await self._echo(prompt, params) for prompt in prompts] if request.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if request.use_beam_search:
            first, rest = await self._start_beam_search(prompts, request, request_id)
        else:
            first, rest = await self.start(prompts, params, request_id, request)
        if request.stream:
            return self._stream(request, request_id, model, first, rest, echoes)
        return await self._full(request, request_id, model, chain_first(first, rest), echoes)

    async def _echo(self, prompt: TokensPrompt, params: SamplingParams) -> Echo:
        """A token-id or truncated prompt is echoed as its tokens' text (as vLLM)."""
        # The ids are decoded before the engine sees them: a request's own ids must be checked first (a 400).
        self.engine.frontend.input_processor.validate_prompt_tokens(prompt["prompt_token_ids"])
        token_ids = prompt["prompt_token_ids"][-self.num_prompt_tokens(prompt, params):]
        text = prompt["prompt"]
        if text is None or len(token_ids) < len(prompt["prompt_token_ids"]):
            text = await self.tokenizer.decode(token_ids)
        return Echo(text, token_ids, await self.tokenizer.decode(token_ids[:1]))

    async def _start_beam_search(self, prompts: list[TokensPrompt], request: CompletionRequest,
                                 request_id: str) -> tuple[IndexedOutput, AsyncGenerator[IndexedOutput, None]]:
        """As `start`: submit a beam search per prompt and wait for the first to finish, so a bad request fails
        before any response is sent."""
        return await first_and_rest(self._beam_search(prompt, request, f"{request_id}-{i}")
                                    for i, prompt in enumerate(self.request_prompts(prompts, request)))

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

    @staticmethod
    def _choice(request: CompletionRequest, index: int, completion: CompletionOutput, text_offset: int,
                echo: Echo | None = None, prompt_logprobs: PromptLogprobsList | None = None,
                prompt_ids: list[int] | None = None) -> CompletionResponseChoice:
        """One choice, or one choice's delta; `echo` (the first delta of a choice, or a whole one) puts the prompt
        and its logprobs (the engine's `prompt_logprobs`) before the completion."""
        text, token_ids, logprobs = completion.text, completion.token_ids, completion.logprobs
        if request.echo_only:
            text, token_ids, logprobs = "", [], []
        if echo is not None:
            text, token_ids = echo.text + text, echo.token_ids + token_ids
            if logprobs is not None:
                logprobs = (prompt_logprobs or [None] * len(echo.token_ids)) + logprobs
        legacy = None
        if request.logprobs is not None and logprobs is not None:
            legacy = completion_logprobs(token_ids, logprobs, request.logprobs, text_offset,
                                         echo.first_token_text if echo is not None else "")
        return CompletionResponseChoice(
            index=index, text=text, logprobs=legacy, finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            prompt_logprobs=prompt_logprobs_response(prompt_ids or [], prompt_logprobs, request.prompt_logprobs))

    async def _full(self, request: CompletionRequest, request_id: str, model: str,
                    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
                    echoes: list[Echo] | None) -> CompletionResponse:
        choices: dict[int, CompletionOutput] = {}
        latest: dict[int, RequestOutput] = {}  # per prompt
        prompt_logprobs: dict[int, PromptLogprobsList] = {}  # per prompt: they come with its first output
        async for prompt_index, output in outputs:
            latest[prompt_index] = output
            if output.prompt_logprobs is not None:
                prompt_logprobs[prompt_index] = output.prompt_logprobs
            accumulate(choices, prompt_index * request.n, output)

        def choice(i: int) -> CompletionResponseChoice:
            prompt_index = i // request.n
            return self._choice(request, i, choices[i], 0, echoes[prompt_index] if echoes else None,
                                prompt_logprobs.get(prompt_index), latest[prompt_index].prompt_token_ids)

        completion_tokens = 0 if request.echo_only else sum(len(c.token_ids) for c in choices.values())
        return CompletionResponse(id=request_id, model=model, choices=[choice(i) for i in sorted(choices)],
                                  usage=usage(latest, completion_tokens))

    async def _stream(self, request: CompletionRequest, request_id: str, model: str, first: tuple[int, RequestOutput],
                      rest: AsyncGenerator[tuple[int, RequestOutput], None],
                      echoes: list[Echo] | None) -> AsyncGenerator[str, None]:
        """As vLLM, each choice's first chunk holds the echoed prompt (and its logprobs) before its first text."""
        created = int(time.time())
        latest: dict[int, RequestOutput] = {}  # per prompt
        prompt_logprobs: dict[int, PromptLogprobsList] = {}
        completion_tokens = 0
        text_offsets: dict[int, int] = {}
        try:
            async for prompt_index, output in chain_first(first, rest):
                latest[prompt_index] = output
                if output.prompt_logprobs is not None:
                    prompt_logprobs[prompt_index] = output.prompt_logprobs
                choices = []
                for delta in output.outputs:
                    index = prompt_index * request.n + delta.index
                    echo = echoes[prompt_index] if echoes and index not in text_offsets else None
                    choice = self._choice(request, index, delta, text_offsets.get(index, 0), echo,
                                          prompt_logprobs.get(prompt_index))
                    choices.append(choice)
                    text_offsets[index] = text_offsets.get(index, 0) + len(choice.text)
                    completion_tokens += 0 if request.echo_only else len(delta.token_ids)
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
