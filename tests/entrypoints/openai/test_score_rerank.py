"""`POST /score` and `/rerank` (and their /v1 aliases). A generating server judges each pair with the LM: the
scores equal softmax over transformers' logits of "yes" and "no" at the end of Qwen3-Reranker's prompt, written out
here from its model card. A `--runner pooling` server scores by the cosine similarity of transformers' embeddings.
Rerank results are sorted by score with their indices; bad pairings are 400s."""
from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch

QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are rich in potassium.", "France borders Spain.",
             "The Eiffel Tower is in Paris, France's capital city."]


def qwen3_reranker_prompt(query: str, document: str) -> str:
    """Qwen3-Reranker's model card: system prompt, the default instruction, then an empty think block."""
    return ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the "
            "Instruct provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
            "<Instruct>: Given a web search query, retrieve relevant passages that answer the query\n"
            f"<Query>: {query}\n<Document>: {document}"
            "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def hf_causal(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def judge_reference(hf_causal, tokenizer, query: str, document: str) -> float:
    ids = tokenizer.encode(qwen3_reranker_prompt(query, document), add_special_tokens=False)
    with torch.inference_mode():
        logits = hf_causal(torch.tensor([ids])).logits[0, -1].double()
    vocab = tokenizer.get_vocab()
    pair = torch.stack([logits[vocab["no"]], logits[vocab["yes"]]])
    return float(pair.softmax(dim=0)[1])


def post(server, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    return httpx.post(f"{server.url}{path}", json={"model": server.model_name, **body}, headers=headers, timeout=60)


def test_score_is_the_lm_judgement(server, tokenizer, hf_causal):
    body = post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == [0, 1, 2, 3]
    for item, document in zip(body["data"], DOCUMENTS):
        assert item["object"] == "score"
        assert item["score"] == pytest.approx(judge_reference(hf_causal, tokenizer, QUERY, document), abs=1e-5)
    expected_tokens = sum(len(tokenizer.encode(qwen3_reranker_prompt(QUERY, d), add_special_tokens=False))
                          for d in DOCUMENTS)
    assert body["usage"]["prompt_tokens"] == expected_tokens
    # Pairwise lists, through the /v1 alias.
    pairwise = post(server, "/v1/score", {"text_1": [QUERY, "bananas"], "text_2": DOCUMENTS[:2]}).json()
    assert pairwise["data"][1]["score"] == pytest.approx(
        judge_reference(hf_causal, tokenizer, "bananas", DOCUMENTS[1]), abs=1e-5)


def test_rerank_sorts_by_score(server, tokenizer, hf_causal):
    expected = [judge_reference(hf_causal, tokenizer, QUERY, d) for d in DOCUMENTS]
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)
    body = post(server, "/rerank", {"query": QUERY, "documents": DOCUMENTS}).json()
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-5)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    top = post(server, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                      "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r["document"] is None for r in top["results"])
    assert top["usage"]["total_tokens"] == body["usage"]["total_tokens"] > 0


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1"),
    ("/score", {"text_1": [], "text_2": "c"}, "text_1"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["x " * 400]}, "documents"),
])
def test_bad_pairings_are_400s(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    assert post(server, "/score", {"text_1": "a", "text_2": "b"}).status_code == 200


@pytest.fixture(scope="module")
def pooling_server(model_dir, start_server):
    yield from start_server(model_dir, "--runner", "pooling")


def test_embedding_model_scores_by_cosine(pooling_server, tokenizer, model_dir):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()

    def embed(text: str) -> np.ndarray:
        with torch.inference_mode():
            return hf(torch.tensor([tokenizer.encode(text)])).last_hidden_state[0, -1].double().numpy()

    query = embed(QUERY)
    expected = [float(query @ embed(d) / np.linalg.norm(query) / np.linalg.norm(embed(d))) for d in DOCUMENTS]
    body = post(pooling_server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in body["data"]] == pytest.approx(expected, abs=1e-5)
    ranked = post(pooling_server, "/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()["results"]
    assert [r["index"] for r in ranked] == sorted(range(4), key=lambda i: expected[i], reverse=True)[:3]
    # A pooling model generates nothing: completions are refused with a 400 naming the runner.
    refused = post(pooling_server, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert refused.status_code == 400 and "--runner pooling" in refused.json()["error"]["message"]
