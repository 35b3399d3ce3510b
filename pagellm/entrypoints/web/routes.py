"""The built-in web pages and the dashboard's API, added to the server's FastAPI app.

- `GET /`: the web chat; `GET /dashboard`: the live KV-cache dashboard; `GET /static/*`: their scripts and styles
  (plain files shipped as package data: nothing is built at run time). These stay open without the API key, so the
  page can load and then ask for it.
- `GET /web/config`: what a page needs before it talks to the API: whether a key is required, and the sampling
  values the server uses for fields a request leaves out.
- `GET /v1/engine/state`, `GET /v1/engine/state/stream`: see engine_state.py (behind the key, as all of /v1/).

None of these are in the OpenAPI spec: the spec documents the OpenAI-compatible API.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Query
from fastapi.responses import FileResponse, StreamingResponse
from fastapi.staticfiles import StaticFiles

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.protocol import DEFAULT_TEMPERATURE, DEFAULT_TOP_P
from pagellm.entrypoints.web.engine_state import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, MIN_INTERVAL_S, EngineStateFeed
from pagellm.metrics.history import StatsHistory

STATIC_DIR = Path(__file__).parent / "static"
_ENGINE = Query(0, ge=0, description="which engine (data-parallel replica) to show")
# The pages build every element from script, with text set as text; this forbids the rest even if a bug let markup
# through: no inline scripts or event handlers, nothing loaded or sent anywhere but this server.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; "
                           "frame-ancestors 'none'")
_PAGE_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                 "Cache-Control": "no-cache"}


def add_web_routes(app: FastAPI, engine: AsyncLLM, history: StatsHistory, api_key_required: bool) -> None:
    feed = EngineStateFeed(engine, history)

    @app.get("/", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "chat.html", headers=_PAGE_HEADERS)

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "dashboard.html", headers=_PAGE_HEADERS)

    @app.get("/web/config", include_in_schema=False)
    async def web_config() -> dict:
        # None: the request leaves the field out (max_tokens: the rest of the context; seed: unseeded sampling).
        return {"api_key_required": api_key_required,
                "sampling_defaults": {"temperature": DEFAULT_TEMPERATURE, "top_p": DEFAULT_TOP_P,
                                      "max_tokens": None, "seed": None},
                "state_interval_s": {"default": DEFAULT_INTERVAL_S, "min": MIN_INTERVAL_S, "max": MAX_INTERVAL_S}}

    @app.get("/v1/engine/state", include_in_schema=False)
    async def engine_state(engine: int = _ENGINE) -> dict:
        return await feed.payload(engine_index=engine)

    @app.get("/v1/engine/state/stream", include_in_schema=False)
    async def engine_state_stream(
            interval: float = Query(DEFAULT_INTERVAL_S, ge=MIN_INTERVAL_S, le=MAX_INTERVAL_S,
                                    description="seconds between events"),
            engine: int = _ENGINE) -> StreamingResponse:
        # Checked before the response starts, so a bad index is a 400 rather than an error event.
        return StreamingResponse(feed.stream(interval, feed.engine.check_engine_index(engine)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
