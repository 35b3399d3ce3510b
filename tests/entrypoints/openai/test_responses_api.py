"""OpenAI's Responses API (`/v1/responses`) through the official `openai` SDK, against the shared live server (tiny
random-weight Llama, SmolLM2's chat template). Greedy responses equal the same conversation through
/v1/chat/completions (text, tool calls, finish and token counts), streamed or not; input token counts equal the
chat template's, rendered by transformers; stored responses continue, are retrieved and deleted; bad requests are
400s naming the field. Reasoning items (--reasoning-parser qwen3, over the tiny random Qwen3 with `<think>` tokens,
its `</think>` embedding set so that it closes its reasoning after three greedy tokens of its own) equal the chat
completion's reasoning_content, a text.format json_schema holds the message after them (jsonschema), and the
serving layer's mapping of a chat message with both reasoning and content, whole and streamed, is checked on its
own."""
from __future__ import annotations

import json
import shutil

import httpx
import jsonschema
import openai
import pytest
import torch

from pagellm.entrypoints.openai.errors import OpenAIServingError
from pagellm.entrypoints.openai.protocol_responses import ChatMessage
from pagellm.entrypoints.openai.protocol_responses_api_output import ResponseObject
from pagellm.entrypoints.openai.responses_stream import ResponseEvents
from pagellm.entrypoints.openai.serving_responses import ResponseStore, output_items

SYSTEM = "You answer in French."
USER = "What is the weather in Paris?"
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                       "days": {"type": "integer", "enum": [1, 2, 3]}},
                      "required": ["city", "days"]}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": WEATHER_PARAMETERS}
CHAT_WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": WEATHER_PARAMETERS}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "city": {"enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "city"], "additionalProperties": False}
CITY = {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}


def greedy(**fields) -> dict:
    return {"model": "tiny", "temperature": 0, **fields}


def template_tokens(tokenizer, messages: list[dict]) -> int:
    return len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=60) as client:
        yield client


@pytest.mark.parametrize("max_tokens", [4, 24])
def test_a_string_input_equals_the_chat_completion(client, tokenizer, max_tokens):
    response = client.responses.create(**greedy(input=USER, instructions=SYSTEM, max_output_tokens=max_tokens))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    chat = client.chat.completions.create(**greedy(messages=messages, max_completion_tokens=max_tokens))
    choice = chat.choices[0]
    assert response.object == "response" and response.id.startswith("resp_") and response.model == "tiny"
    assert [item.type for item in response.output] == ["message"] and response.output[0].role == "assistant"
    assert response.output_text == choice.message.content
    if choice.finish_reason == "length":
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert response.output[0].status == "incomplete"
    else:
        assert response.status == "completed" and response.incomplete_details is None and max_tokens == 24
    assert response.usage.input_tokens == template_tokens(tokenizer, messages) == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.instructions == SYSTEM and response.max_output_tokens == max_tokens and response.store is False


def test_the_cut_status_is_the_chat_finish_reason(client):
    response = client.responses.create(**greedy(input=USER, max_output_tokens=2))
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 2


