"""What every OpenAI endpoint shares: the served model names, tokenization and the chat template (off the event
loop, see AsyncTokenizer), length checks against max_model_len, starting a batch of generations, and folding delta
outputs into whole completions."""
from __future__ import annotations

import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from http import HTTPStatus
from typing import Any

from jinja2 import TemplateError

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.protocol import SamplingRequest
from pagellm.entrypoints.openai.protocol_chat import ChatMessageParam
from pagellm.entrypoints.openai.protocol_responses import PromptTokenUsageInfo, UsageInfo
from pagellm.entrypoints.utils import merge_async_iterators
from pagellm.lora.request import LoRARequest
from pagellm.outputs import CompletionOutput, RequestOutput
from pagellm.sampling_params import SamplingParams

# {"prompt": str | None, "prompt_token_ids": [...]} and maybe "cache_salt": what AsyncLLM.generate takes.
TokensPrompt = dict[str, Any]
IndexedOutput = tuple[int, RequestOutput]  # (prompt index in the request, output)


def load_chat_template(chat_template: str | None) -> str | None:
    """--chat-template: a file path, or the Jinja template itself."""
    if chat_template is not None and os.path.isfile(chat_template):
        with open(chat_template, encoding="utf-8") as f:
            return f.read()
    return chat_template


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, served_model_names: list[str], tokenizer: AsyncTokenizer) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.tokenizer = tokenizer
        self.max_model_len = engine.config.model_config.max_model_len

    def model_name(self, requested: str | None) -> str:
        """The name to answer with (a served name or a loaded LoRA adapter's); an unknown model is a 404."""
        if requested is None:
            return self.served_model_names[0]
        if requested not in self.served_model_names and self.lora_request(requested) is None:
            raise OpenAIServingError(f"The model `{requested}` does not exist.", HTTPStatus.NOT_FOUND, "model")
        return requested

    def base_model_name(self, requested: str | None) -> str:
        """model_name for the routes LoRA adapters do not apply to (embeddings, scores): an adapter's name is a 400
        rather than a result silently computed by the base model."""
        if self.lora_request(requested) is not None:
            raise OpenAIServingError(f"`{requested}` is a LoRA adapter, and adapters apply to generation only; ask "
                                     f"the base model `{self.served_model_names[0]}` for embeddings and scores.",
                                     param="model")
        return self.model_name(requested)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter served as `model`, if it names one."""
        loras = self.engine.frontend.input_processor.loras
        return loras.get(model) if loras is not None and model else None

    def request_prompts(self, prompts: list[TokensPrompt], request: SamplingRequest) -> list[TokensPrompt]:
        """The prompts with the request's cache_salt and the LoRA adapter its `model` names, if any."""
        lora = self.lora_request(request.model)
        prompts = salted(prompts, request)
        return prompts if lora is None else [{**prompt, "lora_request": lora} for prompt in prompts]

    def _too_long(self, num_tokens: int, param: str, at_least: bool = False) -> OpenAIServingError:
        count = f"at least {num_tokens}" if at_least else str(num_tokens)
        return OpenAIServingError(f"The prompt is {count} tokens long, more than this model's maximum context "
                                  f"length of {self.max_model_len} tokens (--max-model-len).", param=param)

    async def text_prompt(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
                          truncating: bool = False) -> TokensPrompt:
        """Tokenize `text`. Unless the request truncates its prompt, a text too long to fit max_model_len
        whatever its tokens is refused before it is tokenized."""
        if not truncating and (at_least := self.tokenizer.min_num_tokens(text)) > self.max_model_len:
            raise self._too_long(at_least, param, at_least=True)
        return {"prompt": text, "prompt_token_ids": await self.tokenizer.encode(text, add_special_tokens)}

    async def chat_prompt(self, messages: list[ChatMessageParam], add_generation_prompt: bool,
                          add_special_tokens: bool = False, truncating: bool = False,
                          tools: list[dict[str, Any]] | None = None,
                          template_kwargs: dict[str, Any] | None = None,
                          continue_final_message: bool = False) -> TokensPrompt:
        """`template_kwargs`: the template's extra variables (chat_template_kwargs); `continue_final_message`:
        the last message left open, for the model to continue."""
        if not self.tokenizer.has_chat_template:
            raise OpenAIServingError("This model's tokenizer has no chat template; start the server with "
                                     "--chat-template, or use /v1/completions.")
        try:
            text = await self.tokenizer.render_chat([m.to_template_message() for m in messages],
                                                    add_generation_prompt, tools, template_kwargs,
                                                    continue_final_message)
        except TemplateError as exc:
            raise OpenAIServingError(f"The chat template could not render these messages: {exc}",
                                     param="messages") from exc
        except (TypeError, ValueError, AttributeError) as exc:
            if str(exc).startswith("continue_final_message is set"):  # transformers: no final text to continue
                raise OpenAIServingError(f"The final message cannot be continued: {exc}",
                                         param="continue_final_message") from exc
            if not template_kwargs:
                raise
            # A request variable replaced one the template relies on (e.g. {"range": 1}).
            raise OpenAIServingError(f"The chat template could not render with these chat_template_kwargs: {exc}",
                                     param="chat_template_kwargs") from exc
        # The template already holds any BOS; by default no special tokens are added, which would double it.
        return await self.text_prompt(text, add_special_tokens, "messages", truncating)

    @staticmethod
    def num_prompt_tokens(prompt: TokensPrompt, params: SamplingParams) -> int:
        """The prompt's length as the engine will see it (after truncate_prompt_tokens)."""
        return min(len(prompt["prompt_token_ids"]), params.truncate_prompt_tokens or len(prompt["prompt_token_ids"]))

    def check_length(self, prompt: TokensPrompt, params: SamplingParams, param: str) -> None:
        num_tokens = self.num_prompt_tokens(prompt, params)
        if num_tokens > self.max_model_len:
            raise self._too_long(num_tokens, param)
        if params.max_tokens is not None and num_tokens + params.max_tokens > self.max_model_len:
            raise OpenAIServingError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_tokens + params.max_tokens} tokens ({num_tokens} in the prompt, {params.max_tokens} for the "
                f"completion). Shorten the prompt or lower max_tokens.", param="max_tokens")

    def check_batch_size(self, prompts: list[TokensPrompt], params: SamplingParams) -> None:
        """A batch the server could never hold at once (sequence slots, KV blocks, waiting room) is refused
        outright: a 503 would invite retries that cannot succeed."""
        limit = self.engine.max_requests_at_once([self.num_prompt_tokens(p, params) for p in prompts], params.n)
        if limit is not None and len(prompts) > limit:
            raise OpenAIServingError(
                f"This request has {len(prompts)} prompts, but with n={params.n} the server holds at most {limit} "
                f"of them at once (sequence slots and KV cache of --max-num-seqs and --kv-cache-memory, plus "
                f"--max-waiting-requests); send fewer prompts per request.", param="prompt")

    async def start(self, prompts: list[TokensPrompt], params: SamplingParams, request_id: str,
                    request: SamplingRequest) -> tuple[IndexedOutput, AsyncGenerator[IndexedOutput, None]]:
        """Submit every prompt (with the request's cache_salt and priority) and wait for the first output, so that
        a bad request fails before any response is sent. Returns that first (prompt index, output) and the merged
        stream of the rest."""
        return await first_and_rest(self.engine.generate(prompt, params, f"{request_id}-{i}", request.priority)
                                    for i, prompt in enumerate(self.request_prompts(prompts, request)))


