"""Reasoning output through the openai SDK: a server with --reasoning-parser qwen3 over a tiny random Qwen3 whose
tokenizer has Qwen3's `<think>` / `</think>` added tokens, and a Qwen3-format chat template (written here) that
opens `<think>\\n` in the prompt unless told otherwise by chat_template_kwargs. Expected texts come from
transformers' greedy steps on the same weights (forcing `</think>` where the budget runs out), split with
str.partition; tool calls inside reasoning are checked on the serving layer's text split."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from pagellm.entrypoints.openai.protocol_chat import ChatCompletionRequest
from pagellm.entrypoints.openai.serving_chat import ChoiceStreamer, chat_message
from pagellm.reasoning import get_reasoning_parser

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
# Qwen3's prompt format; the generation prompt opens reasoning (as Qwen3-Thinking and DeepSeek-R1 templates do),
# leaves it to the model (thinking_in_prompt false: Qwen3's own template) or closes it empty (enable_thinking false).
TEMPLATE = (
    r"{%- if tools %}{{- '<|im_start|>system\n# Tools\n<tools>' }}{%- for tool in tools %}{{- '\n' }}"
    r"{{- tool | tojson }}{%- endfor %}{{- '\n</tools><|im_end|>\n' }}{%- endif %}"
    r"{%- if reasoning_effort is defined %}{{- '<|im_start|>system\nReasoning: ' + reasoning_effort + "
    r"'<|im_end|>\n' }}{%- endif %}"
    r"{%- for message in messages %}{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}"
    r"{%- endfor %}"
    r"{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
    r"{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}"
    r"{%- elif thinking_in_prompt is not defined or thinking_in_prompt %}{{- '<think>\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def hf(qwen3_thinking_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(qwen3_thinking_dir), dtype=torch.float32).eval()
    return AutoTokenizer.from_pretrained(str(qwen3_thinking_dir)), model


@pytest.fixture(scope="module")
def reasoning_client(qwen3_thinking_dir, start_server, tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "qwen3.jinja"
    template.write_text(TEMPLATE)
    for server in start_server(qwen3_thinking_dir, "--chat-template", str(template), "--reasoning-parser", "qwen3",
                               "--max-num-seqs", "8"):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def chat(client, stream=False, **body):
    body.setdefault("max_completion_tokens", 8)
    known = {name: body.pop(name) for name in ("max_completion_tokens", "n", "logprobs", "response_format",
                                                "tools", "tool_choice", "reasoning_effort") if name in body}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, stream=stream,
                                          extra_body={"ignore_eos": True, **body}, **known)


def prompt_ids(hf, **template_kwargs) -> list[int]:
    tokenizer, _ = hf
    return tokenizer.apply_chat_template(MESSAGES, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=True,
                                         return_dict=False, **template_kwargs)


def greedy(hf, ids: list[int], forced: dict[int, int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens after `ids`, with `forced` {output position: token} put in their place."""
    _, model = hf
    ids, output = list(ids), []
    with torch.no_grad():
        for position in range(num_tokens):
            token = forced.get(position)
            if token is None:
                token = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(token)
            output.append(token)
    return output


def split(hf, token_ids: list[int]) -> tuple[str | None, str | None]:
    reasoning, _, content = hf[0].decode(token_ids).partition("</think>")
    return reasoning or None, content or None


def streamed(chunks) -> dict[int, tuple[str | None, str | None]]:
    parts: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            reasoning, content = parts.setdefault(choice.index, ["", ""])
            parts[choice.index] = [reasoning + (choice.delta.model_extra.get("reasoning_content") or ""),
                                   content + (choice.delta.content or "")]
    return {index: (r or None, c or None) for index, (r, c) in parts.items()}


def test_budget_closes_reasoning_opened_by_the_prompt(reasoning_client, hf):
    ids = prompt_ids(hf)
    assert hf[0].decode(ids).endswith("<think>\n")
    end = hf[0].convert_tokens_to_ids("</think>")
    expected_tokens = greedy(hf, ids, {3: end}, 8)
    expected = split(hf, expected_tokens)
    assert expected[0] == hf[0].decode(expected_tokens[:3])  # the end tag came from the budget, not the model
    response = chat(reasoning_client, thinking_token_budget=3, logprobs=True)
    message = response.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == expected
    assert [t.token for t in response.choices[0].logprobs.content][3] == "</think>"
    assert response.usage.prompt_tokens == len(ids) and response.usage.completion_tokens == 8
    assert response.choices[0].finish_reason == "length"
    # Streamed, with n=2: each choice's deltas add up to the same split.
    assert streamed(chat(reasoning_client, stream=True, n=2, thinking_token_budget=3)) == {0: expected, 1: expected}


