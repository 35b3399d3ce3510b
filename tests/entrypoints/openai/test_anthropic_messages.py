"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official `anthropic` SDK,
against the shared live server (tiny random-weight Llama, SmolLM2's chat template). Greedy messages equal the same
conversation through /v1/chat/completions with the official `openai` SDK (text, tool calls, stop and token
counts), streamed or not; token counts equal the chat template's, rendered by transformers on the equivalent
OpenAI messages; errors have Anthropic's shape and name the field; the key works as `x-api-key` too. With
--reasoning-parser qwen3 (a tiny random Qwen3 whose template opens `<think>`), the chat completion's
reasoning_content is a thinking block, streamed as thinking_delta events."""
from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

SYSTEM = "You answer in French."
USER = "What is the weather in Paris?"
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                             "days": {"type": "integer", "enum": [1, 2, 3]}},
                            "required": ["city", "days"]}}
OPENAI_WEATHER = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}
STREAM_EVENTS = {"message_start", "content_block_start", "content_block_delta", "content_block_stop",
                 "message_delta", "message_stop"}  # what the SDK passes on of Anthropic's events


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=60)


def greedy(**fields) -> dict:
    return {"model": "tiny", "temperature": 0, **fields}


def sdk(body: dict) -> dict:
    """The anthropic SDK's arguments for a request body: this SDK has no sampling arguments (Anthropic's newer
    models take none), so `temperature` goes as an extra field, as older clients sent it."""
    fields = dict(body)
    temperature = fields.pop("temperature")
    return {**fields, "extra_body": {"temperature": temperature}}


def input_tokens(usage) -> int:
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def template_tokens(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> int:
    return len(tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))


@pytest.mark.parametrize("max_tokens", [4, 24])
def test_a_text_message_equals_the_chat_completion(claude, client, tokenizer, max_tokens):
    message = claude.messages.create(**sdk(greedy(max_tokens=max_tokens, system=SYSTEM,
                                              messages=[{"role": "user", "content": USER}])))
    chat = client.chat.completions.create(**greedy(max_tokens=max_tokens, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]))
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    text = "".join(block.text for block in message.content if block.type == "text")
    assert [block.type for block in message.content] == ["text"] and text == chat.choices[0].message.content
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    assert message.stop_reason == "max_tokens" or max_tokens == 24
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert input_tokens(message.usage) == template_tokens(tokenizer, [{"role": "system", "content": SYSTEM},
                                                                      {"role": "user", "content": USER}])


def test_system_blocks_and_text_blocks_are_joined_as_chat_text_parts(claude, client):
    message = claude.messages.create(**sdk(greedy(max_tokens=8, system=[{"type": "text", "text": SYSTEM}], messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello."}, {"type": "text", "text": USER}]}])))
    chat = client.chat.completions.create(**greedy(max_tokens=8, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Hello.\n{USER}"}]))
    assert message.content[0].text == chat.choices[0].message.content


def test_a_stop_sequence_ends_the_message_before_it(claude):
    full = claude.messages.create(**sdk(greedy(max_tokens=24, messages=[{"role": "user", "content": USER}])))
    text = full.content[0].text
    stop = next(text[i:i + 2] for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    message = claude.messages.create(**sdk(greedy(max_tokens=24, stop_sequences=[stop],
                                              messages=[{"role": "user", "content": USER}])))
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert "".join(block.text for block in message.content) == text[:text.index(stop)]


def tool_turn(claude, client, tool_choice: dict, openai_choice) -> tuple:
    message = claude.messages.create(**sdk(greedy(max_tokens=64, tools=[WEATHER], tool_choice=tool_choice,
                                              messages=[{"role": "user", "content": USER}])))
    chat = client.chat.completions.create(**greedy(max_tokens=64, tools=[OPENAI_WEATHER], tool_choice=openai_choice,
                                                   messages=[{"role": "user", "content": USER}]))
    return message, chat


@pytest.mark.parametrize("tool_choice, openai_choice", [
    ({"type": "tool", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ({"type": "any"}, "required"),
], ids=["tool", "any"])
def test_a_forced_tool_call_is_a_tool_use_block(claude, client, tool_choice, openai_choice):
    message, chat = tool_turn(claude, client, tool_choice, openai_choice)
    (call,) = chat.choices[0].message.tool_calls
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id
    assert block.input == json.loads(call.function.arguments)
    assert block.input["city"] in ("Paris", "Rome") and block.input["days"] in (1, 2, 3)
    assert message.stop_reason == "tool_use" and chat.choices[0].finish_reason == "tool_calls"


def test_a_tool_result_turn_continues_as_the_chat_tool_message(claude, client, tokenizer):
    first, _ = tool_turn(claude, client, {"type": "tool", "name": "get_weather"},
                         {"type": "function", "function": {"name": "get_weather"}})
    (call,) = first.content
    messages = [{"role": "user", "content": USER},
                {"role": "assistant", "content": [block.model_dump() for block in first.content]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                              "content": [{"type": "text", "text": "15 degrees, sunny"}]},
                                             {"type": "text", "text": "And tomorrow?"}]}]
    message = claude.messages.create(**sdk(greedy(max_tokens=12, tools=[WEATHER], messages=messages)))
    openai_messages = [
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "15 degrees, sunny"},
        {"role": "user", "content": "And tomorrow?"}]
    chat = client.chat.completions.create(**greedy(max_tokens=12, tools=[OPENAI_WEATHER], messages=openai_messages))
    assert message.content[0].text == chat.choices[0].message.content
    # The template (transformers, on the same messages with arguments as objects) counts the same prompt.
    template_messages = [dict(m) for m in openai_messages]
    template_messages[1]["tool_calls"] = [{"id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.input}}]
    expected = template_tokens(tokenizer, template_messages, [OPENAI_WEATHER])
    assert input_tokens(message.usage) == expected
    assert claude.messages.count_tokens(model="tiny", tools=[WEATHER], messages=messages).input_tokens == expected


def test_count_tokens_equals_the_chat_template(claude, tokenizer):
    counted = claude.messages.count_tokens(model="tiny", system=SYSTEM, messages=[{"role": "user", "content": USER}])
    assert counted.input_tokens == template_tokens(tokenizer, [{"role": "system", "content": SYSTEM},
                                                               {"role": "user", "content": USER}])


def test_earlier_thinking_blocks_are_dropped_as_anthropic_drops_them(claude):
    def count(assistant_blocks: list[dict]) -> int:
        return claude.messages.count_tokens(model="tiny", messages=[
            {"role": "user", "content": USER}, {"role": "assistant", "content": assistant_blocks},
            {"role": "user", "content": "Merci."}]).input_tokens

    answer = {"type": "text", "text": "Il fait beau."}
    thinking = {"type": "thinking", "thinking": "The user wants the weather. " * 8, "signature": "sig"}
    assert count([thinking, answer]) == count([answer]) < count([{"type": "text", "text": thinking["thinking"]},
                                                                 answer])


def raw_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for chunk in text.strip().split("\n\n"):
        name, data = chunk.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == name[len("event: "):]
        events.append((payload["type"], payload))
    return events


def test_a_stream_has_anthropics_event_sequence_and_the_greedy_text(claude, server):
    body = greedy(max_tokens=16, system=SYSTEM, messages=[{"role": "user", "content": USER}])
    whole = claude.messages.create(**sdk(body))
    with claude.messages.stream(**sdk(body)) as stream:
        types = [event.type for event in stream if event.type in STREAM_EVENTS]
        final = stream.get_final_message()
    assert types[:2] == ["message_start", "content_block_start"]  # (the SDK passes no ping on)
    assert set(types[2:-3]) == {"content_block_delta"} and len(types) > 5
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert (input_tokens(final.usage), final.usage.output_tokens) == (input_tokens(whole.usage),
                                                                      whole.usage.output_tokens)
    # On the wire: each event named by its type, text deltas in one block at index 0, the final counts.
    response = httpx.post(f"{server.url}/v1/messages", json={**body, "stream": True},
                          headers={"x-api-key": server.api_key}, timeout=60)
    events = raw_events(response.text)
    assert [name for name, _ in events[:3]] == ["message_start", "ping", "content_block_start"]
    deltas = [payload for name, payload in events if name == "content_block_delta"]
    assert {(d["index"], d["delta"]["type"]) for d in deltas} == {(0, "text_delta")}
    assert "".join(d["delta"]["text"] for d in deltas) == whole.content[0].text
    assert events[-2][1]["usage"]["output_tokens"] == whole.usage.output_tokens == 16


def test_a_streamed_tool_call_is_input_json_deltas(claude, server):
    body = greedy(max_tokens=64, tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": USER}])
    whole = claude.messages.create(**sdk(body))
    with claude.messages.stream(**sdk(body)) as stream:
        types = [event.type for event in stream if event.type in STREAM_EVENTS]
        final = stream.get_final_message()
    assert types.count("content_block_start") == 1 and final.stop_reason == "tool_use"
    (block,) = final.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", whole.content[0].input)
    events = raw_events(httpx.post(f"{server.url}/v1/messages", json={**body, "stream": True},
                                   headers={"x-api-key": server.api_key}, timeout=60).text)
    (start,) = [payload for name, payload in events if name == "content_block_start"]
    assert start["content_block"]["input"] == {} and start["content_block"]["name"] == "get_weather"
    partial = "".join(p["delta"]["partial_json"] for name, p in events if name == "content_block_delta")
    assert json.loads(partial) == whole.content[0].input


def test_the_key_is_accepted_as_x_api_key_and_required(server, claude):
    refused = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        refused.messages.create(**sdk(greedy(max_tokens=2, messages=[{"role": "user", "content": USER}])))
    response = httpx.post(f"{server.url}/v1/messages", timeout=30,
                          json=greedy(max_tokens=2, messages=[{"role": "user", "content": USER}]))
    assert response.status_code == 401
    assert response.json()["type"] == "error" and response.json()["error"]["type"] == "authentication_error"
    # Server-wide: the OpenAI routes take it too.
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": server.api_key}, timeout=30).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "wrong"}, timeout=30).status_code == 401
    both = {"x-api-key": server.api_key, "Authorization": "Bearer wrong"}  # every key sent must be right
    assert httpx.get(f"{server.url}/v1/models", headers=both, timeout=30).status_code == 401


def test_duplicate_x_api_key_headers_are_refused(server):
    headers = httpx.Headers([("x-api-key", server.api_key), ("x-api-key", "wrong")])
    response = httpx.post(f"{server.url}/v1/messages/count_tokens", headers=headers, timeout=30,
                          json={"model": "tiny", "messages": [{"role": "user", "content": USER}]})
    assert response.status_code == 400 and "exactly one x-api-key" in response.json()["error"]["message"]


def test_a_body_over_the_limit_is_anthropics_413(server):
    # Refused from its Content-Length, before the body is read (the server's default limit is 16 MiB).
    response = httpx.post(f"{server.url}/v1/messages", headers={"x-api-key": server.api_key}, timeout=30,
                          content=b" " * (17 << 20))
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large" and "--max-request-body-bytes" in response.text


@pytest.mark.parametrize("change, status, error_type, named", [
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"temperature": 1.5}, 400, "invalid_request_error", "temperature"),
    ({"messages": []}, 400, "invalid_request_error", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "messages.0.content"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER]}, 400, "invalid_request_error",
     "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "thinking"),
    ({"messages": [{"role": "user", "content": USER}, {"role": "assistant", "content": "Il fait"}]}, 400,
     "invalid_request_error", "messages"),
    ({"model": "claude-nope"}, 404, "not_found_error", "claude-nope"),
    ({"max_tokens": 10_000}, 400, "invalid_request_error", "max_tokens"),
])
def test_a_bad_request_gets_an_anthropic_error_naming_the_field(server, change, status, error_type, named):
    body = {key: value for key, value in {**greedy(max_tokens=4, messages=[{"role": "user", "content": USER}]),
                                          **change}.items() if value is not None}
    response = httpx.post(f"{server.url}/v1/messages", json=body, headers={"x-api-key": server.api_key}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    assert error["error"]["type"] == error_type and named in error["error"]["message"]


def test_the_sdk_raises_its_own_errors(claude):
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        claude.messages.create(**sdk(greedy(max_tokens=10_000, messages=[{"role": "user", "content": USER}])),
                               stream=True)
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="nope", messages=[{"role": "user", "content": USER}])


def test_messages_count_in_the_engine_metrics(claude, server):
    key = ("pagellm:request_success_total", (("finished_reason", "length"),))
    before = server.wait_until_idle()[key]
    claude.messages.create(**sdk(greedy(max_tokens=2, messages=[{"role": "user", "content": USER}])))
    assert server.wait_until_idle()[key] == before + 1


# A Qwen3-format template whose generation prompt opens the reasoning unless enable_thinking is false.
THINKING_TEMPLATE = (r"{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + "
                     r"'<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
                     r"{%- if enable_thinking is defined and enable_thinking is false %}"
                     r"{{- '<think>\n\n</think>\n\n' }}{%- else %}{{- '<think>\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def reasoning_server(qwen3_thinking_dir, start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    yield from start_server(qwen3_thinking_dir, "--chat-template", str(template), "--reasoning-parser", "qwen3",
                            "--max-num-seqs", "4")


def test_reasoning_is_a_thinking_block_streamed_or_not(reasoning_server):
    claude = anthropic.Anthropic(base_url=reasoning_server.url, api_key="none", max_retries=0, timeout=60)
    chat = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="none", max_retries=0, timeout=60)
    body = greedy(max_tokens=8, messages=[{"role": "user", "content": USER}],
                  thinking={"type": "enabled", "budget_tokens": 1024})
    message = claude.messages.create(**sdk(body))
    reference = chat.chat.completions.create(**greedy(max_tokens=8, messages=[{"role": "user", "content": USER}]))
    reasoning = reference.choices[0].message.model_extra["reasoning_content"]
    assert reasoning  # random weights rarely close </think> within 8 tokens
    assert message.content[0].type == "thinking" and message.content[0].thinking == reasoning
    assert "".join(b.text for b in message.content if b.type == "text") == (reference.choices[0].message.content
                                                                           or "")
    with claude.messages.stream(**sdk(body)) as stream:
        deltas = [event.delta.thinking for event in stream
                  if event.type == "content_block_delta" and event.delta.type == "thinking_delta"]
        final = stream.get_final_message()
    assert "".join(deltas) == reasoning and final.content[0].thinking == reasoning
    # "disabled": the template closes the reasoning itself (Qwen3's enable_thinking), so all is text.
    disabled = claude.messages.create(**sdk({**body, "thinking": {"type": "disabled"}}))
    assert [block.type for block in disabled.content] in (["text"], [])


def test_thinking_needs_a_reasoning_parser(claude):
    with pytest.raises(anthropic.BadRequestError, match="--reasoning-parser"):
        claude.messages.create(**sdk(greedy(max_tokens=4, messages=[{"role": "user", "content": USER}],
                                            thinking={"type": "enabled", "budget_tokens": 1024})))


def test_a_forced_tool_use_follows_the_thinking(reasoning_server):
    """tool_choice "tool" with thinking on: the budget closes the reasoning after 2 tokens, which are the chat path's
    unconstrained greedy reasoning, and the forced call's grammar holds only what follows (vLLM's way)."""
    claude = anthropic.Anthropic(base_url=reasoning_server.url, api_key="none", max_retries=0, timeout=60)
    chat = openai.OpenAI(base_url=f"{reasoning_server.url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": USER}]
    reasoning = chat.chat.completions.create(**greedy(max_tokens=2, messages=messages)).choices[0].message
    tool = {"name": "get_weather", "input_schema": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 6}}, "required": ["city"], "additionalProperties": False}}
    body = greedy(max_tokens=64, messages=messages, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
                  thinking={"type": "enabled", "budget_tokens": 2})
    message = claude.messages.create(**sdk(body))
    assert [block.type for block in message.content] == ["thinking", "tool_use"], message.content
    assert message.content[0].thinking == reasoning.model_extra["reasoning_content"]
    assert message.content[1].name == "get_weather" and set(message.content[1].input) == {"city"}
    assert message.stop_reason == "tool_use"
    with claude.messages.stream(**sdk(body)) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == message.content[1].input
