"""Every failure as an OpenAI error body `{"error": {"message", "type", "param", "code"}}`: the exception the serving
code raises, and the app-wide handlers for bad parameters, malformed requests, a full queue, a stopped engine and
unexpected errors (a generic message to the client; the trace stays in the server log)."""
from __future__ import annotations

import json
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from pagellm.entrypoints.openai.protocol_responses import ErrorInfo, ErrorResponse
from pagellm.exceptions import EngineDeadError, InvalidRequestError, QueueFullError, RequestFailedError
from pagellm.logger import init_logger
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)

RETRY_AFTER_SECONDS = 1
MAX_REPORTED_VALIDATION_ERRORS = 5
_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
}
# Request fields whose name may open an InvalidRequestError's message (the error's `param`).
_PARAM_NAMES = (frozenset(SamplingParams.__dataclass_fields__) | frozenset(PoolingParams.__dataclass_fields__)
                | {"priority", "cache_salt"})


class OpenAIServingError(Exception):
    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param


def error_body(message: str, status: HTTPStatus, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=_ERROR_TYPES.get(status, status.phrase),
                                         param=param, code=status.value))


def error_response(message: str, status: HTTPStatus, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param).model_dump(), status_code=status.value, headers=headers)


def to_error_body(exc: Exception) -> ErrorResponse:
    """The body for an error raised while serving (also sent as the last event of a broken stream)."""
    if isinstance(exc, OpenAIServingError):
        return error_body(exc.message, exc.status, exc.param)
    if isinstance(exc, InvalidRequestError):
        # SamplingParams and the engine's input checks start their messages with the offending field's name. Any
        # other ValueError is a bug, answered 500 below like every unexpected error.
        first_word = str(exc).split(" ", 1)[0].split(".", 1)[0]  # "structured_outputs.regex ..." names its field
        return error_body(str(exc), HTTPStatus.BAD_REQUEST, first_word if first_word in _PARAM_NAMES else None)
    if isinstance(exc, QueueFullError):
        return error_body(str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, EngineDeadError):
        return error_body(str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, RequestFailedError):
        # The cause is in the server log; the client learns only that its request alone failed.
        return error_body("The request failed inside the engine (other requests were not affected); see the "
                          "server log.", HTTPStatus.INTERNAL_SERVER_ERROR)
    return error_body("Internal server error; see the server log.", HTTPStatus.INTERNAL_SERVER_ERROR)


def sse_error(exc: Exception) -> str:
    """The last event of a stream that failed after the response started."""
    body = to_error_body(exc)
    if body.error.code == HTTPStatus.INTERNAL_SERVER_ERROR:
        logger.error("A streamed response failed", exc_info=exc)
    return f"data: {json.dumps(body.model_dump())}\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    errors = exc.errors()
    for error in errors[:MAX_REPORTED_VALIDATION_ERRORS]:
        # Locations name the body (or the query string), then fields; a union body adds the member's class name
        # (CamelCase), not a field.
        location = [str(part) for part in error.get("loc", ())
                    if part not in ("body", "query") and not str(part)[:1].isupper()]
        if error.get("type") == "json_invalid":
            parts.append(f"Malformed JSON: {error.get('msg')}")
            continue
        # Model-level checks (an unsupported field, say) name their field in the error's context.
        field = (error.get("ctx") or {}).get("field")
        param = param or (location[0] if location else field)
        parts.append(f"{'.'.join(location) or field or 'body'}: {error.get('msg')}")
    if len(errors) > MAX_REPORTED_VALIDATION_ERRORS:  # a bad item of a long list fails every union member
        parts.append(f"and {len(errors) - MAX_REPORTED_VALIDATION_ERRORS} more")
    return "; ".join(parts) or "Invalid request.", param


def register_error_handlers(app: FastAPI) -> None:
    async def on_serving_error(request: Request, exc: Exception) -> JSONResponse:
        body = to_error_body(exc)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if isinstance(exc, QueueFullError) else None
        return JSONResponse(body.model_dump(), status_code=body.error.code, headers=headers)

    async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI answers 422; OpenAI's API (and its clients) expect 400 for a malformed or ill-typed request.
        message, param = _validation_message(exc)
        return error_response(message, HTTPStatus.BAD_REQUEST, param)

    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(str(exc.detail), HTTPStatus(exc.status_code), headers=exc.headers)

    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        # Starlette re-raises after this handler, so the server logs the trace; the client gets no details.
        return JSONResponse(to_error_body(exc).model_dump(), status_code=HTTPStatus.INTERNAL_SERVER_ERROR.value)

    for exc_class in (OpenAIServingError, InvalidRequestError, QueueFullError, EngineDeadError, RequestFailedError):
        app.add_exception_handler(exc_class, on_serving_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(HTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