def salted(prompts: list[TokensPrompt], request: SamplingRequest) -> list[TokensPrompt]:
    """The prompts with the request's cache_salt, if it has one."""
    if request.cache_salt is None:
        return prompts
    return [{**prompt, "cache_salt": request.cache_salt} for prompt in prompts]


async def first_and_rest(
        streams: Iterable[AsyncIterator[RequestOutput]]) -> tuple[IndexedOutput, AsyncGenerator[IndexedOutput, None]]:
    """Merge the streams and wait for the first output (so a bad request fails before any response is sent):
    that first (prompt index, output) and the merged stream of the rest."""
    merged = merge_async_iterators(*streams)
    try:
        first = await anext(merged)
    except BaseException:
        await merged.aclose()
        raise
    return first, merged


async def chain_first(first: IndexedOutput,
                      rest: AsyncGenerator[IndexedOutput, None]) -> AsyncGenerator[IndexedOutput, None]:
    yield first
    async for item in rest:
        yield item


def accumulate(choices: dict[int, CompletionOutput], offset: int, output: RequestOutput) -> None:
    """Fold one delta output into whole completions, keyed by choice index (`offset` + completion index)."""
    for delta in output.outputs:
        choice = choices.setdefault(offset + delta.index, CompletionOutput(index=offset + delta.index, text="",
                                                                           token_ids=[]))
        choice.text += delta.text
        choice.token_ids += delta.token_ids
        if delta.logprobs is not None:
            choice.logprobs = (choice.logprobs or []) + delta.logprobs
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        choice.stop_reason = delta.stop_reason if delta.finish_reason else choice.stop_reason


def usage(prompts: dict[int, RequestOutput], completion_tokens: int) -> UsageInfo:
    """The usage block from the latest output of each prompt of the request (keyed by prompt index)."""
    prompt_tokens = sum(len(output.prompt_token_ids) for output in prompts.values())
    cached_tokens = sum(output.num_cached_tokens or 0 for output in prompts.values())
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens,
                     prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached_tokens))
