"""`GET /v1/models`: one card per served model name, with the model it serves and its context length, then one per
loaded LoRA adapter (its `parent`: the base model's name, as vLLM)."""
from __future__ import annotations

from http import HTTPStatus

from fastapi import APIRouter

from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.protocol_responses import ModelCard, ModelList
from pagellm.entrypoints.openai.routes.state import ServerStateDep

router = APIRouter()


@router.get("/v1/models", responses=responses(HTTPStatus.UNAUTHORIZED, HTTPStatus.BAD_REQUEST))
async def models(state: ServerStateDep) -> ModelList:
    loras = state.engine.frontend.input_processor.loras
    adapters = [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=state.served_model_names[0],
                          max_model_len=state.completion.max_model_len) for lora in (loras.named() if loras else [])]
    return ModelList(data=[ModelCard(id=name, root=state.engine.config.model_config.model,
                                     max_model_len=state.completion.max_model_len)
                           for name in state.served_model_names] + adapters)
