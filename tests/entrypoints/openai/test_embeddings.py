"""`POST /v1/embeddings` through the openai SDK: vectors equal transformers' final-norm hidden states (LAST pooling,
normalised), floats and base64 (little-endian float32) decode to the same values, Matryoshka `dimensions`, every
input shape with its usage, batch invariance, and bad input answered 400 with the server still serving and no
block held."""
from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def hf_base(model_dir):
    from transformers import AutoModel

    return AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference(hf_base, token_ids: list[int], dimensions: int | None = None) -> np.ndarray:
    with torch.inference_mode():
        vector = hf_base(torch.tensor([token_ids])).last_hidden_state[0, -1].double().numpy()
    vector = vector[:dimensions] if dimensions else vector
    return vector / np.linalg.norm(vector)


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, headers={"Authorization": f"Bearer {server.api_key}"},
                      timeout=60)


def test_float_embedding_equals_transformers(client, server, tokenizer, hf_base):
    text = "Paged attention keeps the KV cache in blocks."
    response = client.embeddings.create(model=server.model_name, input=text, encoding_format="float")
    assert response.object == "list" and response.model == server.model_name
    (item,) = response.data
    assert item.index == 0 and item.object == "embedding" and len(item.embedding) == 64
    token_ids = tokenizer.encode(text)
    assert cosine(item.embedding, reference(hf_base, token_ids)) >= MIN_COSINE
    assert response.usage.prompt_tokens == response.usage.total_tokens == len(token_ids)


def test_base64_decodes_to_the_float_values(client, server):
    text = ["first input", "a second, longer input to embed"]
    floats = client.embeddings.create(model=server.model_name, input=text, encoding_format="float")
    raw = post(server, {"model": server.model_name, "input": text, "encoding_format": "base64"}).json()
    for item, expected in zip(raw["data"], floats.data):
        decoded = np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
        np.testing.assert_array_equal(decoded, np.asarray(expected.embedding, dtype=np.float32))
    # The SDK asks for base64 by default and decodes it itself.
    default = client.embeddings.create(model=server.model_name, input=text)
    for item, expected in zip(default.data, floats.data):
        np.testing.assert_array_equal(np.asarray(item.embedding, dtype=np.float32),
                                      np.asarray(expected.embedding, dtype=np.float32))


def test_dimensions_truncate_then_renormalise(client, server, tokenizer, hf_base):
    text = "Matryoshka embeddings keep their leading values."
    response = client.embeddings.create(model=server.model_name, input=text, dimensions=16, encoding_format="float")
    vector = np.asarray(response.data[0].embedding)
    assert vector.shape == (16,)
    np.testing.assert_allclose(vector, reference(hf_base, tokenizer.encode(text), dimensions=16), atol=1e-5)


def test_every_input_shape_in_order(client, server, tokenizer, hf_base, make_token_prompts):
    ids = [p["prompt_token_ids"] for p in make_token_prompts([5, 40, 17], seed=21)]
    texts = ["one", "two words", "and three words here"]
    cases = [(ids[0], [ids[0]]), (ids, ids), (texts, [tokenizer.encode(t) for t in texts])]
    for inputs, token_lists in cases:
        response = client.embeddings.create(model=server.model_name, input=inputs, encoding_format="float")
        assert [item.index for item in response.data] == list(range(len(token_lists)))
        for item, token_ids in zip(response.data, token_lists):
            assert cosine(item.embedding, reference(hf_base, token_ids)) >= MIN_COSINE
        assert response.usage.prompt_tokens == sum(map(len, token_lists))


def test_alone_equals_inside_a_batch_of_64(client, server, make_token_prompts):
    ids = [p["prompt_token_ids"] for p in make_token_prompts([10 + i for i in range(64)], seed=22)]
    alone = client.embeddings.create(model=server.model_name, input=ids[30], encoding_format="float").data[0]
    batch = client.embeddings.create(model=server.model_name, input=ids, encoding_format="float").data
    np.testing.assert_allclose(batch[30].embedding, alone.embedding, atol=2e-6)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": []}, "input", "must not be empty"),
    ({"input": ""}, "input", "empty"),
    ({"input": [[1, 2], []]}, "input", "empty"),
    ({"input": "hello", "dimensions": 65}, "dimensions", "at most 64"),
    ({"input": [1, 49152]}, "input", "out of range"),
    ({"input": "hello", "encoding_format": "int8"}, None, "encoding_format"),
    ({"input": "x " * 400}, "input", "max_model_len"),
])
def test_bad_input_is_a_400(client, server, body, param, message):
    response = post(server, {"model": server.model_name, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
    assert client.embeddings.create(model=server.model_name, input="still serving").data
    assert server.wait_until_idle()[("pagellm:kv_cache_usage_perc", ())] == 0


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hello")
