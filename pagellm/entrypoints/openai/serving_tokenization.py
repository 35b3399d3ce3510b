"""POST /tokenize and /detokenize (vLLM's shapes): a prompt or chat messages -> token ids, and back."""
from __future__ import annotations

from pagellm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                 TokenizeCompletionRequest, TokenizeResponse)
from pagellm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
        self.model_name(request.model)
        if isinstance(request, TokenizeChatRequest):
            prompt = self.chat_prompt(request.messages, request.add_generation_prompt, request.add_special_tokens)
            token_ids = prompt["prompt_token_ids"]
        else:
            token_ids = self.text_prompt(request.prompt, request.add_special_tokens)["prompt_token_ids"]
        token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len, tokens=token_ids,
                                token_strs=token_strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(request.model)
        vocab_size = self.engine.config.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"Token id {bad[0]} is out of range: ids must be in [0, {vocab_size}).")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