def test_message_items_are_the_chat_messages(client):
    items = [{"role": "developer", "content": SYSTEM},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello."},
                                                             {"type": "input_text", "text": USER}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Bonjour."}]},
             {"role": "user", "content": "And tomorrow?"}]
    response = client.responses.create(**greedy(input=items, max_output_tokens=12))
    chat = client.chat.completions.create(**greedy(max_completion_tokens=12, messages=[
        {"role": "developer", "content": SYSTEM}, {"role": "user", "content": f"Hello.\n{USER}"},
        {"role": "assistant", "content": "Bonjour."}, {"role": "user", "content": "And tomorrow?"}]))
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_text_format_json_schema_makes_valid_json(client):
    # A string schema: the random model fills an object's free whitespace until max_output_tokens.
    response = client.responses.create(**greedy(input=USER, max_output_tokens=16, text={
        "format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}))
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.text.format.type == "json_schema" and response.text.format.name == "city"


@pytest.mark.parametrize("text, response_format", [
    ({"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
     {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}),
    ({"format": {"type": "json_object"}}, {"type": "json_object"}),
], ids=["json_schema", "json_object"])
def test_text_format_is_the_chat_response_format(client, text, response_format):
    response = client.responses.create(**greedy(input=USER, max_output_tokens=24, text=text))
    chat = client.chat.completions.create(**greedy(messages=[{"role": "user", "content": USER}],
                                                   max_completion_tokens=24, response_format=response_format))
    assert response.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("tool_choice, chat_choice", [
    ({"type": "function", "name": "get_weather"}, {"type": "function", "function": {"name": "get_weather"}}),
    ("required", "required"),
], ids=["named", "required"])
def test_function_tools_make_function_call_items(client, tool_choice, chat_choice):
    response = client.responses.create(**greedy(input=USER, tools=[WEATHER], tool_choice=tool_choice,
                                                max_output_tokens=64))
    chat = client.chat.completions.create(**greedy(messages=[{"role": "user", "content": USER}],
                                                   tools=[CHAT_WEATHER], tool_choice=chat_choice,
                                                   max_completion_tokens=64))
    (call,) = chat.choices[0].message.tool_calls
    (item,) = response.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id and item.id.startswith("fc_") and response.status == "completed"
    assert item.arguments == call.function.arguments
    arguments = json.loads(item.arguments)
    assert arguments["city"] in ("Paris", "Rome") and arguments["days"] in (1, 2, 3)


def test_a_function_call_output_continues_as_the_chat_tool_message(client):
    first = client.responses.create(**greedy(input=USER, tools=[WEATHER], max_output_tokens=64,
                                             tool_choice={"type": "function", "name": "get_weather"}))
    (call,) = first.output
    items = [{"role": "user", "content": USER}, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "15 degrees, sunny"}]
    response = client.responses.create(**greedy(input=items, tools=[WEATHER], tool_choice="none",
                                                max_output_tokens=12))
    chat = client.chat.completions.create(**greedy(max_completion_tokens=12, tools=[CHAT_WEATHER], tool_choice="none",
                                                   messages=[
        {"role": "user", "content": USER},
        {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function",
                                              "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "15 degrees, sunny"}]))
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_stored_responses_continue_and_are_retrieved_and_deleted(client):
    first = client.responses.create(**greedy(input=USER, instructions=SYSTEM, max_output_tokens=8, store=True))
    second = client.responses.create(**greedy(input="And tomorrow?", previous_response_id=first.id,
                                              max_output_tokens=8, store=True))
    # As OpenAI's: the earlier instructions do not carry over; its input and output items do.
    chat = client.chat.completions.create(**greedy(max_completion_tokens=8, messages=[
        {"role": "user", "content": USER}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"}]))
    assert second.output_text == chat.choices[0].message.content and second.previous_response_id == first.id
    third = client.responses.create(**greedy(input="Thanks.", previous_response_id=second.id, max_output_tokens=8))
    chat = client.chat.completions.create(**greedy(max_completion_tokens=8, messages=[
        {"role": "user", "content": USER}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"}, {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Thanks."}]))
    assert third.output_text == chat.choices[0].message.content
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError, match=first.id) as raised:
        client.responses.create(**greedy(input="Again.", previous_response_id=first.id))
    assert raised.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError, match=third.id):  # not stored: stateless by default
        client.responses.retrieve(third.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)


def stream_events(client, **fields) -> list:
    with client.responses.stream(**greedy(**fields)) as stream:
        return list(stream)


def assert_well_formed(events: list) -> None:
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert events[0].response.status == "in_progress" and events[0].response.output == []


@pytest.mark.parametrize("max_tokens", [3, 24])
def test_a_stream_adds_up_to_the_greedy_response(client, max_tokens):
    fields = {"input": USER, "instructions": SYSTEM, "max_output_tokens": max_tokens}
    response = client.responses.create(**greedy(**fields))
    events = stream_events(client, **fields)
    assert_well_formed(events)
    types = [event.type for event in events]
    deltas = types.count("response.output_text.delta")
    assert deltas >= 1 and types[2:] == [
        "response.output_item.added", "response.content_part.added", *["response.output_text.delta"] * deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed" if response.status == "completed" else "response.incomplete"]
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = next(event for event in events if event.type == "response.output_text.done")
    item = next(event.item for event in events if event.type == "response.output_item.done")
    final = events[-1].response
    assert text == done.text == item.content[0].text == final.output_text == response.output_text
    assert item.status == response.output[0].status and final.status == response.status
    assert final.usage.model_dump() == response.usage.model_dump()
    assert final.incomplete_details == response.incomplete_details


def test_a_streamed_function_call_equals_the_greedy_one(client):
    fields = {"input": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
              "max_output_tokens": 64}
    (call,) = client.responses.create(**greedy(**fields)).output
    events = stream_events(client, **fields)
    assert_well_formed(events)
    types = [event.type for event in events]
    assert types[2] == "response.output_item.added" and types[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    assert arguments == events[-3].arguments == events[-2].item.arguments == call.arguments
    assert events[-2].item.name == call.name and events[-1].response.output[0].arguments == call.arguments


def test_a_stored_stream_continues(client):
    events = stream_events(client, input=USER, max_output_tokens=6, store=True)
    first = events[-1].response
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(**greedy(input="And tomorrow?", previous_response_id=first.id,
                                              max_output_tokens=6))
    chat = client.chat.completions.create(**greedy(max_completion_tokens=6, messages=[
        {"role": "user", "content": USER}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And tomorrow?"}]))
    assert second.output_text == chat.choices[0].message.content


@pytest.mark.parametrize("body, field", [
    ({"input": USER, "temperature": 3}, "temperature"),
    ({"input": USER, "top_p": -1}, "top_p"),
    ({"input": []}, "input"),
    ({}, "input"),
    ({"input": [{"type": "input_image", "image_url": "http://x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    ({"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ({"input": USER, "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": USER, "max_output_tokens": 100_000}, "max_output_tokens"),
    ({"input": USER, "tools": [{"type": "web_search"}]}, "tools.0"),
    ({"input": USER, "tool_choice": "required"}, "tool_choice"),
    ({"input": USER, "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": USER, "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": USER, "background": True}, "background"),
    ({"input": USER, "truncation": "auto"}, "truncation"),
    ({"input": USER, "reasoning": {"effort": "high"}}, "reasoning"),  # SmolLM2's template reads no effort
    ({"input": USER, "model": "gpt-5"}, "model"),
])
def test_bad_requests_name_the_field(http, body, field):
    response = http.post("/v1/responses", json={"model": "tiny", **body})
    assert response.status_code == (404 if field == "model" else 400), response.text
    assert response.json()["error"]["param"] == field, response.text


def test_an_unknown_response_is_a_404_naming_it(http):
    for method in ("GET", "DELETE"):
        response = http.request(method, "/v1/responses/resp_missing")
        assert response.status_code == 404 and "resp_missing" in response.json()["error"]["message"]


def test_the_routes_need_the_api_key(server):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/x"), ("DELETE", "/v1/responses/x")):
        assert httpx.request(method, f"{server.url}{path}", json={"input": "hi"}).status_code == 401


def test_a_body_over_the_limit_is_a_413(guarded_server):
    response = httpx.post(f"{guarded_server.url}/v1/responses", json={"model": "tiny", "input": "a" * (65 << 10)},
                          headers={"Authorization": f"Bearer {guarded_server.api_key}"}, timeout=30)
    assert response.status_code == 413 and "--max-request-body-bytes" in response.json()["error"]["message"]


def test_responses_count_in_the_engine_metrics(client, server):
    key = ("pagellm:request_success_total", (("finished_reason", "length"),))
    before = server.wait_until_idle()[key]
    client.responses.create(**greedy(input=USER, max_output_tokens=2))
    assert server.wait_until_idle()[key] == before + 1


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(max_size=2)
    responses = [ResponseObject(id=f"resp_{i}", status="completed", model="tiny") for i in range(3)]
    store.put(responses[0], [])
    store.put(responses[1], [])
    store.get("resp_0")  # used: resp_1 is now the oldest
    store.put(responses[2], [])
    assert store.get("resp_0")[0] is responses[0] and store.get("resp_2")[0] is responses[2]
    with pytest.raises(OpenAIServingError, match="resp_1"):
        store.get("resp_1")
    assert ResponseStore(max_size=0).put(responses[0], []) is None  # nothing kept, nothing raised


# ---- reasoning items (the chat path's reasoning_content, as --reasoning-parser splits it) ---------------------
# A Qwen3-format template whose generation prompt opens the reasoning, as Qwen3-Thinking's does.
THINKING_TEMPLATE = (r"{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + "
                     r"'<|im_end|>\n' }}{%- endfor %}{%- if add_generation_prompt %}"
                     r"{{- '<|im_start|>assistant\n<think>\n' }}{%- endif %}")


REASONING_TOKENS = 3  # the greedy tokens the closing model reasons with before </think>


def greedy_after_user(thinking_dir, num_tokens: int) -> tuple[list[int], list[int]]:
    """transformers' prompt ids for USER under THINKING_TEMPLATE, and its greedy tokens after them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(thinking_dir))
    model = AutoModelForCausalLM.from_pretrained(str(thinking_dir), dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": USER}], chat_template=THINKING_TEMPLATE,
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    output: list[int] = []
    with torch.no_grad():
        for _ in range(num_tokens):
            output.append(int(model(torch.tensor([prompt + output])).logits[0, -1].argmax()))
    return prompt, output


@pytest.fixture(scope="module")
def closing_thinking_dir(qwen3_thinking_dir, tmp_path_factory):
    """The tiny Qwen3 whose greedy output after USER is REASONING_TOKENS tokens of its own, then </think> (a random
    model never writes it): the </think> row of its embedding (tied to the output head) is the final hidden state
    of the position that predicts the next token, made orthogonal to those of the positions before (where its logit
    is then 0, below their argmax) and scaled past every other logit there. No other weight changes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("qwen3-closing") / "model"
    shutil.copytree(qwen3_thinking_dir, path)
    prompt, reasoning = greedy_after_user(path, REASONING_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    end = AutoTokenizer.from_pretrained(str(path)).convert_tokens_to_ids("</think>")
    with torch.no_grad():
        hidden = model.model(torch.tensor([prompt + reasoning])).last_hidden_state[0, -REASONING_TOKENS - 1:]
        basis, _ = torch.linalg.qr(hidden[:-1].T)
        row = hidden[-1] - basis @ (basis.T @ hidden[-1])
        top = model.lm_head(hidden[-1]).abs().max()
        model.get_input_embeddings().weight[end] = row * (2 * top + 10) / (row @ hidden[-1])
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def reasoning_client(closing_thinking_dir, start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    for server in start_server(closing_thinking_dir, "--chat-template", str(template), "--reasoning-parser",
                               "qwen3", "--max-num-seqs", "4"):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def test_reasoning_is_a_reasoning_item_streamed_or_not(reasoning_client):
    response = reasoning_client.responses.create(**greedy(input=USER, max_output_tokens=8))
    chat = reasoning_client.chat.completions.create(**greedy(messages=[{"role": "user", "content": USER}],
                                                             max_completion_tokens=8))
    message = chat.choices[0].message
    assert message.model_extra["reasoning_content"] and message.content
    reasoning = [item for item in response.output if item.type == "reasoning"]
    assert [item.type for item in response.output[:1]] == ["reasoning"] and len(reasoning) == 1
    assert reasoning[0].content[0].text == message.model_extra["reasoning_content"]
    assert response.output_text == (message.content or "")
    assert 0 < response.usage.output_tokens_details.reasoning_tokens <= response.usage.output_tokens == 8
    events = stream_events(reasoning_client, input=USER, max_output_tokens=8)
    assert_well_formed(events)
    deltas = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    done = next(event for event in events if event.type == "response.reasoning_text.done")
    assert deltas == done.text == reasoning[0].content[0].text
    assert events[-1].response.output[0].content[0].text == reasoning[0].content[0].text


def chat_chunk(reasoning: str | None = None, content: str | None = None, finish: str | None = None) -> dict:
    return {"id": "c", "model": "tiny", "choices": [{"index": 0, "finish_reason": finish, "delta": {
        "reasoning_content": reasoning, "content": content}}]}


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_reasoning_becomes_a_reasoning_item_before_the_message(finish):
    items = output_items(ChatMessage(role="assistant", reasoning_content="2 and 2 make 4.", content="4"),
                         incomplete=finish == "length")
    assert [item.type for item in items] == ["reasoning", "message"]
    assert items[0].content[0].text == "2 and 2 make 4." and items[0].status == "completed"
    assert items[1].content[0].text == "4" and items[1].status == ("incomplete" if finish == "length" else "completed")
    events = ResponseEvents(ResponseObject(id="resp_x", status="in_progress", model="tiny"))
    sent = [*events.chunk(chat_chunk(reasoning="2 and 2")), *events.chunk(chat_chunk(reasoning=" make 4.")),
            *events.chunk(chat_chunk(content="4", finish=finish)), *events.close()]
    types = [event.split("\n", 1)[0].removeprefix("event: ") for event in sent]
    assert types == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                     "response.output_item.done"]
    assert [json.loads(event.split("data: ", 1)[1])["sequence_number"] for event in sent] == list(range(len(sent)))
    assert [item.model_dump(exclude={"id"}) for item in events.output] == \
        [item.model_dump(exclude={"id"}) for item in items]


def test_a_json_schema_holds_the_message_after_free_reasoning(reasoning_client, closing_thinking_dir):
    """text.format json_schema with a reasoning parser: the reasoning item is transformers' unconstrained greedy
    reasoning (nothing masked it, </think> included), and the message after it validates against the schema
    (jsonschema), whole and streamed alike."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(closing_thinking_dir))
    _, tokens = greedy_after_user(closing_thinking_dir, REASONING_TOKENS + 1)
    assert tokens[-1] == tokenizer.convert_tokens_to_ids("</think>")
    reasoning = tokenizer.decode(tokens[:-1])
    assert not reasoning.lstrip().startswith('"')  # the schema's grammar would have refused its first token
    # A string enum: an object's free whitespace would let the random model write it forever.
    text = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
    response = reasoning_client.responses.create(**greedy(input=USER, max_output_tokens=48, text=text))
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning
    jsonschema.validate(json.loads(response.output_text), CITY)
    assert response.status == "completed" and response.text.format.type == "json_schema"
    events = stream_events(reasoning_client, input=USER, max_output_tokens=48, text=text)
    assert_well_formed(events)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == response.output_text
    assert events[-1].type == "response.completed"
