"""Large and awkward grammars through the live server, sent together: every answer is a 200 whose output satisfies
its constraint (checked with json + jsonschema, re, list membership) or a 400 naming the problem, never a 5xx; a
stream that meets a limit mid-generation ends with a 400 error event. Afterwards the server still serves and holds
no KV block."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema

ENUM = [f"value {i}" for i in range(3_000)]
CHOICES = [f"option {i:04d}" for i in range(4_000)]
CASES = [
    # (structured_outputs, check of a finished text, expected statuses)
    ({"regex": "a{1000000}"}, None, {400}),  # refused before queueing: a lexer limit on its first token
    ({"regex": "[0-9]{30}z{1000000}"}, None, {400}),  # the same limit, met after 30 tokens
    ({"choice": CHOICES}, lambda text: text in CHOICES, {200}),  # one lexeme, not 4,000 parser alternatives
    ({"choice": ["\x04\U00040000", "\x16\U00050001"]}, None, {400}),  # bytes no SmolLM2 token spells
    ({"json": {"type": "object", "properties": {"v": {"enum": ENUM}}, "required": ["v"]},
      "disable_any_whitespace": True},
     lambda text: jsonschema.validate(json.loads(text), {"properties": {"v": {"enum": ENUM}}, "required": ["v"],
                                                         "additionalProperties": False}) is None, {200}),
    ({"regex": "[a-c]{2,4}-[0-9]{1,3}"}, lambda text: re.fullmatch("[a-c]{2,4}-[0-9]{1,3}", text), {200}),
    ({"grammar": 'start: "x"* "y" /[0-9]{2}/'}, lambda text: re.fullmatch("x*y[0-9]{2}", text), {200}),
]


def _complete(client, structured: dict, stream: bool = False) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Answer:", "max_tokens": 40, "temperature": 1.0, "seed": 3,
            "structured_outputs": structured, "stream": stream}
    return httpx.post(f"{client.base_url}completions", json=body,
                      headers={"Authorization": f"Bearer {client.api_key}"}, timeout=120)


def test_large_grammars_get_a_valid_200_or_a_400_never_a_5xx(server, client):
    with ThreadPoolExecutor(len(CASES)) as pool:
        responses = list(pool.map(lambda case: _complete(client, case[0]), CASES * 2))
    for (structured, check, statuses), response in zip(CASES * 2, responses):
        assert response.status_code in statuses, (str(structured)[:80], response.status_code, response.text[:300])
        if response.status_code == 400:
            message = response.json()["error"]["message"]
            assert re.search("grammar limit|cannot be continued", message), message
            continue
        choice = response.json()["choices"][0]
        if choice["finish_reason"] == "stop":
            assert check(choice["text"]), choice["text"]
    assert _complete(client, CASES[-2][0]).status_code == 200  # still serving
    assert server.wait_until_idle()[("pagellm:kv_cache_usage_perc", ())] == 0


def test_a_stream_that_meets_a_limit_ends_with_a_400_event(server, client):
    response = _complete(client, {"regex": "[0-9]{30}z{1000000}"}, stream=True)
    assert response.status_code == 200, response.text  # the probe passed: the limit is met only after 30 tokens
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[-1]["error"]["code"] == 400 and "grammar limit" in events[-1]["error"]["message"]
    text = "".join(event["choices"][0]["text"] for event in events[:-1] if event.get("choices"))
    assert re.fullmatch("[0-9]*", text)  # what was streamed before the limit is all in the grammar
    assert server.wait_until_idle()[("pagellm:kv_cache_usage_perc", ())] == 0
