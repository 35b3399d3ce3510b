"""The errors pagellm raises to its callers, offline and serving: bad input (a 400 over HTTP), a full queue (503),
a stopped engine (503), and a request that failed inside the engine (500; 400 when the request itself was at
fault, such as a grammar that met a resource limit mid-generation). Anything else is a bug (500)."""
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


def failure_reason(exc: BaseException) -> str:
    """Why a request failed inside the engine, as the engine reports it (a string: it crosses processes)."""
    return f"{type(exc).__name__}: {exc}"


def request_failure(request_id: str, reason: str) -> Exception:
    """The exception a failed request's caller gets: the InvalidRequestError the engine met when the request itself
    was at fault (see `failure_reason`), otherwise RequestFailedError."""
    prefix = f"{InvalidRequestError.__name__}: "
    if reason.startswith(prefix):
        return InvalidRequestError(reason[len(prefix):])
    return RequestFailedError({request_id: reason})
