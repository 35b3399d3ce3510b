"""Phi-3/Phi-4-mini (`phi3`: fused qkv and gate|up matrices, a partly rotated head, LongRoPE in two tensors of
factors) and Qwen3-MoE (`qwen3moe`: each projection of every expert stacked in one tensor) GGUF files, written from
tiny random Hugging Face models the way llama.cpp's convert_hf_to_gguf.py writes them (its own tensor-name map, from
the gguf package), convert to the original config and run packed through the whole engine: every greedy token and
top logprob within float32's rounding error of transformers' own loading of the same file, run in float64.

transformers' GGUF path does not read the rotated fraction of a Phi head, LongRoPE or Qwen3-MoE's expert size from
the file (it would build a different model), so the reference takes the original model's config; its weights are
transformers' own dequantization and renaming of the file's tensors."""
from __future__ import annotations

import json
import math
import pathlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file
from test_gguf_loader import add_tiny_tokenizer, encode, tiny_vocab
from test_k_quants import assert_greedy_within_float32_error

from pagellm import LLM
from pagellm.model_executor.model_loader.gguf_loader import convert_gguf_to_hf_dir

GGUF_ARCH = {"phi3": gguf.MODEL_ARCH.PHI3, "qwen3_moe": gguf.MODEL_ARCH.QWEN3MOE}
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "pagellm-cache"))


