"""`GET /tokenizer_info` (vLLM's): the tokenizer's configuration, its special tokens and chat template among it, as
vLLM serves it. Evaluation harnesses ask it first (lm-eval's local-completions then tokenizes through /tokenize)."""
from __future__ import annotations

import asyncio
from functools import lru_cache
from http import HTTPStatus
from typing import Any

from fastapi import APIRouter

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_responses import TokenizerInfoResponse
from pagellm.entrypoints.openai.routes.state import ServerStateDep
from pagellm.transformers_utils.tokenizer import get_tokenizer

router = APIRouter()


def _json_value(value: Any) -> Any:
    """Special tokens are AddedToken objects in the tokenizer's configuration: their text stands for them."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {key: _json_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(item) for item in value]
    return value


@lru_cache(maxsize=4)
def _tokenizer_info(tokenizer_name: str, chat_template: str | None) -> dict[str, Any]:
    # Its own tokenizer, loaded once: the server's tokenizer threads keep theirs busy with requests.
    tokenizer = get_tokenizer(tokenizer_name)
    info = {key: _json_value(value) for key, value in tokenizer.init_kwargs.items()
            if key not in ("vocab_file", "merges_file")}  # file paths of the server's disk, as vLLM drops them
    info["tokenizer_class"] = type(tokenizer).__name__
    if chat_template := chat_template or getattr(tokenizer, "chat_template", None):
        info["chat_template"] = chat_template
    return info


@router.get("/tokenizer_info", responses=responses(HTTPStatus.UNAUTHORIZED, HTTPStatus.BAD_REQUEST))
async def tokenizer_info(state: ServerStateDep) -> TokenizerInfoResponse:
    info = await asyncio.to_thread(_tokenizer_info, state.engine.config.model_config.tokenizer,
                                   state.tokenizer.chat_template)
    return TokenizerInfoResponse(**info)
