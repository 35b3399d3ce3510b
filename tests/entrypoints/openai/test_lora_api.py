"""LoRA adapters over the OpenAI API, with the openai SDK: an adapter served from the start (--lora-modules) and one
loaded at run time (`/v1/load_lora_adapter`), each selected by `model`, each completion the greedy text of PEFT's
merged model in transformers; `/v1/models` lists them with their parent; bad adapters are a 400 naming the problem
and leave the loaded ones serving; unloading makes the name a 404."""
from __future__ import annotations

import httpx
import openai
import pytest
import torch

PROMPT = [301, 4021, 77, 9000, 12, 555, 8080, 31, 2000, 4]
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def adapters(model_dir, peft_adapter_factory):
    return (peft_adapter_factory(model_dir, seed=1, rank=8, alpha=16),
            peft_adapter_factory(model_dir, seed=2, rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj")))


@pytest.fixture(scope="module")
def lora_server(model_dir, adapters, start_server):
    yield from start_server(model_dir, "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                            "--lora-modules", f"one={adapters[0]}")


@pytest.fixture(scope="module")
def lora_client(lora_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def merged_text(model_dir, adapter) -> str:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.entrypoints.conftest import hf_greedy_generate

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    ids = hf_greedy_generate(model.eval(), PROMPT, MAX_TOKENS)
    return AutoTokenizer.from_pretrained(str(model_dir)).decode(ids)


def complete(client: openai.OpenAI, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                     extra_body={"ignore_eos": True}).choices[0].text


def test_adapters_by_model_name(lora_server, lora_client, model_dir, adapters):
    expected_one, expected_base = merged_text(model_dir, adapters[0]), merged_text(model_dir, None)
    assert expected_one != expected_base
    assert complete(lora_client, "one") == expected_one
    assert complete(lora_client, lora_server.model_name) == expected_base

    response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter",
                          json={"lora_name": "two", "lora_path": str(adapters[1])}, timeout=30)
    assert response.status_code == 200, response.text
    assert complete(lora_client, "two") == merged_text(model_dir, adapters[1])
    cards = {card.id: card for card in lora_client.models.list().data}
    assert cards["one"].parent == cards["two"].parent == lora_server.model_name
    assert cards["two"].root == str(adapters[1])
    assert getattr(cards[lora_server.model_name], "parent", None) is None

    # --max-loras 2: a third is refused, naming the limit; the loaded ones keep serving.
    response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter",
                          json={"lora_name": "three", "lora_path": str(adapters[1])}, timeout=30)
    assert response.status_code == 400 and "--max-loras" in response.json()["error"]["message"]
    assert httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "two"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(lora_client, "two")
    assert complete(lora_client, "one") == expected_one


def test_pooling_routes_refuse_an_adapter_name(lora_server, lora_client):
    """Adapters apply to generation only: embeddings and scores for an adapter's name are a 400, not the base
    model's vectors under the adapter's name."""
    with pytest.raises(openai.BadRequestError, match="LoRA adapter") as error:
        lora_client.embeddings.create(model="one", input="paged attention")
    assert error.value.body["param"] == "model"
    response = httpx.post(f"{lora_server.url}/score", json={"model": "one", "text_1": "a", "text_2": "b"}, timeout=30)
    assert response.status_code == 400 and "LoRA adapter" in response.json()["error"]["message"]


@pytest.mark.parametrize("body, message", [
    ({"lora_name": "bad", "lora_path": "/nonexistent/adapter"}, "adapter_config.json is missing"),
    ({"lora_name": "tiny", "lora_path": "/nonexistent/adapter"}, "base model's name"),
    ({"lora_name": "one", "lora_path": "/nonexistent/adapter"}, "already served"),
])
def test_bad_loads_are_400(lora_server, lora_client, body, message):
    response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json=body, timeout=30)
    assert response.status_code == 400
    assert message in response.json()["error"]["message"]
    assert "one" in {card.id for card in lora_client.models.list().data}


def test_adapter_of_another_base_is_400(lora_server, tiny_model_factory, peft_adapter_factory):
    wider = tiny_model_factory("llama", hidden_size=96)
    response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter",
                          json={"lora_name": "wide", "lora_path": str(peft_adapter_factory(wider, seed=1))}, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "lora_path"
    assert "another base model" in response.json()["error"]["message"]


def test_unload_unknown_is_404(lora_server):
    response = httpx.post(f"{lora_server.url}/v1/unload_lora_adapter", json={"lora_name": "never"})
    assert response.status_code == 404
