"""What the route handlers share: the engine, the served model names, the serving objects, the tokenizer threads
and the metrics. `build_app` creates one `ServerState` and keeps it on `app.state`; handlers take it as a
dependency (`state: ServerStateDep`), the lifespan reads it with `server_state(app)`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, FastAPI, Request

from pagellm.engine.async_llm import AsyncLLM
from pagellm.entrypoints.openai.async_tokenizer import AsyncTokenizer
from pagellm.entrypoints.openai.endpoint_label import ENGINE_ENDPOINTS
from pagellm.entrypoints.openai.protocol_responses_api import DEFAULT_MAX_STORED_RESPONSES
from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagellm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagellm.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from pagellm.entrypoints.openai.serving_engine import load_chat_template
from pagellm.entrypoints.openai.serving_responses import OpenAIServingResponses
from pagellm.entrypoints.openai.serving_score import OpenAIServingScore
from pagellm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagellm.metrics.history import StatsHistory
from pagellm.metrics.prometheus import PrometheusStatLogger


@dataclass(frozen=True)
class ServerState:
    engine: AsyncLLM
    served_model_names: list[str]
    tokenizer: AsyncTokenizer
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses  # the Responses API, on `chat`, with its stored responses
    tokenization: OpenAIServingTokenization
    embedding: OpenAIServingEmbedding
    score: OpenAIServingScore
    metrics: PrometheusStatLogger  # the /metrics registry
    history: StatsHistory  # the dashboard's time series

    @classmethod
    def create(cls, engine: AsyncLLM, served_model_names: list[str], chat_template: str | None,
               max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES) -> ServerState:
        """Build the serving objects over `engine` and register the metrics' stat loggers with it.
        `chat_template`: a file path or the template itself (None: the tokenizer's own); `max_stored_responses`:
        how many stored Responses API responses are kept."""
        metrics = PrometheusStatLogger(served_model_names[0], engine.get_replica_scheduler_stats,
                                       engine.config.cache_config.metrics_info(engine.config.model_config.dtype),
                                       ENGINE_ENDPOINTS)
        engine.add_stat_logger(metrics)
        history = StatsHistory(engine.get_scheduler_stats)
        engine.add_stat_logger(history)
        tokenizer = AsyncTokenizer(engine.config.model_config.tokenizer, load_chat_template(chat_template))
        serving_args = (engine, served_model_names, tokenizer)
        chat = OpenAIServingChat(*serving_args)
        return cls(engine=engine, served_model_names=served_model_names, tokenizer=tokenizer,
                   completion=OpenAIServingCompletion(*serving_args), chat=chat,
                   responses=OpenAIServingResponses(chat, max_stored_responses),
                   tokenization=OpenAIServingTokenization(*serving_args),
                   embedding=OpenAIServingEmbedding(*serving_args), score=OpenAIServingScore(*serving_args),
                   metrics=metrics, history=history)


def set_server_state(app: FastAPI, state: ServerState) -> None:
    app.state.server = state


def server_state(app: FastAPI) -> ServerState:
    return app.state.server


async def _request_server_state(request: Request) -> ServerState:
    # async, so that FastAPI calls it on the event loop rather than in its thread pool.
    return server_state(request.app)


ServerStateDep = Annotated[ServerState, Depends(_request_server_state)]
