"""The OpenAI API's routers (`entrypoints/openai/routes/`): every router module is included, every route is in the
served OpenAPI spec with exactly the responses it documents (200, its error statuses with OpenAI's error body or,
on /v1/messages, Anthropic's, never FastAPI's 422), nothing else is, and handlers are plain module functions (their
state comes from the app)."""
from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.async_llm import AsyncLLM
from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai import routes
from pagellm.entrypoints.openai.api_server import ServerConfig, build_app
from pagellm.entrypoints.openai.routes import ROUTERS

ERROR_BODY = {"$ref": "#/components/schemas/ErrorResponse"}
ANTHROPIC_ERROR_BODY = {"$ref": "#/components/schemas/AnthropicErrorResponse"}  # on /v1/messages...


def router_routes() -> list[APIRoute]:
    """The routes the spec documents (an alias left out of it, such as /v1/score, is documented under its name)."""
    return [route for router in ROUTERS for route in router.routes
            if isinstance(route, APIRoute) and route.include_in_schema]


@pytest.fixture(scope="module")
def spec(model_dir) -> dict:
    engine = LLMEngine.from_engine_args(EngineArgs(model=model_dir, max_model_len=128, kv_cache_memory_bytes=1 << 20))
    app = build_app(AsyncLLM.from_engine(engine, log_stats=False), ServerConfig(served_model_names=["tiny"]))
    with TestClient(app) as client:
        served = client.get("/openapi.json").json()
    assert served == app.openapi()
    return served


def test_every_router_module_is_included():
    modules = [importlib.import_module(f"{routes.__name__}.{info.name}")
               for info in pkgutil.iter_modules(routes.__path__)]
    with_router = [module.router for module in modules if hasattr(module, "router")]
    assert len(with_router) == len(ROUTERS) and set(map(id, with_router)) == set(map(id, ROUTERS))


def test_handlers_are_module_functions():
    for route in router_routes():
        handler = inspect.unwrap(route.endpoint)
        assert handler.__closure__ is None and "<locals>" not in handler.__qualname__, route.path


def test_the_spec_lists_every_route_with_its_documented_responses(spec):
    documented = {(route.path, method.lower()) for route in router_routes() for method in route.methods}
    assert {(path, method) for path, operations in spec["paths"].items() for method in operations} == documented
    for route in router_routes():
        for method in route.methods:
            responses = spec["paths"][route.path][method.lower()]["responses"]
            assert set(responses) == {"200", *map(str, route.responses)}, route.path
            for status, response in responses.items():
                if status != "200":
                    # (/metrics lists its errors under text/plain, its response class's media type.)
                    schemas = [body["schema"] for body in response["content"].values()]
                    expected = ANTHROPIC_ERROR_BODY if route.path.startswith("/v1/messages") else ERROR_BODY
                    assert schemas == [expected], (route.path, status)
