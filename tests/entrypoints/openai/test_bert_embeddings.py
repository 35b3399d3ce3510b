"""An encoder served: `pagellm serve` on all-MiniLM-L6-v2 (a BertModel, so the pooling runner) answers
`POST /v1/embeddings` through the openai SDK with sentence-transformers' vectors, `/score` with their cosine
similarity, and a completion with a 400 that says why, and keeps serving with no KV block held."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

MIN_COSINE = 0.99999
SENTENCES = ["A man is eating food.", "A man is eating a piece of bread.", "The girl is carrying a baby.",
             "Paged attention keeps the KV cache in blocks."]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def minilm_server(minilm_dir, start_server):
    yield from start_server(minilm_dir)


@pytest.fixture(scope="module")
def minilm_client(minilm_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{minilm_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def sentence_transformer(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def test_embeddings_equal_sentence_transformers(minilm_server, minilm_client, sentence_transformer):
    response = minilm_client.embeddings.create(model=minilm_server.model_name, input=SENTENCES,
                                               encoding_format="float")
    expected = sentence_transformer.encode(SENTENCES)
    assert [item.index for item in response.data] == list(range(len(SENTENCES)))
    for item, reference in zip(response.data, expected):
        assert len(item.embedding) == 384
        assert cosine(item.embedding, reference) >= MIN_COSINE
    # [CLS] and [SEP] around each sentence, as sentence-transformers tokenizes it.
    token_counts = [len(ids) for ids in sentence_transformer.tokenizer(SENTENCES)["input_ids"]]
    assert response.usage.prompt_tokens == sum(token_counts)


def test_score_is_the_cosine_of_sentence_transformers_vectors(minilm_server, sentence_transformer):
    body = {"model": minilm_server.model_name, "text_1": SENTENCES[0], "text_2": SENTENCES[1:]}
    scores = [item["score"] for item in httpx.post(f"{minilm_server.url}/score", json=body, timeout=60).json()["data"]]
    query, *documents = sentence_transformer.encode(SENTENCES)
    np.testing.assert_allclose(scores, [cosine(query, d) for d in documents], rtol=0, atol=1e-5)


def test_generation_is_refused_and_the_server_keeps_serving(minilm_server, minilm_client):
    with pytest.raises(openai.BadRequestError, match="encoder-only model, which cannot generate"):
        minilm_client.completions.create(model=minilm_server.model_name, prompt="hello", max_tokens=2)
    response = minilm_client.embeddings.create(model=minilm_server.model_name, input="still serving")
    assert len(response.data[0].embedding) == 384
    assert minilm_server.wait_until_idle()[("pagellm:kv_cache_usage_perc", ())] == 0  # no block left held
