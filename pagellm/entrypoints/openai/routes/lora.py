"""`POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's): serve a PEFT adapter as a model name,
or stop serving it. Requests name a loaded adapter by `model`. A bad adapter is a 400 naming the problem, and
leaves the adapters already loaded as they were."""
from __future__ import annotations

import asyncio
from http import HTTPStatus

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.openapi import responses
from pagellm.entrypoints.openai.routes.state import ServerState, ServerStateDep
from pagellm.lora.registry import LoRARegistry

router = APIRouter()
# vLLM answers a load or unload with a line of text; errors are OpenAI's JSON error body.
_SUCCESS: dict[int | str, dict] = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}}}


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # accepted as vLLM does; the name identifies the adapter


def _registry(state: ServerState) -> LoRARegistry:
    loras = state.engine.frontend.input_processor.loras
    if loras is None:
        raise OpenAIServingError("LoRA adapters are off: start the server with --enable-lora.")
    return loras


@router.post("/v1/load_lora_adapter", responses={**responses(HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED,
                                                           HTTPStatus.REQUEST_ENTITY_TOO_LARGE), **_SUCCESS})
async def load_lora_adapter(body: LoadLoRAAdapterRequest, state: ServerStateDep) -> PlainTextResponse:
    loras = _registry(state)
    if body.lora_name in state.served_model_names:
        raise OpenAIServingError(f"{body.lora_name!r} is the base model's name; pick another.", param="lora_name")
    try:
        # Reading the adapter's tensors takes milliseconds to seconds: off the event loop.
        await asyncio.to_thread(loras.load, body.lora_name, body.lora_path)
    except ValueError as exc:  # the adapter's own problems name its path; the rest are about the name or the limit
        param = "lora_path" if str(exc).startswith("LoRA adapter ") else "lora_name"
        raise OpenAIServingError(str(exc), param=param) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", responses={**responses(HTTPStatus.BAD_REQUEST, HTTPStatus.NOT_FOUND,
                                                               HTTPStatus.UNAUTHORIZED,
                                                               HTTPStatus.REQUEST_ENTITY_TOO_LARGE), **_SUCCESS})
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, state: ServerStateDep) -> PlainTextResponse:
    try:
        _registry(state).unload(body.lora_name)
    except KeyError:
        raise OpenAIServingError(f"No LoRA adapter named {body.lora_name!r} is loaded.", HTTPStatus.NOT_FOUND,
                                 "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

