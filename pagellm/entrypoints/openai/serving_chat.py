"""POST /v1/chat/completions: messages (and tools) -> the chat template -> a chat completion or an SSE stream of
deltas, with OpenAI's chat logprobs shape, tool calls (see tool_calls.py) and vLLM's `prompt_logprobs` (of the
rendered prompt; not in streams).

With --reasoning-parser, each choice's text is split first (pagellm/reasoning/): the reasoning becomes vLLM's
`reasoning_content` (`delta.reasoning_content` in streams), and tool calls are parsed from the content after it.
A constraint on the output (response_format, structured_outputs, a forced tool call) holds that content too: the
engine starts the grammar after the reasoning's end tag (see structured_output/request.py)."""
from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from pagellm.entrypoints.openai.completion_logprobs import LOGPROB_FLOOR, prompt_logprobs_response
from pagellm.entrypoints.openai.errors import OpenAIServingError, sse_error
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
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
from pagellm.entrypoints.openai.tool_calls import (
    ExtractedToolCalls,
    ToolCallStreamer,
    extract_tool_calls,
    tool_call_constraint,
    tool_mode,
)
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput
from pagellm.reasoning import ReasoningParser, ReasoningSplit, get_reasoning_parser
from pagellm.sampling_params import SamplingParams

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


def chat_message(request: ChatCompletionRequest, mode: str, reasoning: ReasoningParser | None,
                 text: str) -> tuple[ChatMessage, ExtractedToolCalls]:
    """A whole choice's message: its reasoning split off first, then its tool calls parsed from the content."""
    split = reasoning.extract(text) if reasoning is not None else ReasoningSplit(None, text)
    extracted = extract_tool_calls(mode, request, split.content or "")
    # With a reasoning parser an empty content is null (vLLM's), as when the reasoning never closed.
    content = extracted.content or None if reasoning is not None else extracted.content
    return ChatMessage(role=ROLE, content=content, tool_calls=extracted.tool_calls,
                       reasoning_content=split.reasoning if request.include_reasoning else None), extracted


