"""The errors the engine raises to its callers (offline and serving) beyond ValueError for bad input."""
from __future__ import annotations


class QueueFullError(RuntimeError):
    """`max_waiting_requests` requests are already waiting for capacity; the server answers 503 with
    Retry-After."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or failed): no request can run."""


class RequestFailedError(RuntimeError):
    """These requests failed inside the engine (the rest of the batch went on): request id -> why."""

    def __init__(self, errors: dict[str, str]) -> None:
        self.errors = errors
        details = "; ".join(f"{request_id}: {error}" for request_id, error in errors.items())
        super().__init__(f"{len(errors)} request(s) failed inside the engine ({details}); see the log.")
