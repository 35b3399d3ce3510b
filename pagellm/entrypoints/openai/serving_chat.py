"""POST /v1/chat/completions: messages (and tools) -> the chat template -> a chat completion or an SSE stream of
deltas, with OpenAI's chat logprobs shape, tool calls (see tool_calls.py) and vLLM's `prompt_logprobs` (of the
rendered prompt; not in streams)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

from pagellm.entrypoints.openai.completion_logprobs import LOGPROB_FLOOR, prompt_logprobs_response
from pagellm.entrypoints.openai.errors import sse_error
from pagellm.entrypoints.openai.protocol import ChatCompletionRequest
from pagellm.entrypoints.openai.protocol_responses import (
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogProb,
    ChatLogProbsContent,
    ChatMessage,
    DeltaMessage,
)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing, accumulate, chain_first, usage
from pagellm.entrypoints.openai.tool_calls import ToolCallStreamer, extract_tool_calls, tool_call_constraint, tool_mode
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput

ROLE = "assistant"


def _chat_logprob(logprob: Logprob) -> ChatLogProb:
    token = logprob.decoded_token or ""
    return ChatLogProb(token=token, logprob=max(logprob.logprob, LOGPROB_FLOOR), bytes=list(token.encode()))


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], num_top: int) -> ChatCompletionLogProbs:
    """Per token: the chosen token and the `num_top` most likely ones, most likely first."""
    content = []
    for token_id, step in zip(token_ids, logprobs):
        ranked = sorted(step.values(), key=lambda lp: -lp.logprob)[:num_top]
        chosen = _chat_logprob(step[token_id])
        content.append(ChatLogProbsContent(**chosen.model_dump(), top_logprobs=[_chat_logprob(lp) for lp in ranked]))
    return ChatCompletionLogProbs(content=content)


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(
            self, request: ChatCompletionRequest) -> ChatCompletionResponse | AsyncGenerator[str, None]:
        model = self.model_name(request.model)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        mode = tool_mode(request, self.tokenizer.supports_tools)
        params = request.to_sampling_params(max_tokens, num_logprobs, tool_call_constraint(request, mode))
        # "none" ignores the tools entirely: the model is not told about them.
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools and mode != "none" \
            else None
        prompt = await self.chat_prompt(request.messages, request.add_generation_prompt, request.add_special_tokens,
                                        truncating=params.truncate_prompt_tokens is not None, tools=tools)
        self.check_length(prompt, params, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        first, rest = await self.start([prompt], params, request_id, request)
        if request.stream:
            return self._stream(request, mode, request_id, model, first, rest)
        return await self._full(request, mode, request_id, model, chain_first(first, rest))

    @staticmethod
    def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput) -> ChatCompletionLogProbs | None:
        if not request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, request.top_logprobs or 0)

    def _choice(self, request: ChatCompletionRequest, mode: str, index: int,
                completion: CompletionOutput) -> ChatCompletionResponseChoice:
        extracted = extract_tool_calls(mode, request, completion.text)
        return ChatCompletionResponseChoice(index=index, message=ChatMessage(role=ROLE, content=extracted.content,
                                                                             tool_calls=extracted.tool_calls),
                                            logprobs=self._logprobs(request, completion),
                                            finish_reason=extracted.finish_reason(completion.finish_reason),
                                            stop_reason=completion.stop_reason)

    async def _full(self, request: ChatCompletionRequest, mode: str, request_id: str, model: str,
                    outputs: AsyncGenerator[tuple[int, RequestOutput], None]) -> ChatCompletionResponse:
        choices: dict[int, CompletionOutput] = {}
        latest: dict[int, RequestOutput] = {}
        prompt_logprobs = None  # they come with the first output
        async for _, output in outputs:
            latest[0] = output
            prompt_logprobs = output.prompt_logprobs or prompt_logprobs
            accumulate(choices, 0, output)
        return ChatCompletionResponse(
            id=request_id, model=model, choices=[self._choice(request, mode, i, choices[i]) for i in sorted(choices)],
            usage=usage(latest, sum(len(c.token_ids) for c in choices.values())),
            prompt_logprobs=prompt_logprobs_response(latest[0].prompt_token_ids, prompt_logprobs,
                                                     request.prompt_logprobs))

    async def _stream(self, request: ChatCompletionRequest, mode: str, request_id: str, model: str,
                      first: tuple[int, RequestOutput],
                      rest: AsyncGenerator[tuple[int, RequestOutput], None]) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionResponseStreamChoice], **fields) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    **fields)
            return f"data: {response.model_dump_json()}\n\n"

        completion_tokens = 0
        streamers = [ToolCallStreamer(mode, request) for _ in range(request.n)]
        try:
            # As OpenAI: each choice opens with a delta holding only the role.
            yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=ROLE, content=""))
                         for i in range(request.n)])
            async for _, output in chain_first(first, rest):
                choices = []
                for delta in output.outputs:
                    streamer = streamers[delta.index]
                    content, tool_calls = streamer.feed(delta.text, delta.finish_reason is not None)
                    choices.append(ChatCompletionResponseStreamChoice(
                        index=delta.index, delta=DeltaMessage(content=content, tool_calls=tool_calls),
                        logprobs=self._logprobs(request, delta), finish_reason=streamer.finish_reason(
                            delta.finish_reason), stop_reason=delta.stop_reason))
                    completion_tokens += len(delta.token_ids)
                yield chunk(choices)
            if request.include_usage:
                yield chunk([], usage=usage({0: first[1]}, completion_tokens))
        except Exception as exc:  # the response has started: report the error as the stream's last event
            yield sse_error(exc)
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"
