"""The errors pagellm raises to its callers, offline and serving: bad input (a 400 over HTTP), a full queue (503),
a stopped engine (503), and a request that failed inside the engine (500). Anything else is a bug (500)."""
from __future__ import annotations


class InvalidRequestError(ValueError):
    """The request asks for something invalid or impossible here; the message names the field and the limit.
    (A ValueError, as vLLM raises for bad parameters, so callers that catch ValueError keep working.)"""


class QueueFullError(RuntimeError):
    """`max_waiting_requests` requests are already waiting for capacity; the server answers 503 with
    Retry-After."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or failed): no request can run."""


class RequestFailedError(RuntimeError):
    """These requests failed inside the engine (the rest of the batch went on): request id -> why. Raised by a
    step, it carries that step's outputs for the other requests in `outputs`."""

    def __init__(self, errors: dict[str, str], outputs: list | None = None) -> None:
        self.errors = errors
        self.outputs = outputs or []
        details = "; ".join(f"{request_id}: {error}" for request_id, error in errors.items())
        super().__init__(f"{len(errors)} request(s) failed inside the engine ({details}); see the log.")
