"""`pagellm bench structured --workload tools`: whether `tool_choice: "required"` yields valid calls within a token
budget.

Each request is a chat completion request over 4 tools (`get_weather(city, unit)`, `get_time`, `convert_currency`,
`search_flights`), made and read as the server makes and reads it: the prompt through the chat template with the
tools, the constraint of tool_calls.py, `max_tokens` (`--tool-max-tokens`), and the calls extracted from the
output, an array cut by `max_tokens` keeping the calls completed before the cut. A response counts as valid when
it holds at least one call and every call names a tool and its arguments parse with `json` and validate against
that tool's parameter schema with `jsonschema`. Reported per temperature (`--tool-temperatures`): one request per
prompt at temperature 0 (greedy: more would repeat it), `--num-per-prompt` seeds at the others.
"""
from __future__ import annotations

import argparse
import json
from collections import Counter
from typing import Any

from pagellm.engine.llm_engine import LLMEngine
from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagellm.entrypoints.openai.tool_calls import ExtractedToolCalls, extract_tool_calls, tool_call_constraint


def _tool(name: str, description: str, properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": list(properties)}}}


_CURRENCY = {"type": "string", "enum": ["USD", "EUR", "GBP", "JPY"]}
TOOLS = [
    _tool("get_weather", "Current weather in a city",
          {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}),
    _tool("get_time", "Current local time in a time zone",
          {"timezone": {"type": "string", "description": "IANA name, such as Europe/Paris"}}),
    _tool("convert_currency", "Convert an amount of money",
          {"amount": {"type": "number", "minimum": 0}, "from_currency": _CURRENCY, "to_currency": _CURRENCY}),
    _tool("search_flights", "Flights between two cities on a date",
          {"origin": {"type": "string"}, "destination": {"type": "string"},
           "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
]
# (question, the tool that answers it)
TOOL_PROMPTS = [
    *((f"What is the weather in {city}?", "get_weather") for city in ("Lyon", "Tokyo", "Lima")),
    ("Is it cold in Oslo today, in fahrenheit?", "get_weather"),
    ("Do I need an umbrella in London right now?", "get_weather"),
    ("How warm is it in Cairo in celsius?", "get_weather"),
    *((f"What time is it in {city}?", "get_time") for city in ("New York", "Sydney", "Berlin")),
    ("Tell me the current time in Tokyo.", "get_time"),
    ("Is it already evening in Paris?", "get_time"),
    ("What is the local time in UTC?", "get_time"),
    ("How much is 250 euros in US dollars?", "convert_currency"),
    ("Convert 1000 yen to pounds.", "convert_currency"),
    ("What are 12.5 dollars in euros?", "convert_currency"),
    ("I have 80 pounds; how many yen is that?", "convert_currency"),
    ("Change 5 USD into JPY.", "convert_currency"),
    ("What is 300 GBP in EUR?", "convert_currency"),
    ("Find me a flight from Paris to Rome on 2025-06-12.", "search_flights"),
    ("Are there flights from Boston to Denver on 2025-01-03?", "search_flights"),
    ("Search flights Madrid to Lisbon, 2025-09-30.", "search_flights"),
    ("I need to fly from Seoul to Bangkok on 2026-02-14.", "search_flights"),
    ("Book-able flights from Dublin to Oslo on 2025-11-05?", "search_flights"),
    ("Which flights go from Toronto to Chicago on 2025-07-21?", "search_flights"),
]


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tool-temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--tool-max-tokens", type=int, default=64)
    parser.add_argument("--num-per-prompt", type=int, default=4, help="seeds per prompt at a temperature above 0")


def tool_request(question: str, temperature: float, seed: int, max_tokens: int) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(dict(
        messages=[{"role": "user", "content": question}], tools=TOOLS, tool_choice="required",
        temperature=temperature, seed=seed, max_tokens=max_tokens))


def tool_calls_failure(extracted: ExtractedToolCalls, request: ChatCompletionRequest) -> str | None:
    """Why a response's calls are not valid calls of the request's tools; None when they are."""
    import jsonschema

    if not extracted.tool_calls:
        return "no complete call"
    schemas = {tool.function.name: tool.function.parameters for tool in request.tools}
    for call in extracted.tool_calls:
        if call.function.name not in schemas:
            return f"{call.function.name!r} is not a tool"
        try:
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        except ValueError as exc:
            return f"{call.function.name} arguments are not JSON: {exc}"
        except jsonschema.ValidationError as exc:
            return f"{call.function.name} arguments do not validate: {exc.message}"
    return None


def _prompt(engine: LLMEngine, request: ChatCompletionRequest) -> dict[str, Any]:
    """The prompt as the server renders it: the chat template with the tools, no special tokens added."""
    text = engine.tokenizer.apply_chat_template(
        [message.to_template_message() for message in request.messages], tokenize=False, add_generation_prompt=True,
        tools=[tool.model_dump(exclude_none=True) for tool in request.tools])
    return {"prompt": text, "prompt_token_ids": engine.tokenizer.encode(text, add_special_tokens=False)}


def measure_tool_calls(engine: LLMEngine, args: argparse.Namespace) -> dict[float, float]:
    """The fraction of valid responses per temperature (printed with the failures)."""
    requests: dict[str, tuple[ChatCompletionRequest, str]] = {}
    for temperature in args.tool_temperatures:
        for p, (question, expected_tool) in enumerate(TOOL_PROMPTS):
            for seed in range(1 if temperature == 0 else args.num_per_prompt):
                request = tool_request(question, temperature, seed, args.tool_max_tokens)
                request_id = f"tools-{temperature}-{p}-{seed}"
                requests[request_id] = request, expected_tool
                params = request.to_sampling_params(request.max_tokens, None,
                                                    tool_call_constraint(request, "required"))
                engine.add_request(request_id, _prompt(engine, request), params)
    results: dict[float, list[tuple[str | None, bool, str]]] = {t: [] for t in args.tool_temperatures}
    failures = {}
    while engine.has_unfinished_requests():
        for output in engine.step()[0]:
            request, expected_tool = requests[output.request_id]
            completion = output.outputs[0]
            extracted = extract_tool_calls("required", request, completion.text)
            failure = tool_calls_failure(extracted, request)
            expected = bool(extracted.tool_calls) and extracted.tool_calls[0].function.name == expected_tool
            results[request.temperature].append((failure, expected, completion.finish_reason))
            if failure is not None:
                failures[output.request_id] = f"{failure} ({completion.finish_reason}): {completion.text!r}"
    print(f'Tool calls: tool_choice "required" over {len(TOOLS)} tools, {len(TOOL_PROMPTS)} prompts, '
          f"max_tokens {args.tool_max_tokens}")
    fractions = {}
    for temperature, scored in results.items():
        valid = sum(failure is None for failure, _, _ in scored)
        fractions[temperature] = valid / len(scored)
        finish_reasons = Counter(reason for _, _, reason in scored)
        print(f"  temperature {temperature}: {valid}/{len(scored)} ({100 * fractions[temperature]:.1f}%) responses "
              f"hold calls that parse and validate; the expected tool first in "
              f"{sum(expected for _, expected, _ in scored)}; finish reasons {dict(finish_reasons)}")
    for request_id, why in failures.items():
        print(f"  {request_id}: {why:.300}")
    return fractions
