"""The OpenAI-compatible HTTP server: the FastAPI app over one AsyncLLM (its shared state, middleware, error
handlers, the routers of `routes/` and the web pages, and a lifespan that stops the engine), run in-process by
uvicorn. SIGTERM or Ctrl-C stops accepting connections, aborts the requests in flight (open streams end with an
error event) and exits 0."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import FrameType

import uvicorn
from fastapi import FastAPI

from pagellm import __version__, envs
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.anthropic_errors import AnthropicErrorMiddleware
from pagellm.entrypoints.openai.auth import APIKeyMiddleware
from pagellm.entrypoints.openai.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, RequestBodyLimitMiddleware
from pagellm.entrypoints.openai.endpoint_label import EndpointLabelMiddleware
from pagellm.entrypoints.openai.errors import register_error_handlers
from pagellm.entrypoints.openai.openapi import openapi_without_422
from pagellm.entrypoints.openai.protocol_responses_api import DEFAULT_MAX_STORED_RESPONSES
from pagellm.entrypoints.openai.routes import ROUTERS
from pagellm.entrypoints.openai.routes.state import ServerState, server_state, set_server_state
from pagellm.entrypoints.web.routes import add_web_routes
from pagellm.logger import init_logger
from pagellm.metrics.history import SAMPLE_INTERVAL_S
from pagellm.process_utils import freeze_startup_heap

logger = init_logger(__name__)

LOG_STATS_INTERVAL_S = 5.0


@dataclass
class ServerConfig:
    served_model_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None  # a file path or the template itself
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES  # /v1/responses' LRU of `store: true` responses


async def _every(interval_s: float, callback: Callable[[], None]) -> None:
    while True:
        await asyncio.sleep(interval_s)
        callback()


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Logs stats and samples the dashboard's history while the app runs; at its end stops the engine (which
    aborts what is still in flight) and the tokenizer threads."""
    state = server_state(app)
    tasks = [asyncio.create_task(_every(LOG_STATS_INTERVAL_S, state.engine.do_log_stats)),
             asyncio.create_task(_every(SAMPLE_INTERVAL_S, state.history.sample))]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        state.engine.shutdown()
        state.tokenizer.shutdown()


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The app owns the engine from here on: its shutdown stops the engine."""
    state = ServerState.create(engine, config.served_model_names, config.chat_template, config.max_stored_responses)
    app = FastAPI(title="pagellm", version=__version__, lifespan=_lifespan)
    set_server_state(app, state)
    app.openapi = openapi_without_422(app)
    register_error_handlers(app)
    # Added last = outermost: the key is checked before anything else, the body size before the body is read.
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=config.max_request_body_bytes)
    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key)
    app.add_middleware(AnthropicErrorMiddleware)  # rewrites every error above on the Anthropic routes
    app.add_middleware(EndpointLabelMiddleware)  # request_success_total's endpoint label
    for router in ROUTERS:
        app.include_router(router)
    add_web_routes(app, engine, state.history, api_key_required=bool(config.api_key))
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
                              max_request_body_bytes=args.max_request_body_bytes,
                              max_stored_responses=args.max_stored_responses)
        app = build_app(engine, config)
        server = _Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                        timeout_graceful_shutdown=10), engine)
        freeze_startup_heap()
        server.run()
    finally:
        engine.shutdown()
    return 0