class ChoiceStreamer:
    """One choice's stream: each text delta is split into reasoning and content, and the content goes through the
    tool-call streamer; their deltas add up to `chat_message` of the whole text."""

    def __init__(self, mode: str, request: ChatCompletionRequest, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallStreamer(mode, request)
        self.reasoner = reasoning.streamer() if reasoning is not None else None
        self.include_reasoning = request.include_reasoning

    def feed(self, text: str, finished: bool) -> DeltaMessage:
        if self.reasoner is None:
            content, tool_calls = self.tools.feed(text, finished)
            return DeltaMessage(content=content, tool_calls=tool_calls)
        split = self.reasoner.feed(text, finished)
        if self.reasoner.in_reasoning and not finished:
            # Tool calls come from the content: a named call's opening delta waits for the reasoning to end.
            return DeltaMessage(reasoning_content=split.reasoning if self.include_reasoning else None)
        content, tool_calls = self.tools.feed(split.content or "", finished)
        return DeltaMessage(content=content or None, tool_calls=tool_calls,
                            reasoning_content=split.reasoning if self.include_reasoning else None)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self.tools.finish_reason(engine_reason)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], tokenizer: AsyncTokenizer) -> None:
        super().__init__(engine, served_model_names, tokenizer)
        name = engine.config.structured_outputs_config.reasoning_parser
        self.reasoning_parser = get_reasoning_parser(name) if name is not None else None

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
        template_kwargs = self._template_kwargs(request)
        prompt = await self.chat_prompt(request.messages, request.add_generation_prompt, request.add_special_tokens,
                                        truncating=params.truncate_prompt_tokens is not None, tools=tools,
                                        template_kwargs=template_kwargs,
                                        continue_final_message=request.continue_final_message)
        self.check_length(prompt, params, "messages")
        reasoning = self._reasoning(request, mode, params, prompt["prompt"], template_kwargs)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        first, rest = await self.start([prompt], params, request_id, request)
        if request.stream:
            return self._stream(request, mode, reasoning, request_id, model, first, rest)
        return await self._full(request, mode, reasoning, request_id, model, chain_first(first, rest))

    def _template_kwargs(self, request: ChatCompletionRequest) -> dict[str, object]:
        if request.reasoning_effort is not None and "reasoning_effort" not in self.tokenizer.chat_template_source:
            raise OpenAIServingError(
                "reasoning_effort is not supported by this model: its chat template never reads a reasoning_effort "
                "variable. Drop it, or set the template's own switches with chat_template_kwargs (Qwen3: "
                "{\"enable_thinking\": false}).", param="reasoning_effort")
        return request.template_kwargs()

    def _reasoning(self, request: ChatCompletionRequest, mode: str, params: SamplingParams, prompt: str,
                   template_kwargs: dict[str, object]) -> ReasoningParser | None:
        """The request's reasoning parser (None without --reasoning-parser). The engine starts a constraint after
        the reasoning, or at once when the prompt closed it; thinking turned off by chat_template_kwargs in a
        template that leaves reasoning open would leave the content unconstrained, so that is refused."""
        if self.reasoning_parser is None:
            return None
        parser = self.reasoning_parser(prompt, template_kwargs)
        if params.structured_outputs is not None and parser.thinking_disabled() and not parser.prompt_closes_reasoning:
            field = "tool_choice" if mode in ("named", "required") else \
                "structured_outputs" if request.structured_outputs is not None else "response_format"
            raise OpenAIServingError(
                f"{field} applies after the reasoning's {parser.end_tag}, but chat_template_kwargs turned thinking "
                f"off and this chat template does not close reasoning in the prompt, so the output would never reach "
                f"the constraint. Leave thinking on, or use a template that writes the empty reasoning block.",
                param="chat_template_kwargs")
        return parser

    @staticmethod
    def _logprobs(request: ChatCompletionRequest, completion: CompletionOutput) -> ChatCompletionLogProbs | None:
        if not request.logprobs or completion.logprobs is None:
            return None
        return chat_logprobs(completion.token_ids, completion.logprobs, request.top_logprobs or 0)

    def _choice(self, request: ChatCompletionRequest, mode: str, reasoning: ReasoningParser | None, index: int,
                completion: CompletionOutput) -> ChatCompletionResponseChoice:
        message, extracted = chat_message(request, mode, reasoning, completion.text)
        return ChatCompletionResponseChoice(index=index, message=message, logprobs=self._logprobs(request, completion),
                                            finish_reason=extracted.finish_reason(completion.finish_reason),
                                            stop_reason=completion.stop_reason)

    async def _full(self, request: ChatCompletionRequest, mode: str, reasoning: ReasoningParser | None,
                    request_id: str, model: str,
                    outputs: AsyncGenerator[tuple[int, RequestOutput], None]) -> ChatCompletionResponse:
        choices: dict[int, CompletionOutput] = {}
        latest: dict[int, RequestOutput] = {}
        prompt_logprobs = None  # they come with the first output
        async for _, output in outputs:
            latest[0] = output
            prompt_logprobs = output.prompt_logprobs or prompt_logprobs
            accumulate(choices, 0, output)
        return ChatCompletionResponse(
            id=request_id, model=model,
            choices=[self._choice(request, mode, reasoning, i, choices[i]) for i in sorted(choices)],
            usage=usage(latest, sum(len(c.token_ids) for c in choices.values())),
            prompt_logprobs=prompt_logprobs_response(latest[0].prompt_token_ids, prompt_logprobs,
                                                     request.prompt_logprobs))

    async def _stream(self, request: ChatCompletionRequest, mode: str, reasoning: ReasoningParser | None,
                      request_id: str, model: str, first: tuple[int, RequestOutput],
                      rest: AsyncGenerator[tuple[int, RequestOutput], None]) -> AsyncGenerator[str, None]:
        created = int(time.time())

        def chunk(choices: list[ChatCompletionResponseStreamChoice], **fields) -> str:
            response = ChatCompletionStreamResponse(id=request_id, created=created, model=model, choices=choices,
                                                    **fields)
            return f"data: {response.model_dump_json()}\n\n"

        completion_tokens = 0
        streamers = [ChoiceStreamer(mode, request, reasoning) for _ in range(request.n)]
        try:
            # As OpenAI: each choice opens with a delta holding only the role.
            yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=ROLE, content=""))
                         for i in range(request.n)])
            async for _, output in chain_first(first, rest):
                choices = []
                for delta in output.outputs:
                    streamer = streamers[delta.index]
                    choices.append(ChatCompletionResponseStreamChoice(
                        index=delta.index, delta=streamer.feed(delta.text, delta.finish_reason is not None),
                        logprobs=self._logprobs(request, delta),
                        finish_reason=streamer.finish_reason(delta.finish_reason), stop_reason=delta.stop_reason))
                    completion_tokens += len(delta.token_ids)
                yield chunk(choices)
            if request.include_usage:
                yield chunk([], usage=usage({0: first[1]}, completion_tokens))
        except Exception as exc:  # the response has started: report the error as the stream's last event
            yield sse_error(exc)
        finally:
            await rest.aclose()
        yield "data: [DONE]\n\n"
