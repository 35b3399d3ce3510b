"""POST /tokenize and /detokenize (vLLM's shapes): a prompt or chat messages -> token ids, and back. Bounded like
the generation endpoints: a prompt longer than max_model_len tokens is refused."""
from __future__ import annotations

from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.protocol_responses import DetokenizeResponse, TokenizeResponse
from pagellm.entrypoints.openai.protocol_tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.model_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools] if request.tools else None
            prompt = await self.chat_prompt(request.messages, request.add_generation_prompt,
                                            request.add_special_tokens, tools=tools,
                                            template_kwargs=request.chat_template_kwargs,
                                            continue_final_message=request.continue_final_message)
        else:
            prompt = await self.text_prompt(request.prompt, request.add_special_tokens)
        token_ids = prompt["prompt_token_ids"]
        if len(token_ids) > self.max_model_len:
            raise self._too_long(len(token_ids), "messages" if isinstance(request, TokenizeChatRequest) else "prompt")
        token_strs = await self.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(request.model)
        vocab_size = self.engine.config.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise OpenAIServingError(f"Token id {bad[0]} is out of range: ids must be in [0, {vocab_size}).",
                                     param="tokens")
        return DetokenizeResponse(prompt=await self.tokenizer.decode(request.tokens))
