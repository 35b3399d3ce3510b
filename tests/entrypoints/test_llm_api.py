"""The offline API surface (`LLM.generate`, `LLM.chat`, `get_tokenizer`, `SamplingParams`) and how it treats bad
input: clear errors naming the offending field or value, and an engine that keeps working afterwards."""
from __future__ import annotations

import json
import shutil

import pytest

from pagellm import LLM, SamplingParams

MAX_MODEL_LEN = 128
KV_BYTES = 2 << 20
TEXTS = ["Hello, my name is", "The capital of France is", "a"]


def greedy(max_tokens: int | None = 8, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def engine_is_idle(llm: LLM) -> bool:
    core = llm.llm_engine.engine_core
    pool = core.kv_cache_manager.block_pool
    return not core.scheduler.has_unfinished_requests() and pool.num_free_blocks == pool.num_blocks



@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def tokenizer(llm):
    return llm.get_tokenizer()


@pytest.fixture(scope="module")
def single_results(llm):
    """Each text run on its own, as the reference for batched calls."""
    return {text: llm.generate(text, greedy(), use_tqdm=False)[0].outputs[0].token_ids for text in TEXTS}


# ------------------------------------------------------------------------------------------- prompt forms


def test_single_string_prompt(llm, tokenizer, no_leaks):
    outputs = llm.generate("Hello, my name is", greedy(5), use_tqdm=False)
    assert isinstance(outputs, list) and len(outputs) == 1
    out = outputs[0]
    assert out.finished
    assert out.prompt == "Hello, my name is"
    assert out.prompt_token_ids == tokenizer.encode("Hello, my name is")
    completion = out.outputs[0]
    assert len(completion.token_ids) == 5
    assert completion.finish_reason == "length"
    assert completion.stop_reason is None
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    assert completion.finished()
    no_leaks(llm)


def test_list_of_strings_in_input_order(llm, tokenizer, single_results, no_leaks):
    texts = TEXTS + TEXTS[::-1]
    outputs = llm.generate(texts, greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == texts
    assert [o.prompt_token_ids for o in outputs] == [tokenizer.encode(t) for t in texts]
    assert [o.outputs[0].token_ids for o in outputs] == [single_results[t] for t in texts]
    assert len({o.request_id for o in outputs}) == len(texts)
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    no_leaks(llm)


def test_token_id_and_prompt_dicts(llm, tokenizer, single_results, no_leaks):
    ids = [tokenizer.encode(t) for t in TEXTS]
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], greedy(), use_tqdm=False)
    for text, i, out in zip(TEXTS, ids, outputs):
        assert out.prompt is None
        assert out.prompt_token_ids == i
        assert out.outputs[0].token_ids == single_results[text]
    outputs = llm.generate([{"prompt": t} for t in TEXTS], greedy(), use_tqdm=False)
    assert [o.prompt for o in outputs] == TEXTS
    assert [o.outputs[0].token_ids for o in outputs] == [single_results[t] for t in TEXTS]
    no_leaks(llm)


def test_empty_prompt_list_returns_nothing(llm):
    assert llm.generate([], greedy(), use_tqdm=False) == []


def test_default_sampling_params(llm, no_leaks):
    (out,) = llm.generate("Once upon a time", use_tqdm=False)  # SamplingParams(): temperature 1, 16 tokens
    assert 1 <= len(out.outputs[0].token_ids) <= 16
    assert out.outputs[0].finish_reason in ("stop", "length")
    no_leaks(llm)


def test_use_tqdm_true_works(llm, single_results):
    (out,) = llm.generate(TEXTS[0], greedy(), use_tqdm=True)
    assert out.outputs[0].token_ids == single_results[TEXTS[0]]


# ---------------------------------------------------------------------------------------- sampling params


