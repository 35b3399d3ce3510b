"""The base of every API model (its own module so that protocol.py and protocol_structured.py can share it)."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class OpenAIBaseModel(BaseModel):
    # Unknown fields are ignored, as by OpenAI and vLLM; known fields that would change the result but are not
    # implemented are listed in `unsupported_fields` and refused instead.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
