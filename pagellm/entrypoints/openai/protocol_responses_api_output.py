"""Pydantic models of what OpenAI's Responses API (`/v1/responses`) sends back: the response object with its output
items, usage and status, and the stream events, one server-sent event each (`sse_event`). The request and the items
it shares with the output are in protocol_responses_api.py."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import Field

from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel
from pagellm.entrypoints.openai.protocol_responses_api import (
    FunctionCallItem,
    FunctionTool,
    FunctionToolChoice,
    OutputText,
    ReasoningConfig,
    ReasoningItem,
    ReasoningText,
    TextConfig,
)


# ---- response ---------------------------------------------------------------------------------------------------
class OutputMessage(OpenAIBaseModel):
    type: Literal["message"] = "message"
    id: str
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


OutputItem = Annotated[ReasoningItem | OutputMessage | FunctionCallItem, Field(discriminator="type")]


class InputTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(OpenAIBaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIBaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(OpenAIBaseModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(OpenAIBaseModel):
    code: str
    message: str


class ResponseObject(OpenAIBaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = False
    temperature: float | None = None
    text: TextConfig = Field(default_factory=TextConfig)
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice = "auto"
    tools: list[FunctionTool] = Field(default_factory=list)
    top_p: float | None = None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(OpenAIBaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: Literal[True] = True


def new_id(prefix: str) -> str:
    """An id of OpenAI's form: "resp_...", "msg_...", "fc_...", "rs_..."."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- stream events ----------------------------------------------------------------------------------------------
class ResponseLifecycleEvent(OpenAIBaseModel):
    """response.created, response.in_progress, response.completed, response.incomplete: the whole response."""

    type: Literal["response.created", "response.in_progress", "response.completed", "response.incomplete"]
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(OpenAIBaseModel):
    type: Literal["response.output_item.added", "response.output_item.done"]
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(OpenAIBaseModel):
    type: Literal["response.content_part.added", "response.content_part.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: Annotated[OutputText | ReasoningText, Field(discriminator="type")]


class TextDeltaEvent(OpenAIBaseModel):
    """response.output_text.delta and response.reasoning_text.delta."""

    type: Literal["response.output_text.delta", "response.reasoning_text.delta"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[dict[str, Any]] | None = None  # output_text's (always empty: no logprobs here)


class TextDoneEvent(OpenAIBaseModel):
    type: Literal["response.output_text.done", "response.reasoning_text.done"]
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[dict[str, Any]] | None = None


class FunctionCallArgumentsEvent(OpenAIBaseModel):
    """response.function_call_arguments.delta (with `delta`) and .done (with the whole `arguments` and name)."""

    type: Literal["response.function_call_arguments.delta", "response.function_call_arguments.done"]
    sequence_number: int
    item_id: str
    output_index: int
    delta: str | None = None
    arguments: str | None = None
    name: str | None = None


class ResponseErrorEvent(OpenAIBaseModel):
    """The last event of a stream that failed after it started."""

    type: Literal["error"] = "error"
    sequence_number: int
    code: str | None = None
    message: str
    param: str | None = None


ResponseStreamEvent = (ResponseLifecycleEvent | OutputItemEvent | ContentPartEvent | TextDeltaEvent | TextDoneEvent
                       | FunctionCallArgumentsEvent | ResponseErrorEvent)


def sse_event(event: ResponseStreamEvent) -> str:
    """One server-sent event as OpenAI sends it: its type as the event name, the JSON as its data."""
    return f"event: {event.type}\ndata: {event.model_dump_json(exclude_none=True)}\n\n"