def test_per_prompt_sampling_params(llm, single_results, no_leaks):
    max_tokens = [3, 1, 8]
    outputs = llm.generate(TEXTS, [greedy(n) for n in max_tokens], use_tqdm=False)
    for text, n, out in zip(TEXTS, max_tokens, outputs):
        assert len(out.outputs[0].token_ids) == n
        assert out.outputs[0].token_ids == single_results[text][:n]
        assert out.outputs[0].finish_reason == "length"
    no_leaks(llm)


@pytest.mark.parametrize("count", [0, 2, 4])
def test_wrong_number_of_sampling_params(llm, count):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(TEXTS, [greedy()] * count, use_tqdm=False)
    assert engine_is_idle(llm)


def test_not_a_sampling_params(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(TEXTS, [greedy(), {"temperature": 0}, greedy()], use_tqdm=False)
    assert engine_is_idle(llm)


def test_max_tokens_gives_length_with_exact_count(llm, no_leaks):
    for n in (1, 2, 17):
        (out,) = llm.generate(TEXTS[1], greedy(n), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == n
        assert out.outputs[0].finish_reason == "length"
    no_leaks(llm)


def test_stop_token_ids(llm, tokenizer, no_leaks):
    (free_run,) = llm.generate(TEXTS[0], greedy(20), use_tqdm=False)
    tokens = free_run.outputs[0].token_ids
    # A token whose first occurrence is at least a few tokens in, so the stop is a real mid-sequence stop.
    index = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    stop = tokens[index]
    (out,) = llm.generate(TEXTS[0], greedy(20, stop_token_ids=[stop]), use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == tokens[:index + 1]  # the stop token is the last one returned
    assert completion.finish_reason == "stop"
    assert completion.stop_reason == stop
    assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)
    no_leaks(llm)


@pytest.fixture(scope="module")
def eos_variant(llm, model_dir, tmp_path_factory):
    """A copy of the model whose generation_config.json names, as EOS, tokens the model is known to produce
    greedily: returns (dir, prompt, free-running greedy tokens, index where EOS first appears)."""
    (free_run,) = llm.generate(TEXTS[1], greedy(20), use_tqdm=False)
    tokens = free_run.outputs[0].token_ids
    index = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    later = next(t for t in tokens[index + 1:] if t not in tokens[:index + 1])
    variant = tmp_path_factory.mktemp("eos-variant")
    shutil.copytree(model_dir, variant, dirs_exist_ok=True)
    # A list, as in Llama 3's generation config: either id ends the sequence.
    (variant / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [later, tokens[index]], "pad_token_id": 0}))
    return variant, TEXTS[1], tokens, index


def test_eos_from_generation_config_stops(eos_variant, tokenizer, no_leaks):
    variant, prompt, tokens, index = eos_variant
    llm = LLM(model=str(variant), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
    stopped, ignored = llm.generate([prompt, prompt], [SamplingParams(temperature=0.0, max_tokens=20),
                                                       greedy(20)], use_tqdm=False)
    assert stopped.outputs[0].token_ids == tokens[:index + 1]  # the EOS token is returned
    assert stopped.outputs[0].finish_reason == "stop"
    assert stopped.outputs[0].stop_reason is None  # EOS, not a stop_token_ids hit
    assert stopped.outputs[0].text == tokenizer.decode(tokens[:index + 1], skip_special_tokens=True)
    assert ignored.outputs[0].token_ids == tokens  # ignore_eos=True runs through it
    assert ignored.outputs[0].finish_reason == "length"
    no_leaks(llm)


def test_text_is_decoded_without_special_tokens(llm, tokenizer):
    outputs = llm.generate(TEXTS, SamplingParams(temperature=1.0, seed=7, max_tokens=24), use_tqdm=False)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.text == tokenizer.decode(completion.token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kwargs", [dict(temperature=1.0, top_k=1), dict(temperature=0.7, top_p=1e-6),
                                    dict(temperature=1e-6)], ids=["top_k-1", "tiny-top_p", "tiny-temperature"])
