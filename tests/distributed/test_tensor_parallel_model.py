"""Every model family (the Llama relatives, Phi-3, Qwen3-MoE, Gemma 3, SmolLM3) under tensor parallelism: two gloo
ranks each build the model from a tiny random checkpoint, keep their shard of every layer and run the same batches
through their own paged KV cache (sized by `ModelConfig.get_num_kv_heads`): prefills, decodes and a chunked prefill
that reads the cache. Every rank's logits must equal the one-process model's and, for float weights,
transformers'."""
from __future__ import annotations

import pytest
import torch
from rank_launcher import run_ranks

from pagellm.config import ModelConfig
from pagellm.distributed import get_tp_group
from pagellm.model_executor.layers.attention import AttentionMetadata, PrefillChunk
from pagellm.model_executor.layers.quantization import quantize_q8_0
from pagellm.model_executor.model_loader.loader import iterate_weights
from pagellm.model_executor.models.registry import get_model_class, resolve_architecture

TP = 2
BLOCK_SIZE = 4
SEQUENCES = [[101, 2042, 77, 9001, 35, 46000, 12], [5, 6, 7, 8, 300, 31000, 20, 21, 22, 23, 24, 25],
             [4000, 17, 17, 17, 900, 48000, 3, 44, 1000]]
# Each step: (sequence, first token, end) in batch order, decodes (one token) first as the model runner orders them.
STEPS = [[(0, 0, 5), (1, 0, 6), (2, 0, 4)],
         [(0, 5, 6), (1, 6, 7), (2, 4, 9)],  # sequence 2's second chunk attends to its cached first chunk
         [(0, 6, 7), (1, 7, 8)],
         [(1, 8, 12)]]
MAX_BLOCKS = 3  # blocks per sequence (12 tokens at most); block 0 pads the decode block tables


def _blocks(seq: int) -> list[int]:
    return [1 + seq * MAX_BLOCKS + i for i in range(MAX_BLOCKS)]