def test_reasoning_never_closed_is_all_reasoning(reasoning_client, hf):
    expected_tokens = greedy(hf, prompt_ids(hf), {}, 6)
    text = hf[0].decode(expected_tokens)
    assert "</think>" not in text
    response = chat(reasoning_client, max_completion_tokens=6)
    message = response.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == (text, None)
    assert response.choices[0].finish_reason == "length"
    assert streamed(chat(reasoning_client, stream=True, max_completion_tokens=6)) == {0: (text, None)}
    # include_reasoning false leaves the reasoning out.
    hidden = chat(reasoning_client, max_completion_tokens=6, include_reasoning=False).choices[0].message
    assert (hidden.model_extra["reasoning_content"], hidden.content) == (None, None)


def test_thinking_off_is_all_content(reasoning_client, hf):
    ids = prompt_ids(hf, enable_thinking=False)
    assert hf[0].decode(ids).endswith("<think>\n\n</think>\n\n")
    text = hf[0].decode(greedy(hf, ids, {}, 6))
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "max_completion_tokens": 6}
    response = chat(reasoning_client, **kwargs)
    message = response.choices[0].message
    assert response.usage.prompt_tokens == len(ids)  # the kwarg reached the template
    assert (message.model_extra["reasoning_content"], message.content) == (None, text)
    assert streamed(chat(reasoning_client, stream=True, **kwargs)) == {0: (None, text)}


def test_budget_counts_from_a_start_tag_the_model_writes(reasoning_client, hf):
    ids = prompt_ids(hf, thinking_in_prompt=False)
    think = hf[0].convert_tokens_to_ids("<think>")
    assert not hf[0].decode(ids).endswith("<think>\n")
    # A large bias makes the model write <think> every step: it opens reasoning, then two tokens of it, then the
    # budget forces </think>.
    response = chat(reasoning_client, chat_template_kwargs={"thinking_in_prompt": False}, logit_bias={think: 100},
                    thinking_token_budget=2, max_completion_tokens=4, logprobs=True)
    assert [t.token for t in response.choices[0].logprobs.content] == ["<think>"] * 3 + ["</think>"]
    message = response.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == ("<think><think>", None)
    assert response.usage.prompt_tokens == len(ids)


def test_reasoning_effort_reaches_a_template_that_reads_it(reasoning_client, hf, client):
    response = chat(reasoning_client, reasoning_effort="low", max_completion_tokens=1)
    assert response.usage.prompt_tokens == len(prompt_ids(hf, reasoning_effort="low")) > len(prompt_ids(hf))
    # SmolLM2's template (the shared server's) never reads it: a 400 naming why.
    with pytest.raises(openai.BadRequestError, match="chat template never reads") as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, reasoning_effort="low", max_tokens=1)
    assert error.value.body["param"] == "reasoning_effort"
    # Nor can it budget thinking without a reasoning parser.
    with pytest.raises(openai.BadRequestError, match="--reasoning-parser") as error:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1,
                                       extra_body={"thinking_token_budget": 4})
    assert error.value.body["param"] == "thinking_token_budget"


