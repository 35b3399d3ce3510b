"""`LLM.embed` and pooling requests through the engine: vectors equal transformers' final-norm hidden states (the
base model's last_hidden_state) pooled the same way, for LAST, MEAN and CLS, through chunked prefill, prefix-cache
hits, preemption (recompute and swap), async scheduling and the mp executor at TP 2 and PP 2; a pooling request
shares a batch with generations and both are right; bad input is refused before anything is queued, and no KV
block leaks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.pooling_params import PoolingParams

MIN_COSINE = 0.99999


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    from transformers import AutoModel

    model_dir = tiny_model_factory("llama")
    return model_dir, AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def reference(base_model, token_ids: list[int], pooling: str = "LAST", normalize: bool = True,
              dimensions: int | None = None) -> np.ndarray:
    """transformers' pooled vector: the base model's last_hidden_state (final norm applied), pooled, truncated and
    normalised in float64 here."""
    with torch.inference_mode():
        hidden = base_model(torch.tensor([token_ids])).last_hidden_state[0].double()
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling].numpy()
    vector = vector[:dimensions] if dimensions else vector
    return vector / np.linalg.norm(vector) if normalize else vector


def cosine(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def make_llm(model_dir, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_memory_bytes", 8 << 20)
    return LLM(model=str(model_dir), max_model_len=256, block_size=16, **kwargs)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_pooled_vectors_equal_transformers(tiny, make_token_prompts, no_leaks, pooling):
    model_dir, hf = tiny
    # A 16-token budget splits the longer prompts into chunks; MEAN sums every chunk's contribution.
    llm = make_llm(model_dir, max_num_batched_tokens=16, pooler_config={"pooling_type": pooling})
    prompts = make_token_prompts([1, 5, 16, 37, 100], seed=3)
    outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        expected = reference(hf, prompt["prompt_token_ids"], pooling)
        embedding = output.outputs.embedding
        assert output.prompt_token_ids == prompt["prompt_token_ids"]
        assert output.outputs.hidden_size == 64 and isinstance(embedding[0], float)
        assert cosine(embedding, expected) >= MIN_COSINE
        np.testing.assert_allclose(embedding, expected, atol=1e-5)  # normalised: unit length
    no_leaks(llm)


def test_text_prompts_unnormalized_and_matryoshka_dimensions(tiny):
    model_dir, hf = tiny
    llm = make_llm(model_dir, pooling="mean")
    text = "The quick brown fox jumps over the lazy dog"
    token_ids = llm.get_tokenizer().encode(text)
    raw = llm.embed(text, PoolingParams(normalize=False), use_tqdm=False)[0]
    np.testing.assert_allclose(raw.outputs.embedding, reference(hf, token_ids, "MEAN", normalize=False),
                               rtol=1e-4, atol=1e-5)
    short = llm.embed([text], PoolingParams(dimensions=8), use_tqdm=False)[0].outputs.embedding
    assert len(short) == 8
    np.testing.assert_allclose(short, reference(hf, token_ids, "MEAN", dimensions=8), atol=1e-5)


def test_alone_equals_in_a_batch_of_64_and_after_a_prefix_hit(tiny, make_token_prompts, no_leaks):
    model_dir, hf = tiny
    llm = make_llm(model_dir, max_num_seqs=64)
    prompts = make_token_prompts([20 + 3 * i for i in range(64)], seed=5)
    alone = llm.embed(prompts[10], use_tqdm=False)[0]
    batch = llm.embed(prompts, use_tqdm=False)
    np.testing.assert_allclose(batch[10].outputs.embedding, alone.outputs.embedding, atol=2e-6)
    # The same prompt again: LAST pooling reuses its two full cached blocks and computes the rest.
    engine = llm.llm_engine
    request_id = "again"
    engine.add_request(request_id, prompts[10], PoolingParams())
    finished = []
    while engine.has_unfinished_requests():
        finished += engine.step()[0]
    assert finished[0].num_cached_tokens == 48
    np.testing.assert_allclose(finished[0].outputs.data.numpy(), alone.outputs.embedding, atol=2e-6)
    assert cosine(alone.outputs.embedding, reference(hf, prompts[10]["prompt_token_ids"])) >= MIN_COSINE
    no_leaks(llm)


def test_full_prefix_hit_still_computes_the_last_token(tiny, make_token_prompts):
    """A prompt of whole blocks, all cached: the last token is computed again (its hidden state is the vector)."""
    model_dir, hf = tiny
    llm = make_llm(model_dir)
    prompt = make_token_prompts([32], seed=8)[0]
    first = llm.embed(prompt, use_tqdm=False)[0]
    engine = llm.llm_engine
    engine.add_request("hit", prompt, PoolingParams())
    (second,), _ = engine.step()
    assert second.num_cached_tokens == 16  # the second block holds the last token, so it is computed
    np.testing.assert_allclose(second.outputs.data.numpy(), first.outputs.embedding, atol=2e-6)
    assert cosine(first.outputs.embedding, reference(hf, prompt["prompt_token_ids"])) >= MIN_COSINE


def test_mean_pooling_never_reads_the_prefix_cache(tiny, make_token_prompts):
    model_dir, hf = tiny
    llm = make_llm(model_dir, pooling="mean")
    prompt = make_token_prompts([40], seed=9)[0]
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)  # fills the cache with the prompt's blocks
    engine = llm.llm_engine
    engine.add_request("mean", prompt, PoolingParams())
    (output,), _ = engine.step()
    assert output.num_cached_tokens == 0
    assert cosine(output.outputs.data.numpy(), reference(hf, prompt["prompt_token_ids"], "MEAN")) >= MIN_COSINE


def test_pooling_and_generation_share_a_batch(tiny, make_token_prompts, hf_greedy, no_leaks):
    from transformers import AutoModelForCausalLM

    model_dir, hf = tiny
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    generate_prompt, embed_prompt = make_token_prompts([12, 30], seed=4)
    engine.add_request("gen", generate_prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    engine.add_request("emb", embed_prompt, PoolingParams())
    outputs, _ = engine.step_outputs()  # one step: both prefills; the embedding is done, the generation has a token
    by_id = {output.request_id: output for output in outputs}
    assert set(by_id) == {"gen", "emb"}
    assert len(by_id["gen"].outputs[0].token_ids) == 1
    assert cosine(by_id["emb"].outputs.data.numpy(), reference(hf, embed_prompt["prompt_token_ids"])) >= MIN_COSINE
    tokens = list(by_id["gen"].outputs[0].token_ids)
    while engine.has_unfinished_requests():
        outputs, _ = engine.step_outputs(delta=True)
        tokens += [t for output in outputs for t in output.outputs[0].token_ids]
    causal = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    assert tokens == hf_greedy(causal, generate_prompt["prompt_token_ids"], 6)
    no_leaks(llm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_pooled_vectors_exact(tiny, make_token_prompts, no_leaks, mode):
    """A pool of 24 blocks and 16-token chunks: long MEAN-pooled prompts and generations preempt one another."""
    model_dir, hf = tiny
    pool = 24 * 2 * 2 * 16 * 2 * 16 * 4  # 24 blocks: K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    llm = make_llm(model_dir, kv_cache_memory_bytes=pool, max_num_batched_tokens=16, preemption_mode=mode,
                   pooling="mean")
    prompts = make_token_prompts([120, 90, 150, 60], seed=6)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen{i}", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
        engine.add_request(f"emb{i}", prompt, PoolingParams())
    embeddings = {}
    while engine.has_unfinished_requests():
        for output in engine.step()[0]:
            if output.request_id.startswith("emb"):
                embeddings[output.request_id] = output.outputs.data.numpy()
    assert engine.engine_core.scheduler.num_preemptions_total > 0
    if mode == "swap":
        assert engine.engine_core.kv_cache_manager.num_swapped_in_blocks > 0
    for i, prompt in enumerate(prompts):
        assert cosine(embeddings[f"emb{i}"], reference(hf, prompt["prompt_token_ids"], "MEAN")) >= MIN_COSINE
    no_leaks(llm)


def test_qwen3_last_pooling(tiny_model_factory, make_token_prompts):
    """Qwen3-Embedding is a plain Qwen3 with LAST pooling, served with --runner pooling."""
    from transformers import AutoModel

    model_dir = tiny_model_factory("qwen3")
    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    llm = make_llm(model_dir, runner="pooling")
    prompts = make_token_prompts([7, 45], seed=2)
    for prompt, output in zip(prompts, llm.embed(prompts, use_tqdm=False)):
        assert cosine(output.outputs.embedding, reference(hf, prompt["prompt_token_ids"])) >= MIN_COSINE
    with pytest.raises(ValueError, match="--runner pooling"):
        llm.generate(prompts[0], use_tqdm=False)


def test_bad_input_is_refused_before_queueing(tiny, no_leaks):
    model_dir, _ = tiny
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([{"prompt_token_ids": [5]}, {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be at most 64"):
        llm.embed("hello", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.embed({"prompt_token_ids": [1, 49152]}, use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions must be a positive integer"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        make_llm(model_dir, pooler_config={"pooling_type": "max"})
    no_leaks(llm)


def test_async_scheduling_mixes_pooling_and_generation(tiny, make_token_prompts, hf_greedy, no_leaks):
    from transformers import AutoModelForCausalLM

    model_dir, hf = tiny
    llm = make_llm(model_dir, async_scheduling=True, max_num_batched_tokens=16, pooling="mean")
    prompts = make_token_prompts([20, 45, 8], seed=10)
    engine = llm.llm_engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"gen{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        engine.add_request(f"emb{i}", prompt, PoolingParams())
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((output.request_id, output) for output in engine.step()[0])
    causal = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        assert outputs[f"gen{i}"].outputs[0].token_ids == hf_greedy(causal, prompt["prompt_token_ids"], 5)
        expected = reference(hf, prompt["prompt_token_ids"], "MEAN")
        assert cosine(outputs[f"emb{i}"].outputs.data.numpy(), expected) >= MIN_COSINE
    no_leaks(llm)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_mp_executor_tensor_and_pipeline_parallel(tiny, make_token_prompts, tp, pp):
    """The pooled vectors travel back pickled from the output rank (the last stage's first rank)."""
    model_dir, hf = tiny
    prompts = make_token_prompts([9, 33], seed=7)
    with make_llm(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="mp",
                  max_num_batched_tokens=16) as llm:
        outputs = llm.embed(prompts, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert cosine(output.outputs.embedding, reference(hf, prompt["prompt_token_ids"])) >= MIN_COSINE


def test_a_max_model_len_prompt_fills_the_smallest_pool(tiny, make_token_prompts, no_leaks):
    """A pool of exactly one max_model_len prompt (4 blocks of 16): a pooling request never grows past its prompt."""
    model_dir, hf = tiny
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # K and V, 2 layers, 16 tokens, 2 KV heads of 16, float32
    llm = LLM(model=str(model_dir), max_model_len=64, block_size=16, kv_cache_memory_bytes=4 * block_bytes)
    prompt = make_token_prompts([64], seed=12)[0]
    (output,) = llm.embed(prompt, use_tqdm=False)
    assert cosine(output.outputs.embedding, reference(hf, prompt["prompt_token_ids"])) >= MIN_COSINE
    no_leaks(llm)


def test_priority_puts_a_pooling_request_first(tiny, make_token_prompts, no_leaks):
    """One sequence slot: a running low-priority generation is preempted for a higher-priority embedding."""
    model_dir, hf = tiny
    llm = make_llm(model_dir, scheduling_policy="priority", max_num_seqs=1)
    engine = llm.llm_engine
    generate_prompt, embed_prompt = make_token_prompts([10, 25], seed=13)
    engine.add_request("gen", generate_prompt, SamplingParams(max_tokens=20, ignore_eos=True), priority=5)
    engine.step()
    engine.add_request("emb", embed_prompt, PoolingParams(), priority=0)
    order = []
    while engine.has_unfinished_requests():
        order += [output.request_id for output in engine.step()[0]]
    assert order == ["emb", "gen"]
    assert engine.engine_core.scheduler.num_preemptions_total == 1
    no_leaks(llm)
