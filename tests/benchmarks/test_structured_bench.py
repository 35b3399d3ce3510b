"""`pagellm bench structured --workload tools`: its scoring of responses (valid calls of the request's tools, an array
cut short keeping its complete calls) against cases valid or invalid by construction, its tools and prompts, and
the workload end to end on a tiny model (the report's counts agree with the failures it lists)."""
from __future__ import annotations

import importlib
import re

import jsonschema
import pytest

from pagellm.benchmarks.structured_tools import TOOL_PROMPTS, TOOLS, tool_calls_failure, tool_request
from pagellm.entrypoints.cli import build_parser
from pagellm.entrypoints.openai.tool_calls import extract_tool_calls

WEATHER_LYON = '{"name":"get_weather","parameters":{"city":"Lyon","unit":"celsius"}}'
TIME_PARIS = '{"name":"get_time","parameters":{"timezone":"Europe/Paris"}}'


def failure(text: str) -> str | None:
    request = tool_request("What is the weather in Lyon?", 0.0, 0, 64)
    return tool_calls_failure(extract_tool_calls("required", request, text), request)


@pytest.mark.parametrize("text", [
    f"[{WEATHER_LYON}]",
    f"[{WEATHER_LYON},{TIME_PARIS}]",
    f'[{WEATHER_LYON},{{"name":"get_time","parameters":{{"timez',  # cut by max_tokens: the first call stands
])
def test_valid_calls_pass(text):
    assert failure(text) is None


@pytest.mark.parametrize("text, reason", [
    ('[{"name":"get_weather","parameters":{"city":"Ly', "no complete call"),
    ('[{"name":"get_weather","parameters":{"city":"Lyon","unit":"kelvin"}}]', "do not validate"),
    ('[{"name":"get_weather","parameters":{"city":"Lyon"}}]', "do not validate"),
    ('[{"name":"get_time","parameters":{"timezone":"UTC"}},{"name":"get_weather","parameters":{"city":7,'
     '"unit":"celsius"}}]', "do not validate"),
    ('[{"name":"get_weather","parameters":{"city":"Lyon","unit":"celsius",}}]', "not JSON"),
    ('[{"name":"book_hotel","parameters":{}}]', "not a tool"),
])
def test_invalid_calls_fail(text, reason):
    assert reason in failure(text)


def test_tools_and_prompts():
    for tool in TOOLS:
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    names = [tool["function"]["name"] for tool in TOOLS]
    assert len(set(names)) == len(names) and {tool for _, tool in TOOL_PROMPTS} == set(names)
    assert len({question for question, _ in TOOL_PROMPTS}) == len(TOOL_PROMPTS)


def test_tools_workload_end_to_end(tiny_model_factory, capsys):
    argv = ["bench", "structured", "--workload", "tools", "--model", str(tiny_model_factory("llama")),
            "--kv-cache-memory", "16MiB", "--tool-temperatures", "0", "0.7", "--num-per-prompt", "2"]
    args = build_parser(argv).parse_args(argv)
    fractions = importlib.import_module(f"pagellm.benchmarks.{args.bench_command}").run(args)
    report = capsys.readouterr().out
    assert set(fractions) == {0.0, 0.7}
    for temperature, num_per_prompt in ((0.0, 1), (0.7, 2)):
        total = len(TOOL_PROMPTS) * num_per_prompt
        failures = re.findall(rf"^  tools-{temperature}-\d+-\d+: (.*)$", report, re.MULTILINE)
        assert fractions[temperature] == pytest.approx(1 - len(failures) / total)
        assert f"temperature {temperature}: {total - len(failures)}/{total} " in report
        # The grammar makes every call valid, and a response ends on its own only after a whole array: a failure
        # can only be a response cut by max_tokens before its first call closed.
        assert all(line.startswith("no complete call (length): '[") for line in failures)