def test_sampling_that_must_reduce_to_greedy(llm, single_results, kwargs):
    """top_k=1, a vanishing nucleus, or a temperature below the greedy threshold all leave only the argmax."""
    params = [SamplingParams(max_tokens=8, ignore_eos=True, seed=s, **kwargs) for s in (None, 11)]
    outputs = llm.generate([TEXTS[0], TEXTS[0]], params, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].token_ids == single_results[TEXTS[0]]


def test_llm_seed_makes_unseeded_sampling_reproducible(model_dir):
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    def sample(seed: int) -> list[list[int]]:
        llm = LLM(model=str(model_dir), seed=seed, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
        return [o.outputs[0].token_ids for o in llm.generate(TEXTS, params, use_tqdm=False)]

    first = sample(1)
    assert sample(1) == first
    assert sample(2) != first


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=-0.5), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-5), "max_tokens"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(seed="abc"), "seed"),
])
def test_sampling_params_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_accepted_edges():
    assert SamplingParams(temperature=0.0).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    assert SamplingParams(top_k=0).top_k == -1  # 0 means disabled, like -1
    assert SamplingParams(top_k=1).top_k == 1
    assert SamplingParams(top_p=1.0).top_p == 1.0
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_max_tokens_none_runs_to_max_model_len(llm, make_token_prompts):
    prompt = make_token_prompts([MAX_MODEL_LEN - 10])[0]
    (out,) = llm.generate(prompt, greedy(None), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 10
    assert out.outputs[0].finish_reason == "length"


def test_generation_capped_at_max_model_len(llm, make_token_prompts, no_leaks):
    prompts = make_token_prompts([MAX_MODEL_LEN - 3, MAX_MODEL_LEN], seed=5)
    near, full = llm.generate(prompts, greedy(10), use_tqdm=False)
    assert len(near.outputs[0].token_ids) == 3
    assert near.outputs[0].finish_reason == "length"
    # A prompt of exactly max_model_len tokens is accepted; its first token already reaches the limit.
    assert len(full.outputs[0].token_ids) == 1
    assert full.outputs[0].finish_reason == "length"
    no_leaks(llm)


# ---------------------------------------------------------------------------------------- tokenizer, chat

CONVERSATION = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
CONVERSATION_2 = [{"role": "user", "content": "Hi!"}]


def test_get_tokenizer(llm, tokenizer):
    assert tokenizer is llm.get_tokenizer()
    ids = tokenizer.encode("Hello world")
    assert ids and tokenizer.decode(ids) == "Hello world"
    text = tokenizer.apply_chat_template(CONVERSATION_2, tokenize=False, add_generation_prompt=True)
    assert "Hi!" in text


def test_chat_one_conversation(llm, tokenizer, no_leaks):
    outputs = llm.chat(CONVERSATION, greedy(6), use_tqdm=False)
    assert len(outputs) == 1
    expected_ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
    assert outputs[0].prompt_token_ids == expected_ids
    assert outputs[0].prompt == tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True,
                                                              tokenize=False)
    (direct,) = llm.generate({"prompt_token_ids": expected_ids}, greedy(6), use_tqdm=False)
    assert outputs[0].outputs[0].token_ids == direct.outputs[0].token_ids
    no_leaks(llm)


def test_chat_list_of_conversations(llm, tokenizer, no_leaks):
    conversations = [CONVERSATION, CONVERSATION_2, CONVERSATION]
    outputs = llm.chat(conversations, greedy(6), use_tqdm=False)
    assert len(outputs) == 3
    for conv, out in zip(conversations, outputs):
        assert out.prompt_token_ids == tokenizer.apply_chat_template(conv, add_generation_prompt=True,
                                                                     tokenize=True, return_dict=False)
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    # The generation prompt is honoured either way.
    (no_gen,) = llm.chat(CONVERSATION_2, greedy(2), add_generation_prompt=False, use_tqdm=False)
    assert len(no_gen.prompt_token_ids) < len(outputs[1].prompt_token_ids)
    no_leaks(llm)


# ------------------------------------------------------------------------------------------------ bad input