def tiny_model(tiny_config: dict, qtype: QT, seed: int = 0):
    """A float32 random model of `tiny_config` (one of conftest's TINY_CONFIGS) over the tiny GGUF vocabulary:
    matrices N(0, 0.05), norm weights 1 + N(0, 0.1) (so a norm loaded in the wrong place shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(tiny_config, vocab_size=len(tiny_vocab()), bos_token_id=1, eos_token_id=2, pad_token_id=0,
                  max_position_embeddings=1024, rms_norm_eps=1e-6)
    moe = fields["model_type"] == "qwen3_moe"
    if moe:
        fields["mlp_only_layers"] = []  # llama.cpp's qwen3moe has experts on every layer
    if qtype in K_QUANTS:  # rows of 256 weights: every matrix's input dimension 256, attention's too (4 heads of 64)
        fields.update(hidden_size=256, intermediate_size=256, **(dict(moe_intermediate_size=256, head_dim=64) if moe
                                                                 else {}))
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(1 + 0.1 * torch.randn_like(param) if param.dim() == 1 else 0.05 * torch.randn_like(param))
    return model


def write_gguf(path: pathlib.Path, model, qtype: QT, seed: int = 0) -> dict[str, np.ndarray]:
    """Write `model` as convert_hf_to_gguf.py does (Phi3MiniModel, Qwen3MoeModel): its metadata keys, its tensor
    names, experts stacked per projection [experts, rows, columns], norms, the router and rope factors in F32, the
    other matrices in `qtype` (K-quants and IQ4 as random blocks: see test_gguf_loader.encode). Returns the float
    tensors written, under their GGUF names."""
    config, rng = model.config, np.random.default_rng(seed)
    arch = GGUF_ARCH[config.model_type]
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    hidden, heads, rope = config.hidden_size, config.num_attention_heads, config.rope_parameters
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(config.num_key_value_heads)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    tensors: dict[str, np.ndarray] = {}
    if arch == gguf.MODEL_ARCH.PHI3:
        original = config.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_sliding_window(config.sliding_window or 0)
        if rope["rope_type"] == "longrope":
            scale = config.max_position_embeddings / original
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            tensors["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
            tensors["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    else:
        w.add_key_length(config.head_dim)
        w.add_value_length(config.head_dim)
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
    add_tiny_tokenizer(w)

    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for hf_name, value in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, _, kind = hf_name.rpartition(".")
        if kind in ("weight", "bias"):
            tensors[f"{names.get_name(stem)}.{kind}"] = value.numpy()
        elif kind == "gate_up_proj":  # transformers' fused experts [experts, gate rows | up rows, hidden]
            gate, up = value.numpy().reshape(value.shape[0], 2, -1, value.shape[-1]).transpose(1, 0, 2, 3)
            tensors[f"{names.get_name(f'{stem}.gate_proj')}.weight"] = gate
            tensors[f"{names.get_name(f'{stem}.up_proj')}.weight"] = up
        else:  # experts' down_proj [experts, hidden, intermediate]
            tensors[f"{names.get_name(hf_name)}.weight"] = value.numpy()
    for name, value in tensors.items():
        value = np.ascontiguousarray(value)
        if value.ndim == 1 or "ffn_gate_inp" in name or qtype == QT.F32:
            w.add_tensor(name, value)
        else:
            w.add_tensor(name, encode(value, qtype, rng), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def reference(path: pathlib.Path, config, dtype: torch.dtype = torch.float64):
    from transformers import AutoModelForCausalLM

    # the experts one by one: the default grouped matmul has no float64
    experts = {"experts_implementation": "eager"} if config.model_type == "qwen3_moe" else {}
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, config=config, dtype=dtype,
                                                **experts).eval()


@pytest.mark.parametrize("kind", ["phi3", "phi3-longrope", "qwen3_moe"])
def test_conversion_recovers_the_config_and_every_tensor(tmp_path, kind, tiny_configs):
    """The converted config is the original model's where it matters (partial rotary, LongRoPE factors and
    attention factor, experts, their size and renormalized top-k), and the F32 file's tensors come back exactly,
    each expert's matrices under their own names."""
    from transformers import AutoConfig

    path = tmp_path / f"tiny-{kind}.gguf"
    model = tiny_model(tiny_configs[kind], QT.F32)
    written = write_gguf(path, model, QT.F32)
    out_dir = convert_gguf_to_hf_dir(path)
    config, original = AutoConfig.from_pretrained(str(out_dir)), model.config
    assert json.loads((out_dir / "config.json").read_text())["architectures"] == original.architectures
    fields = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings", "tie_word_embeddings"]
    if kind == "qwen3_moe":
        fields += ["num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                   "decoder_sparse_step", "mlp_only_layers"]
    else:
        fields += ["original_max_position_embeddings"]  # the rotated fraction: in rope_parameters
    head_dim = original.hidden_size // original.num_attention_heads  # Phi3Config's, which has no head_dim field
    for field in fields:
        assert getattr(config, field) == getattr(original, field, head_dim), field
    assert config.rms_norm_eps == pytest.approx(original.rms_norm_eps, rel=1e-7)  # a float32 in the file
    ours, expected = config.rope_parameters, dict(original.rope_parameters)
    if kind == "phi3-longrope":
        # The file says the attention factor (llama.cpp's converter works it out), not the `factor` it comes from.
        factor = expected.pop("factor")
        assert ours.pop("attention_factor") == pytest.approx(math.sqrt(1 + math.log(factor) / math.log(256)))
        for name in ("long_factor", "short_factor"):  # float32 in the file, as transformers rotates with them
            assert ours.pop(name) == [float(np.float32(v)) for v in expected.pop(name)], name
    assert ours == pytest.approx(expected)

    state = load_file(str(out_dir / "model.safetensors"))
    reference_state = reference(path, original, torch.float32).state_dict()
    if kind == "qwen3_moe":  # transformers fuses the experts; pagellm's checkpoint names each one's matrices
        prefix = "model.layers.2.mlp.experts"
        gate_up = torch.stack([torch.cat([state[f"{prefix}.{j}.{p}_proj.weight"] for p in ("gate", "up")])
                               for j in range(8)])
        assert torch.equal(gate_up, reference_state[f"{prefix}.gate_up_proj"])
        assert torch.equal(state[f"{prefix}.5.down_proj.weight"],
                           torch.from_numpy(written["blk.2.ffn_down_exps.weight"][5]))
        assert len([n for n in state if ".experts." in n]) == 3 * 8 * 3
    else:
        assert torch.equal(state["model.layers.1.self_attn.qkv_proj.weight"],
                           reference_state["model.layers.1.self_attn.qkv_proj.weight"])
        assert torch.equal(state["model.layers.1.mlp.gate_up_proj.weight"],
                           reference_state["model.layers.1.mlp.gate_up_proj.weight"])
    for name, tensor in state.items():
        if name in reference_state:
            assert torch.equal(tensor, reference_state[name]), name


@pytest.mark.parametrize("kind, qtype", [("phi3", QT.F32), ("phi3", QT.Q8_0), ("phi3", QT.Q4_K),
                                         ("phi3-longrope", QT.Q8_0), ("qwen3_moe", QT.F32), ("qwen3_moe", QT.Q8_0),
                                         ("qwen3_moe", QT.Q4_K)], ids=lambda v: getattr(v, "name", v))
def test_file_runs_packed_and_matches_transformers(tmp_path, kind, qtype, tiny_configs):
    path = tmp_path / f"tiny-{kind}-{qtype.name}.gguf"
    model = tiny_model(tiny_configs[kind], qtype)
    written = write_gguf(path, model, qtype)
    reference_model = reference(path, model.config)
    llm = LLM(model=str(path), max_model_len=128, kv_cache_memory_bytes=4 << 20)
    assert llm.llm_engine.config.model_config.architecture == model.config.architectures[0]
    if qtype != QT.F32:
        weight_bytes = llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0]
        float_bytes = 4 * sum(w.size for n, w in written.items() if w.ndim >= 2)
        assert weight_bytes < float_bytes / 3  # packed, experts included

    assert_greedy_within_float32_error(llm, reference_model)