def _step_inputs(step: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    ids, positions, slots, chunks, decodes = [], [], [], [], []
    for seq, start, end in step:
        if end - start == 1:
            decodes.append((seq, start))
        else:
            chunks.append(PrefillChunk(len(ids), end - start, start, torch.tensor(_blocks(seq))))
        ids += SEQUENCES[seq][start:end]
        positions += range(start, end)
        slots += [_blocks(seq)[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
    tables = seq_lens = None
    if decodes:
        tables = torch.tensor([_blocks(seq) for seq, _ in decodes])
        seq_lens = torch.tensor([position + 1 for _, position in decodes])
    meta = AttentionMetadata(torch.tensor(slots), len(decodes), tables, seq_lens, chunks)
    return torch.tensor(ids), torch.tensor(positions), meta


def _logits(model_dir: str, storage: str) -> list[torch.Tensor]:
    """Per sequence, the logits after each of its tokens, from a model built in this process's TP group."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    model_config = ModelConfig(model=model_dir, tokenizer=model_dir, hf_config=hf_config,
                               architecture=resolve_architecture(hf_config), dtype=torch.float32, max_model_len=64,
                               max_logprobs=0)
    model = get_model_class(model_config.architecture)(hf_config, max_position=model_config.max_model_len)
    weights = iterate_weights(model_dir)
    if storage == "gguf-q8_0":  # every matrix handed over packed, as the GGUF loader does
        weights = ((name, quantize_q8_0(w) if w.dim() == 2 else w) for name, w in weights)
    model.load_weights(weights, "gguf" if storage == "gguf-q8_0" else storage)
    model.eval()
    tp_size = get_tp_group().world_size
    kv_heads = model_config.get_num_kv_heads(tp_size)
    assert model.layers[0].self_attn.num_kv_heads == kv_heads
    assert tp_size == 1 or model.fused_decoder() is None  # its one C call cannot sum over the ranks
    caches = [torch.zeros(2, kv_heads, 1 + len(SEQUENCES) * MAX_BLOCKS, BLOCK_SIZE, model_config.head_dim)
              for _ in range(model_config.num_layers)]
    logits = [torch.empty(len(seq), model_config.vocab_size) for seq in SEQUENCES]
    with torch.inference_mode():
        for step in STEPS:
            ids, positions, meta = _step_inputs(step)
            step_logits = model.compute_logits(model(ids, positions, caches, meta))
            row = 0
            for seq, start, end in step:
                logits[seq][start:end] = step_logits[row:row + end - start]
                row += end - start
    return logits


def _all_logits(variants: dict[str, tuple[str, str]]) -> dict[str, list[torch.Tensor] | str]:
    """`_logits` for each variant (model dir, storage); a variant that fails reports its error alone."""
    results = {}
    for name, (model_dir, storage) in variants.items():
        try:
            results[name] = _logits(model_dir, storage)
        except Exception as exc:  # noqa: BLE001 - reported by that variant's test
            results[name] = f"{type(exc).__name__}: {exc}"
    return results


def _transformers_logits(model_dir: str) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        return [model(torch.tensor([seq])).logits[0] for seq in SEQUENCES]


VARIANTS = {  # name: (tiny model kind, weight storage, config overrides)
    "llama": ("llama", "none", {}),  # 4 query heads, 2 KV heads: one KV head per rank
    "llama3-replicated-kv": ("llama3", "none", {}),  # 1 KV head on both ranks; tied embeddings
    "qwen2-qkv-bias": ("qwen2", "none", {}),
    "qwen3-qk-norm": ("qwen3", "none", {}),
    "llama-biases-odd-vocab": ("llama", "none", dict(attention_bias=True, mlp_bias=True, vocab_size=49151)),
    "llama-int8": ("llama", "int8", {}),  # each rank quantizes its float shard
    "llama3-gguf-q8_0": ("llama3", "gguf-q8_0", {}),  # packed rows and whole blocks of columns sliced
    "phi3-partial-rotary": ("phi3", "none", {}),  # fused qkv/gate_up checkpoint matrices split per rank
    "qwen3-moe": ("qwen3_moe", "none", {}),  # every expert's intermediate slice per rank
    "gemma3": ("gemma3", "none", {}),  # per-layer-type RoPE, four (1 + w) norms a layer, Q/K norms, tied head
    "smollm3-nope": ("smollm3", "none", {}),  # layers 1 and 3 without RoPE
}


@pytest.fixture(scope="module")
def model_dirs(tiny_model_factory) -> dict[str, str]:
    return {name: str(tiny_model_factory(kind, **overrides)) for name, (kind, _, overrides) in VARIANTS.items()}


@pytest.fixture(scope="module")
def rank_logits(model_dirs, tmp_path_factory) -> list[dict]:
    """Both ranks' logits for every variant, from one pair of processes (spawning costs more than the models)."""
    variants = {name: (model_dirs[name], storage) for name, (_, storage, _) in VARIANTS.items()}
    return run_ranks(_all_logits, tmp_path_factory.mktemp("tp-model"), TP, args=(variants,))


@pytest.mark.parametrize("variant", VARIANTS)
def test_tensor_parallel_logits_equal_one_process(variant, rank_logits, model_dirs):
    model_dir, storage = model_dirs[variant], VARIANTS[variant][1]
    ranks = [results[variant] for results in rank_logits]
    for result in ranks:
        assert not isinstance(result, str), result
    single = _logits(model_dir, storage)
    reference = _transformers_logits(model_dir) if storage == "none" else single
    for rank_result in ranks:
        for got, one_process, want in zip(rank_result, single, reference):
            torch.testing.assert_close(got, one_process, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for got_0, got_1 in zip(*ranks):  # the ranks must sample the same tokens
        assert torch.equal(got_0, got_1)