def test_prompt_longer_than_max_model_len(llm, make_token_prompts, single_results, no_leaks):
    (too_long,) = make_token_prompts([MAX_MODEL_LEN + 1])
    with pytest.raises(ValueError, match="max_model_len") as info:
        llm.generate(too_long, greedy(), use_tqdm=False)
    message = str(info.value)
    assert str(MAX_MODEL_LEN + 1) in message and str(MAX_MODEL_LEN) in message
    assert engine_is_idle(llm)
    # The engine is still usable and still correct.
    (out,) = llm.generate(TEXTS[0], greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == single_results[TEXTS[0]]
    no_leaks(llm)


def test_one_bad_prompt_queues_nothing(llm, make_token_prompts, single_results, no_leaks):
    (too_long,) = make_token_prompts([MAX_MODEL_LEN + 7])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([TEXTS[0], TEXTS[1], too_long, TEXTS[2]], greedy(), use_tqdm=False)
    # All or nothing: the good prompts before the bad one were not left queued.
    assert engine_is_idle(llm)
    outputs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [single_results[t] for t in TEXTS]
    assert [o.prompt for o in outputs] == TEXTS
    no_leaks(llm)


def test_interrupted_generate_releases_its_requests(llm, single_results, monkeypatch, no_leaks):
    """Ctrl-C (or any failure) in the middle of generate(): the call's requests are aborted, blocks freed."""
    engine = llm.llm_engine
    real_step, calls = engine.step, []

    def step_then_interrupt():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    monkeypatch.setattr(engine, "step", step_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(TEXTS, greedy(max_tokens=20), use_tqdm=False)
    monkeypatch.undo()
    assert engine_is_idle(llm)
    outputs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [single_results[t] for t in TEXTS]
    no_leaks(llm)


@pytest.mark.parametrize("prompt", [
    "",
    {"prompt_token_ids": []},
    {"prompt_token_ids": [5, 49152]},  # vocab_size is 49152
    {"prompt_token_ids": [10**9]},
    {"prompt_token_ids": [-1, 5]},
    {"prompt_token_ids": [1.5]},
], ids=["empty-text", "empty-ids", "id-eq-vocab", "huge-id", "negative-id", "float-id"])
def test_invalid_prompt(llm, prompt, single_results):
    with pytest.raises(ValueError):
        llm.generate([TEXTS[0], prompt], greedy(), use_tqdm=False)
    assert engine_is_idle(llm)
    (out,) = llm.generate(TEXTS[0], greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == single_results[TEXTS[0]]


@pytest.mark.parametrize("prompt", [123, None, ["a", "b"], {"text": "hi"}], ids=repr)
def test_prompt_of_wrong_type(llm, prompt):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([prompt], greedy(), use_tqdm=False)
    assert engine_is_idle(llm)


# --------------------------------------------------------------------------------------- engine arguments


def test_kv_budget_too_small_for_max_model_len(model_dir):
    with pytest.raises(ValueError) as info:
        LLM(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=4096)
    message = str(info.value)
    assert "kv_cache_memory" in message and "--kv-cache-memory" in message
    assert "max_model_len" in message and str(MAX_MODEL_LEN) in message


def test_max_model_len_above_model_limit(model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(model=str(model_dir), max_model_len=4096, kv_cache_memory_bytes=KV_BYTES)  # model limit: 1024


@pytest.mark.parametrize("kwargs, field", [
    pytest.param(dict(block_size=3), "block_size", id="block_size-3"),
    pytest.param(dict(max_num_seqs=0), "max_num_seqs", id="max_num_seqs-0"),
    pytest.param(dict(max_num_batched_tokens=0), "max_num_batched_tokens", id="budget-0"),
    pytest.param(dict(enable_chunked_prefill=False, max_num_batched_tokens=MAX_MODEL_LEN - 1),
                 "max_num_batched_tokens", id="no-chunking-budget-below-max_model_len"),
    pytest.param(dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes", id="kv-bytes-0"),
    pytest.param(dict(device="mps"), "device", id="device-mps"),
    pytest.param(dict(device="tpu"), "device", id="device-tpu"),  # not even a torch device type
    pytest.param(dict(device="cuda"), "CUDA", id="device-cuda-unavailable", marks=pytest.mark.skipif(
        __import__("torch").cuda.is_available(), reason="CUDA is available here")),
])
def test_invalid_engine_arguments(model_dir, kwargs, field):
    args = dict(model=str(model_dir), max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        LLM(**args)


@pytest.mark.parametrize("model", ["/nonexistent/pagellm-test/model", "./no-such-model-dir", "no-such-model"])
def test_unknown_model_path(model):
    with pytest.raises(FileNotFoundError, match="not found"):
        LLM(model=model)


def test_directory_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        LLM(model=str(tmp_path))


def test_separate_tokenizer_dir(model_dir, tmp_path, single_results):
    """Weights and config in one directory, the tokenizer in another (tokenizer=...)."""
    weights_only = tmp_path / "weights"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        shutil.copy(model_dir / name, weights_only / name)
    llm = LLM(model=str(weights_only), tokenizer=str(model_dir), max_model_len=MAX_MODEL_LEN,
              kv_cache_memory_bytes=KV_BYTES)
    (out,) = llm.generate(TEXTS[0], greedy(), use_tqdm=False)
    assert out.outputs[0].token_ids == single_results[TEXTS[0]]


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="gguf"):
        LLM(model=str(path))


def test_unsupported_architecture(tmp_path, model_dir):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2_dir = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=49152, n_positions=64)).save_pretrained(
        gpt2_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model_dir / name, gpt2_dir / name)
    with pytest.raises(ValueError) as info:
        LLM(model=str(gpt2_dir), kv_cache_memory_bytes=KV_BYTES)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in message


def test_unsupported_architecture_rewritten_config(tmp_path, model_dir):
    """A Llama checkpoint whose config claims another architecture is refused before any weight is read."""
    fake = tmp_path / "fake"
    shutil.copytree(model_dir, fake)
    config = json.loads((fake / "config.json").read_text())
    config.update(architectures=["MambaForCausalLM"], model_type="mamba")
    (fake / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="Supported architectures") as info:
        LLM(model=str(fake), kv_cache_memory_bytes=KV_BYTES)
    assert "MambaForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_hub_id_while_offline(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import time, so also flip the module's flag.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(Exception) as info:
        LLM(model="someorg/some-model")
    message = str(info.value)
    assert "someorg/some-model" in message
    assert "download" in message.lower()
    assert "local" in message and ".gguf" in message


# -------------------------------------------------------------------------------------------------- dtypes


def test_bfloat16_runs(model_dir, no_leaks):
    import torch

    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
    assert llm.llm_engine.config.model_config.dtype == torch.bfloat16
    outputs = llm.generate(TEXTS, greedy(6), use_tqdm=False)
    for out in outputs:
        assert len(out.outputs[0].token_ids) == 6
        assert all(0 <= t < 49152 for t in out.outputs[0].token_ids)
    no_leaks(llm)


@pytest.mark.parametrize("dtype", ["float16", "torch.float16", "torch.bfloat16"])
def test_other_dtypes_run(model_dir, dtype, no_leaks):
    import torch

    if dtype.startswith("torch."):
        dtype = getattr(torch, dtype.split(".")[1])  # a torch.dtype is accepted too
    llm = LLM(model=str(model_dir), dtype=dtype, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
    expected = dtype if isinstance(dtype, torch.dtype) else torch.float16
    assert llm.llm_engine.config.model_config.dtype == expected
    (out,) = llm.generate(TEXTS[0], greedy(4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    no_leaks(llm)


@pytest.mark.parametrize("dtype", ["float8", "int8", "bfloat", "FP33"])
def test_invalid_dtype(model_dir, dtype):
    with pytest.raises(ValueError, match="dtype"):
        LLM(model=str(model_dir), dtype=dtype, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=KV_BYTES)
