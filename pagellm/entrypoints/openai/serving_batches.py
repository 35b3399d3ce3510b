"""`/v1/files` and `/v1/batches`: files kept in memory (up to MAX_FILE_STORE_BYTES in all) and batch jobs run as
tasks on the server's event loop, each line dispatched through the app itself (batch_jobs.py) at the scheduler's
background priority, behind interactive traffic under --scheduling-policy priority (see core/sched/step_limits.py).
Nothing survives a restart."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from http import HTTPStatus

from fastapi import FastAPI

from pagellm.entrypoints.openai.batch_jobs import BatchDispatcher, parse_line
from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.protocol_batch import (
    BatchCreateRequest,
    BatchErrorData,
    BatchErrors,
    BatchList,
    BatchObject,
    BatchRequestInput,
    BatchRequestOutput,
    FileDeleted,
    FileList,
    FileObject,
    random_id,
)

MAX_FILE_STORE_BYTES = 1 << 30  # all stored files together: uploads and batch outputs
FILE_PURPOSES = ("batch", "batch_output")


@dataclass
class FileStore:
    max_bytes: int = MAX_FILE_STORE_BYTES
    files: dict[str, tuple[FileObject, bytes]] = field(default_factory=dict)

    def used_bytes(self) -> int:
        return sum(len(content) for _, content in self.files.values())

    def add(self, filename: str, purpose: str, content: bytes) -> FileObject:
        if purpose not in FILE_PURPOSES:
            raise OpenAIServingError(f"purpose must be \"batch\" (the only files this server keeps), got "
                                     f"{purpose!r:.50}.", param="purpose")
        if self.used_bytes() + len(content) > self.max_bytes:
            raise OpenAIServingError(f"the file store is full ({self.max_bytes} bytes in all); delete files "
                                     "(DELETE /v1/files/{file_id}) to make room.", HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                     param="file")
        obj = FileObject(id=random_id("file-"), bytes=len(content), filename=filename, purpose=purpose)
        self.files[obj.id] = (obj, content)
        return obj

    def get(self, file_id: str, param: str = "file_id") -> tuple[FileObject, bytes]:
        if file_id not in self.files:
            raise OpenAIServingError(f"No file with id {file_id!r:.80}.", HTTPStatus.NOT_FOUND, param=param)
        return self.files[file_id]

    def delete(self, file_id: str) -> FileDeleted:
        self.get(file_id)
        del self.files[file_id]
        return FileDeleted(id=file_id)

    def list_files(self, purpose: str | None = None) -> FileList:
        return FileList(data=[obj for obj, _ in self.files.values() if purpose is None or obj.purpose == purpose])


@dataclass
class _Job:
    batch: BatchObject
    task: asyncio.Task | None = None


class OpenAIServingBatches:
    """The files and batches of one app; `app`: where batch lines are sent."""

    def __init__(self, app: FastAPI, priority: int) -> None:
        self.app = app
        self.priority = priority
        self.files = FileStore()
        self.jobs: dict[str, _Job] = {}

    def create(self, request: BatchCreateRequest, headers: dict[str, str]) -> BatchObject:
        _, content = self.files.get(request.input_file_id, "input_file_id")
        if not request.endpoint.startswith("/v1/") or request.endpoint.startswith(("/v1/batches", "/v1/files")):
            raise OpenAIServingError(f"endpoint must be an endpoint of this server such as /v1/chat/completions, "
                                     f"got {request.endpoint!r:.80}.", param="endpoint")
        batch = BatchObject(id=random_id("batch_"), endpoint=request.endpoint, input_file_id=request.input_file_id,
                            completion_window=request.completion_window, metadata=request.metadata)
        job = _Job(batch)
        self.jobs[batch.id] = job
        job.task = asyncio.create_task(self._run(job, content.decode("utf-8", "replace"), headers))
        return batch

    def retrieve(self, batch_id: str) -> BatchObject:
        if batch_id not in self.jobs:
            raise OpenAIServingError(f"No batch with id {batch_id!r:.80}.", HTTPStatus.NOT_FOUND, param="batch_id")
        return self.jobs[batch_id].batch

    def list_batches(self, after: str | None, limit: int) -> BatchList:
        batches = [job.batch for job in reversed(self.jobs.values())]  # newest first, as OpenAI
        if after is not None:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        page = batches[:limit]
        return BatchList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                         has_more=len(batches) > limit)

    async def cancel(self, batch_id: str) -> BatchObject:
        batch = self.retrieve(batch_id)
        job = self.jobs[batch_id]
        if batch.status in ("validating", "in_progress") and job.task is not None:
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
            job.task.cancel()
            await asyncio.gather(job.task, return_exceptions=True)
        return batch

    def _validate(self, batch: BatchObject, lines: list[str]) -> list[BatchErrorData]:
        """Lines whose url is not the batch's endpoint: OpenAI fails such a batch before running any of it (a line
        that is not a batch request at all gets an error line when the batch runs)."""
        errors = []
        for number, text in enumerate(lines, 1):
            parsed = parse_line(text)
            if isinstance(parsed, BatchRequestInput) and parsed.url != batch.endpoint:
                errors.append(BatchErrorData(code="invalid_url", line=number, param="url",
                                             message=f"line {number}'s url is not the batch's endpoint "
                                                     f"{batch.endpoint}."))
        return errors

    async def _run(self, job: _Job, content: str, headers: dict[str, str]) -> None:
        batch = job.batch
        lines = [line for line in content.splitlines() if line.strip()]
        outputs: list[BatchRequestOutput] = []
        errors: list[BatchRequestOutput] = []
        try:
            problems = self._validate(batch, lines)
            if problems or not lines:
                batch.errors = BatchErrors(data=problems or [BatchErrorData(
                    code="empty_file", message="the input file has no lines.")])
                batch.status, batch.failed_at = "failed", int(time.time())
                return
            batch.status, batch.in_progress_at = "in_progress", int(time.time())
            batch.request_counts.total = len(lines)
            dispatcher = BatchDispatcher(self.app, self.priority, headers)
            async for output in dispatcher.run(lines):
                ok = output.error is None and output.response is not None and output.response.status_code < 400
                (outputs if ok else errors).append(output)
                if ok:
                    batch.request_counts.completed += 1
                else:
                    batch.request_counts.failed += 1
            batch.status, batch.completed_at = "completed", int(time.time())
        except asyncio.CancelledError:
            batch.status, batch.cancelled_at = "cancelled", int(time.time())
        except Exception as exc:  # the job fails; the server keeps serving
            batch.errors = BatchErrors(data=[BatchErrorData(code="internal_error", message=str(exc))])
            batch.status, batch.failed_at = "failed", int(time.time())
        finally:
            self._store_results(batch, outputs, errors)

    def _store_results(self, batch: BatchObject, outputs: list[BatchRequestOutput],
                       errors: list[BatchRequestOutput]) -> None:
        for kind, lines in (("output", outputs), ("error", errors)):
            if not lines:
                continue
            content = "".join(line.model_dump_json() + "\n" for line in lines).encode()
            try:
                obj = self.files.add(f"{batch.id}_{kind}.jsonl", "batch_output", content)
            except OpenAIServingError as exc:
                batch.errors = BatchErrors(data=[BatchErrorData(code="file_store_full", message=exc.message)])
                continue
            if kind == "output":
                batch.output_file_id = obj.id
            else:
                batch.error_file_id = obj.id


def serving_batches(app: FastAPI) -> OpenAIServingBatches:
    """The app's batches, created on first use: batch lines run at the scheduler's background priority where the
    engine's policy is priority, and at 0 under any other policy (which refuses a non-zero priority)."""
    serving = getattr(app.state, "batches", None)
    if serving is None:
        scheduler_config = app.state.server.engine.config.scheduler_config
        priority = scheduler_config.background_priority if scheduler_config.scheduling_policy == "priority" else 0
        serving = OpenAIServingBatches(app, priority)
        app.state.batches = serving
    return serving
