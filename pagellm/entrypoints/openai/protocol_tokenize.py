"""The requests of vLLM's `/tokenize` (a prompt, or the chat form: the prompt the chat endpoint would render) and
`/detokenize`."""
from __future__ import annotations

from typing import Annotated, Any, ClassVar

from pydantic import Field, model_validator

from pagellm.entrypoints.openai.protocol import MAX_TOOLS, RequestModel
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest, ChatMessageParam, check_template_fields
from pagellm.entrypoints.openai.protocol_structured import ChatCompletionToolsParam


class TokenizeCompletionRequest(RequestModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(RequestModel):
    """vLLM's chat form of /tokenize: the prompt the chat endpoint would render for these fields."""

    unsupported_fields: ClassVar[dict[str, str]] = {
        name: ChatCompletionRequest.unsupported_fields[name]
        for name in ("chat_template", "documents", "mm_processor_kwargs")}

    model: str | None = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _template_fields(self) -> TokenizeChatRequest:
        check_template_fields(self.chat_template_kwargs, self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]
