"""OpenAI's batch shapes: one line of a batch input file and of its output file (as vLLM's `run-batch`), and the
objects of `/v1/files` and `/v1/batches`."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagellm.entrypoints.openai.protocol_base import OpenAIBaseModel

BatchStatus = Literal["validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled"]


def random_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class BatchRequestInput(BaseModel):
    """One line of a batch input file."""
    custom_id: str
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


class BatchResponseData(BaseModel):
    status_code: int
    request_id: str
    body: Any = None


class BatchLineError(BaseModel):
    code: str
    message: str


class BatchRequestOutput(BaseModel):
    """One line of a batch output (or error) file."""
    id: str = Field(default_factory=lambda: random_id("batch_req_"))
    custom_id: str | None
    response: BatchResponseData | None
    error: BatchLineError | None = None


class FileObject(OpenAIBaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int = Field(default_factory=lambda: int(time.time()))
    filename: str
    purpose: str
    status: Literal["processed"] = "processed"


class FileList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False


class FileDeleted(OpenAIBaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchCreateRequest(OpenAIBaseModel):
    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None


class BatchRequestCounts(OpenAIBaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchErrorData(OpenAIBaseModel):
    code: str
    message: str
    line: int | None = None
    param: str | None = None


class BatchErrors(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[BatchErrorData]


class BatchObject(OpenAIBaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: BatchErrors | None = None
    created_at: int = Field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None


class BatchList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False
