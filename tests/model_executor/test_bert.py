"""BERT encoders (models/bert.py, layers/attention/encoder.py): a tiny random-weight BertModel's vectors equal
transformers' last_hidden_state pooled the same way, for prompts of one to many tokens in one batch; the real
all-MiniLM-L6-v2 embeds as sentence-transformers does, alone or inside a batch of 16; the engine takes the
checkpoint's sentence-transformers pooling as its default, turns chunked prefill and prefix caching off, and refuses
generation."""
from __future__ import annotations

import random
import shutil

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.config import PoolerConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.exceptions import InvalidRequestError

MIN_COSINE = 0.99999
SENTENCES = ["A man is eating food.", "Paged attention keeps the KV cache in blocks.", "hi",
             "The quick brown fox jumps over the lazy dog, twice, before breakfast on a cold Sunday morning."]


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory, minilm_dir):
    """A 2-layer random-weight BertModel with MiniLM's tokenizer, and transformers' model of it. Weights are larger
    than BERT's init so attention is far from uniform: a causal or cross-sequence mask would change the vectors."""
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=128, architectures=["BertModel"])
    torch.manual_seed(0)
    model = BertModel(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "LayerNorm" in name:
                param.add_(torch.randn_like(param) * 0.1)
            else:
                param.normal_(0.0, 0.3)
    path = tmp_path_factory.mktemp("tiny-bert")
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(minilm_dir / name, path / name)
    return path, model


@pytest.mark.parametrize("pooling", [None, "mean"])  # None: a plain BertModel's default, CLS
def test_tiny_bert_equals_transformers(tiny_bert, pooling):
    path, model = tiny_bert
    rng = random.Random(0)
    # One token (laid out as a decode row), a few, and many, all in one step.
    prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in (1, 2, 7, 40, 100)]
    llm = LLM(model=str(path), pooling=pooling, dtype="float32")
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts])
    for ids, output in zip(prompts, outputs):
        with torch.inference_mode():
            hidden = model(torch.tensor([ids])).last_hidden_state[0].double()
        expected = hidden.mean(dim=0) if pooling == "mean" else hidden[0]
        assert cosine(output.outputs.embedding, expected.numpy()) >= MIN_COSINE


def test_plain_bert_pools_cls_and_encoders_run_unchunked_uncached(tiny_bert):
    config = EngineArgs(model=str(tiny_bert[0])).create_engine_config()
    # vLLM's default for a BertModel without a sentence-transformers config; an encoder serves pooling only.
    assert config.model_config.pooler_config == PoolerConfig(pooling_type="CLS", normalize=True)
    assert config.model_config.runner == "pooling"
    assert not config.scheduler_config.enable_chunked_prefill
    assert not config.cache_config.enable_prefix_caching
    with pytest.raises(ValueError, match="encoder-only model: it computes embeddings, not text"):
        EngineArgs(model=str(tiny_bert[0]), runner="generate").create_engine_config()


@pytest.fixture(scope="module")
def minilm(minilm_dir):
    return LLM(model=str(minilm_dir), dtype="float32")


@pytest.fixture(scope="module")
def sentence_transformer(minilm_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


def test_minilm_takes_its_sentence_transformers_config(minilm):
    model_config = minilm.llm_engine.config.model_config
    # 1_Pooling/config.json: mean tokens; modules.json lists Normalize; sentence_bert_config.json: 256 tokens.
    assert model_config.pooler_config == PoolerConfig(pooling_type="MEAN", normalize=True)
    assert model_config.max_model_len == 256


def test_minilm_equals_sentence_transformers(minilm, sentence_transformer):
    expected = sentence_transformer.encode(SENTENCES)
    for output, reference in zip(minilm.embed(SENTENCES), expected):
        assert cosine(output.outputs.embedding, reference) >= MIN_COSINE


def test_one_input_alone_equals_it_inside_a_batch(minilm):
    batch = [f"sentence number {i} of the batch, {'with more words ' * (i % 5)}" for i in range(15)]
    alone = minilm.embed([SENTENCES[1]])[0].outputs.embedding
    inside = minilm.embed(batch[:7] + [SENTENCES[1]] + batch[7:])[7].outputs.embedding
    np.testing.assert_allclose(inside, alone, rtol=0, atol=1e-6)


def test_generation_is_refused(minilm):
    with pytest.raises(InvalidRequestError, match="encoder-only"):
        minilm.generate(["hello"], SamplingParams(max_tokens=2))
