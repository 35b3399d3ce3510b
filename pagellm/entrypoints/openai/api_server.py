"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM, run in-process by uvicorn. SIGTERM or
Ctrl-C stops accepting connections, aborts the requests in flight (open streams end with an error event) and
exits 0."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from http import HTTPStatus
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pagellm import __version__, envs
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from pagellm.entrypoints.openai.auth import APIKeyMiddleware
from pagellm.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestBodyLimitMiddleware
from pagellm.entrypoints.openai.errors import error_response, register_error_handlers
from pagellm.entrypoints.openai.openapi import openapi_without_422, responses
from pagellm.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                 CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                 HealthResponse, ModelCard, ModelList, TokenizeChatRequest,
                                                 TokenizeCompletionRequest, TokenizeResponse)
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_engine import load_chat_template
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.entrypoints.utils import with_cancellation
from pagellm.entrypoints.web.routes import add_web_routes
from pagellm.logger import init_logger
from pagellm.metrics.history import SAMPLE_INTERVAL_S, StatsHistory
from pagellm.metrics.prometheus import PrometheusStatLogger

logger = init_logger(__name__)

LOG_STATS_INTERVAL_S = 5.0


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None  # a file path or the template itself
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


class _ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends, so a disconnected client's requests are aborted at
    once rather than whenever the generator is garbage-collected."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def _respond(result: BaseModel | AsyncIterator[str]) -> Response:
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return _ClosingStreamingResponse(result, media_type="text/event-stream")


async def _every(interval_s: float, callback: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        callback()


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The app owns the engine from here on: its shutdown stops the engine."""
    metrics = PrometheusStatLogger(config.served_model_names[0], engine.get_replica_scheduler_stats,
                                   engine.config.cache_config.metrics_info(engine.config.model_config.dtype))
    engine.add_stat_logger(metrics)
    history = StatsHistory(engine.get_scheduler_stats)  # the dashboard's time series
    engine.add_stat_logger(history)
    tokenizer = AsyncTokenizer(engine.config.model_config.tokenizer, load_chat_template(config.chat_template))
    serving_args = (engine, config.served_model_names, tokenizer)
    completion = OpenAIServingCompletion(*serving_args)
    chat = OpenAIServingChat(*serving_args)
    tokenization = OpenAIServingTokenization(*serving_args)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(_every(LOG_STATS_INTERVAL_S, engine.do_log_stats)),
                 asyncio.create_task(_every(SAMPLE_INTERVAL_S, history.sample))]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            engine.shutdown()
            tokenizer.shutdown()

    app = FastAPI(title="pagellm", version=__version__, lifespan=lifespan)
    app.openapi = openapi_without_422(app)
    register_error_handlers(app)
    # Added last = outermost: the key is checked before anything else, the body size before the body is read.
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    # The statuses each kind of route can answer besides 200 (and 500).
    generation = (HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND,
                  HTTPStatus.REQUEST_ENTITY_TOO_LARGE, HTTPStatus.SERVICE_UNAVAILABLE)
    with_body = (HTTPStatus.BAD_REQUEST, HTTPStatus.UNAUTHORIZED, HTTPStatus.NOT_FOUND,
                 HTTPStatus.REQUEST_ENTITY_TOO_LARGE)

    @app.get("/health", responses=responses(HTTPStatus.SERVICE_UNAVAILABLE, model=HealthResponse))
    async def health() -> Response:
        if not engine.is_running:
            return error_response("The engine is not running.", HTTPStatus.SERVICE_UNAVAILABLE)
        return JSONResponse(HealthResponse().model_dump())

    @app.get("/version", responses=responses())
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics", responses=responses(), response_class=PlainTextResponse)
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", responses=responses(HTTPStatus.UNAUTHORIZED, HTTPStatus.BAD_REQUEST))
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, root=engine.config.model_config.model,
                                         max_model_len=completion.max_model_len)
                               for name in config.served_model_names])

    @app.post("/v1/completions", response_model=None,
              responses=responses(*generation, model=CompletionResponse, streams=True))
    @with_cancellation
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return _respond(await completion.create_completion(request))

    @app.post("/v1/chat/completions", response_model=None,
              responses=responses(*generation, model=ChatCompletionResponse, streams=True))
    @with_cancellation
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
        return _respond(await chat.create_chat_completion(request))

    @app.post("/tokenize", response_model=None, responses=responses(*with_body, model=TokenizeResponse))
    async def tokenize(request: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        return _respond(await tokenization.tokenize(request))

    @app.post("/detokenize", response_model=None, responses=responses(*with_body, model=DetokenizeResponse))
    async def detokenize(request: DetokenizeRequest) -> Response:
        return _respond(await tokenization.detokenize(request))

    add_web_routes(app, engine, history, api_key_required=bool(config.api_key))
    return app


class _Server(uvicorn.Server):
    """uvicorn, except that a first SIGTERM / Ctrl-C also aborts the requests in flight (so open streams end and
    the connections close), and is not re-raised after shutdown, so that a clean stop exits with status 0."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            if sig == signal.SIGINT:  # a second Ctrl-C: stop waiting for connections
                self.force_exit = True
            return
        logger.info("Received %s: aborting the requests in flight and shutting down.", signal.Signals(sig).name)
        self.should_exit = True
        # Not from inside the signal handler: shutdown() joins the engine thread.
        self._loop.call_soon_threadsafe(self.engine.shutdown)


def run_server(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.model = args.model_tag or engine_args.model
    if args.served_model_names:
        engine_args.served_model_name = args.served_model_names[0]
    engine = AsyncLLM.from_engine_args(engine_args, args.max_waiting_requests, log_stats=not args.disable_log_stats)
    try:
        config = ServerConfig(served_model_names=args.served_model_names or [
                                  engine.config.model_config.served_model_name],
                              api_key=args.api_key or envs.api_key(), chat_template=args.chat_template,
                              max_request_body_bytes=args.max_request_body_bytes)
        app = build_app(engine, config)
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                        timeout_graceful_shutdown=10), engine)
        server.run()
    finally:
        engine.shutdown()
    return 0
