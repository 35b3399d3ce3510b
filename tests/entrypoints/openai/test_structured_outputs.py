"""Structured outputs and tool calls through the official openai SDK against a live server running the real
SmolLM2 (realistic JSON) with a Hermes-style chat template that renders tools (SmolLM2's own ignores them).

Outputs are checked with jsonschema and re; streamed tool-call deltas are reassembled and compared with the
non-streamed call; bad constraints and vLLM's removed guided_* fields get a 400 with an OpenAI error body, and the
server keeps serving with no KV block held."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": <name>, "arguments": <arguments>}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}{% elif message.role == "tool" %}<tool_response>
{{ message.content }}
</tool_response>{% else %}{{ message.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

MODEL = "tiny"  # the served name
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0,
                                                                          "maximum": 120},
                   "city": {"enum": ["Paris", "Rome", "Oslo"]}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir, start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    yield from start_server(smollm2_dir, "--chat-template", str(template), "--max-model-len", "512",
                            "--kv-cache-memory", "64MiB")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs.setdefault("messages", ASK)
    kwargs.setdefault("temperature", 0)
    kwargs.setdefault("max_completion_tokens", 60)
    return client.chat.completions.create(model=MODEL, **kwargs)


def test_response_format_json_schema_and_json_object(client):
    response = chat(client, messages=[{"role": "user", "content": "Describe a person as JSON."}],
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)
    response = chat(client, messages=[{"role": "user", "content": 'Repeat exactly: {"ok": true}'}],
                    response_format={"type": "json_object"})
    assert response.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(response.choices[0].message.content), dict)


def test_structured_outputs_on_both_endpoints(client):
    response = chat(client, extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, n=2, temperature=1.0,
                    seed=1)
    assert {c.message.content for c in response.choices} <= {"yes", "no"}
    completion = client.completions.create(model=MODEL, prompt="My phone number is ", max_tokens=20,
                                           temperature=0.7, seed=2,
                                           extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", completion.choices[0].text)
    assert completion.choices[0].finish_reason == "stop"
    completion = client.completions.create(model=MODEL, prompt="Name a city:", max_tokens=20, temperature=0,
                                           extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                               "name": "c", "schema": {"enum": ["Paris", "Rome"]}}}})
    assert json.loads(completion.choices[0].text) in ("Paris", "Rome")


def _reassemble(chunks) -> tuple[dict[int, dict], str, str | None]:
    """Tool calls by index (id, name, arguments joined, the deltas themselves), the content, and the last finish
    reason."""
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": "", "deltas": []})
                entry["id"] = entry["id"] or call.id
                entry["name"] += (call.function.name or "") if call.function else ""
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
                entry["deltas"].append(call)
            finish = choice.finish_reason or finish
    return calls, content, finish


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_weather"}}, "required"])
def test_forced_tool_calls_streamed_and_not(client, tool_choice):
    # One call for "required" (parallel_tool_calls=False): a small model repeats calls until max_tokens otherwise.
    kwargs = dict(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False)
    response = chat(client, **kwargs)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    calls = choice.message.tool_calls
    assert calls and all(call.id and call.type == "function" for call in calls)
    by_name = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name])
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_weather"]
    streamed, content, finish = _reassemble(chat(client, stream=True, **kwargs))
    assert finish == "tool_calls" and not content
    # Byte for byte the non-streamed arguments, streamed as OpenAI does: an opening delta (id, type, name, empty
    # arguments), then argument fragments as they are generated.
    assert [(c["name"], c["arguments"]) for _, c in sorted(streamed.items())] == [
        (call.function.name, call.function.arguments) for call in calls]
    for entry in streamed.values():
        opening, *fragments = entry["deltas"]
        assert opening.id and opening.type == "function" and opening.function.name and opening.function.arguments == ""
        assert len(fragments) > 1 and all(d.function.arguments and not d.id and not d.function.name for d in fragments)


def test_auto_parses_hermes_calls_and_none_ignores_tools(client, server):
    # The output is forced into the Hermes format, so "auto" must parse it into a call.
    hermes = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
    kwargs = dict(tools=TOOLS, tool_choice="auto", extra_body={"structured_outputs": {"regex": hermes}})
    choice = chat(client, **kwargs).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")
    streamed, content, finish = _reassemble(chat(client, stream=True, **kwargs))
    assert finish == "tool_calls" and not content
    assert [(c["name"], c["arguments"]) for c in streamed.values()] == [(call.function.name, call.function.arguments)]
    # Plain text under "auto" is content.
    choice = chat(client, tools=TOOLS, tool_choice="auto", extra_body={"structured_outputs": {"choice": ["Sunny"]}}
                  ).choices[0]
    assert choice.message.content == "Sunny" and not choice.message.tool_calls and choice.finish_reason == "stop"
    # "none": the template gets no tools (so the prompt is the plain chat's), and the output is content.
    none = chat(client, tools=TOOLS, tool_choice="none", max_completion_tokens=5)
    plain = chat(client, max_completion_tokens=5)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert not none.choices[0].message.tool_calls


def test_tool_results_go_through_the_template(client, smollm2_dir):
    from transformers import AutoTokenizer

    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    response = chat(client, messages=messages, tools=TOOLS, max_completion_tokens=3)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    rendered = [dict(m) for m in messages]
    rendered[1] = {**rendered[1], "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]}
    prompt = tokenizer.apply_chat_template(rendered, chat_template=HERMES_TEMPLATE, tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    assert "<tool_response>\n21 degrees and sunny\n</tool_response>" in prompt
    assert response.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


@pytest.mark.parametrize("path, body, message", [
    ("chat/completions", {"guided_json": PERSON}, 'guided_json is not supported: it was removed.*structured_outputs'),
    ("completions", {"guided_regex": "a+"}, "guided_regex is not supported: .*structured_outputs"),
    ("completions", {"guided_choice": ["a"]}, "guided_choice is not supported"),
    ("chat/completions", {"guided_grammar": "start: \"a\""}, "guided_grammar is not supported"),
    ("chat/completions", {"structured_outputs": {"regex": "a(b"}}, "(?s)structured_outputs.regex cannot be "
                                                                   "compiled: .*unclosed group"),
    ("completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": 3, "maximum": 1}}}}, "structured_outputs.json cannot"),
    # Only the model's tokenizer knows these: still refused before queueing.
    ("completions", {"structured_outputs": {"grammar": 'start: <|nonexistent|> "x"'}},
     "(?s)structured_outputs.grammar cannot be compiled: .*unknown special token"),
    ("completions", {"structured_outputs": {"grammar": 'start: <[99999999]> "x"'}}, "(?s)Token range end too large"),
    ("chat/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one of"),
    ("chat/completions", {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
     "set only one of them"),
    ("chat/completions", {"tool_choice": "required"}, "tool_choice needs tools"),
    ("chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "not in tools"),
])
def test_bad_constraints_are_400_and_the_server_keeps_serving(server, client, path, body, message):
    base = {"model": MODEL, "max_tokens": 5}
    base.update({"messages": ASK} if path.startswith("chat") else {"prompt": "hi"})
    response = httpx.post(f"{server.url}/v1/{path}", json={**base, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError"
    assert re.search(message, error["message"]), error["message"]
    assert server.wait_until_idle()[("pagellm:kv_cache_usage_perc", ())] == 0
    assert chat(client, max_completion_tokens=2).choices[0].message.content is not None
