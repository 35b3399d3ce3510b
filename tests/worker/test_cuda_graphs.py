"""Decode graphs: the static buffers, the padding of a batch up to its captured size and the check of each capture.

Without a GPU the "capture" is an eager stand-in that reruns the forward on the static buffers at each replay: what
is checked here is everything around the CUDA graph itself (buffers, padding into the scratch block, bucket
choice, rejecting a bad capture), through the whole engine against transformers."""
from __future__ import annotations

import pytest
import torch

from pagellm import LLM, SamplingParams
from pagellm.worker import cuda_graphs
from pagellm.worker.cuda_graphs import DecodeGraphs, batch_buckets
from pagellm.worker.worker import Worker


def eager_capture(forward):
    return forward


def test_buckets_cover_every_batch_size_up_to_the_limit():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(1000)[-3:] == [240, 248, 256]


@pytest.fixture
def graphed_llm(monkeypatch, tiny_model_factory):
    """An engine whose worker captures decode graphs (eager stand-ins) as it would on CUDA."""
    monkeypatch.setattr(Worker, "uses_decode_graphs", lambda self: True)
    monkeypatch.setattr(cuda_graphs, "cuda_capture", lambda: eager_capture)
    llm = LLM(model=str(tiny_model_factory("llama")), max_model_len=128, kv_cache_memory_bytes=4 << 20,
              block_size=8, max_num_seqs=6)
    return llm


def test_engine_decodes_through_graphs_like_transformers(graphed_llm, make_token_prompts, monkeypatch):
    """Requests of different lengths finish at different steps, so decode batches of 5 down to 1 pad to the
    buckets 6, 4, 2, 1; every token and logprob matches transformers, and no request's block is touched by
    padding rows (their tokens would change)."""
    from transformers import AutoModelForCausalLM

    worker = graphed_llm.llm_engine.engine_core.executor.worker
    graphs = worker.model_runner.decode_graphs
    assert graphs.captured == [1, 2, 4, 6]
    pool = graphed_llm.llm_engine.engine_core.kv_cache_manager.block_pool
    assert graphs.scratch_block == pool.num_blocks == worker.cache_engine.num_blocks - 1
    replays = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda batch, *args: replays.append(batch) or run(batch, *args))

    prompts = make_token_prompts([3, 9, 17, 30, 12], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (4, 7, 10, 13, 16)]
    outputs = graphed_llm.generate(prompts, params, use_tqdm=False)
    assert {1, 2, 4, 6} <= set(replays)

    hf = AutoModelForCausalLM.from_pretrained(graphed_llm.llm_engine.config.model_config.model,
                                              dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outputs):
        tokens = out.outputs[0].token_ids
        ids = prompt["prompt_token_ids"] + tokens
        with torch.inference_mode():
            reference = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
        start = len(prompt["prompt_token_ids"]) - 1
        assert tokens == reference[start:-1].argmax(-1).tolist()
        logprobs = torch.tensor([entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, tokens)])
        torch.testing.assert_close(logprobs, reference[start:-1].gather(1, torch.tensor(tokens)[:, None])[:, 0],
                                   rtol=0, atol=1e-4)
    assert pool.num_free_blocks == pool.num_blocks


def _graphs(llm, capture) -> DecodeGraphs:
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    return DecodeGraphs(runner.model, runner.kv_caches, 6, 16, 8, scratch_block=runner.kv_caches[0].shape[2] - 1,
                        device=torch.device("cpu"), capture=capture)


def test_a_capture_that_fails_or_disagrees_leaves_its_bucket_to_eager_steps(graphed_llm):
    def failing_at_4(forward):
        if forward().shape[0] == 4:
            raise RuntimeError("operation not permitted when stream is capturing")
        return forward

    graphs = _graphs(graphed_llm, failing_at_4)
    assert graphs.captured == [1, 2, 6]
    assert graphs.bucket(3) == 6 and graphs.bucket(1) == 1 and graphs.bucket(7) is None

    def frozen(forward):  # a "graph" that replays the output of the inputs it was captured with
        output = forward().clone()
        return lambda: output

    assert _graphs(graphed_llm, frozen).captured == []