def test_bad_reasoning_requests_are_400s(reasoning_client):
    for body, param in [({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
                        ({"reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}},
                         "reasoning_effort")]:
        with pytest.raises(openai.BadRequestError) as error:
            chat(reasoning_client, **body)
        assert param in error.value.body["message"], body


# ---- constraints on the content after the reasoning (the engine starts the grammar after </think>) -------------
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["city", "n"], "additionalProperties": False}


def test_a_json_schema_holds_the_content_after_free_reasoning(reasoning_client, hf):
    """The budget closes reasoning after 3 tokens, which are transformers' unconstrained greedy tokens; the content
    after </think> validates against the schema (jsonschema), whole and streamed alike."""
    reasoning = hf[0].decode(greedy(hf, prompt_ids(hf), {}, 3))
    # vLLM's structured_outputs, compact: free whitespace would let the random model write it forever.
    constraint = {"json": SCHEMA, "disable_any_whitespace": True}
    body = dict(structured_outputs=constraint, thinking_token_budget=3, max_completion_tokens=64, ignore_eos=False)
    response = chat(reasoning_client, **body)
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    jsonschema.validate(json.loads(message.content), SCHEMA)
    assert response.choices[0].finish_reason == "stop"
    assert streamed(chat(reasoning_client, stream=True, **body)) == {0: (reasoning, message.content)}
    # Thinking off: the prompt closed reasoning, and the schema holds the output from its first token.
    closed = chat(reasoning_client, chat_template_kwargs={"enable_thinking": False}, **body).choices[0].message
    assert closed.model_extra["reasoning_content"] is None
    jsonschema.validate(json.loads(closed.content), SCHEMA)


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_tool_call_follows_free_reasoning(reasoning_client, hf, tool_choice):
    parameters = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                  "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    reasoning = hf[0].decode(greedy(hf, prompt_ids(hf, tools=tools), {}, 2))
    body = dict(tools=tools, tool_choice=tool_choice, thinking_token_budget=2, max_completion_tokens=64,
                ignore_eos=False)
    response = chat(reasoning_client, **body)
    message = response.choices[0].message
    assert message.model_extra["reasoning_content"] == reasoning
    assert [call.function.name for call in message.tool_calls] == ["get_weather"]
    assert set(json.loads(message.tool_calls[0].function.arguments)) == {"city"}
    assert response.choices[0].finish_reason == "tool_calls"
    chunks = list(chat(reasoning_client, stream=True, **body))
    assert streamed(chunks)[0][0] == reasoning
    calls = [call for chunk in chunks for choice in chunk.choices for call in choice.delta.tool_calls or []]
    assert calls[0].function.name == "get_weather"
    # Every reasoning delta comes before the call's first delta (Anthropic's stream makes them separate blocks).
    kinds = ["call" if choice.delta.tool_calls else "reasoning" for chunk in chunks for choice in chunk.choices
             if choice.delta.tool_calls or choice.delta.model_extra.get("reasoning_content")]
    assert kinds == sorted(kinds, key=lambda kind: kind == "call") and kinds[-1] == "call", kinds
    assert "".join(call.function.arguments or "" for call in calls) == message.tool_calls[0].function.arguments


def test_thinking_off_in_a_template_that_leaves_reasoning_open_refuses_a_constraint():
    """Qwen3's switch turned off, but the prompt does not close reasoning: the grammar would wait for a </think>
    the model has no reason to write, so the constraint is refused naming chat_template_kwargs."""
    from types import SimpleNamespace

    from pagellm.entrypoints.openai.errors import OpenAIServingError
    from pagellm.entrypoints.openai.serving_chat import OpenAIServingChat
    from pagellm.sampling_params import SamplingParams, StructuredOutputsParams

    serving = SimpleNamespace(reasoning_parser=get_reasoning_parser("qwen3"))
    request = ChatCompletionRequest(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    off = {"enable_thinking": False}
    with pytest.raises(OpenAIServingError, match="does not close reasoning") as error:
        OpenAIServingChat._reasoning(serving, request, "none", params, "<|im_start|>assistant\n", off)
    assert error.value.param == "chat_template_kwargs"
    # The same with a prompt that closes it, or with thinking on, is served.
    assert OpenAIServingChat._reasoning(serving, request, "none", params, "assistant\n<think>\n\n</think>\n\n", off)
    assert OpenAIServingChat._reasoning(serving, request, "none", params, "<|im_start|>assistant\n", {})


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CALL = '<tool_call>{{"name": "get_weather", "arguments": {{"city": "{}"}}}}</tool_call>'


def test_tool_calls_are_parsed_from_the_content_after_reasoning():
    request = ChatCompletionRequest(model=MODEL, messages=MESSAGES, tools=TOOLS)
    parser = get_reasoning_parser("qwen3")("<|im_start|>assistant\n<think>\n")
    text = f"Maybe {CALL.format('Oslo')}?</think>\n\n{CALL.format('Paris')}"
    message, _ = chat_message(request, "auto", parser, text)
    assert message.reasoning_content == f"Maybe {CALL.format('Oslo')}?"
    assert message.content == "\n\n"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})]
    for cut in range(len(text) + 1):  # streamed in two deltas, cut anywhere
        streamer = ChoiceStreamer("auto", request, parser)
        deltas = [streamer.feed(text[:cut], False), streamer.feed(text[cut:], True)]
        assert "".join(d.reasoning_content or "" for d in deltas) == message.reasoning_content
        assert "".join(d.content or "" for d in deltas) == message.content
        calls = [call for d in deltas for call in d.tool_calls]
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls]
        assert streamer.finish_reason("stop") == "tool_calls"
