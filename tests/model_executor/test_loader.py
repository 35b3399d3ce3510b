"""Checkpoint loading from safetensors: sharded checkpoints (index json + several files) load to the same model
as the single-file copy and as transformers, `read_safetensors` returns exactly what `safetensors` itself reads,
and missing weight files give a clear FileNotFoundError."""
from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from pagellm import LLM, SamplingParams
from pagellm.model_executor.model_loader.loader import read_safetensors, safetensors_files

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
PROMPT_LENS = [1, 6, 23, 70]
NEW_TOKENS = 12


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    # Many tiny forward passes: on the shared 2-core machine, competing OpenMP threads are far slower than one.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def assert_same_tensors(ours: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(reference)
    for name, expected in reference.items():
        got = ours[name]
        assert got.dtype == expected.dtype, name
        assert got.shape == expected.shape, name
        # Bitwise comparison (NaN-safe, distinguishes -0.0) through a same-size integer view.
        if expected.dtype.is_floating_point and expected.numel():
            as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[expected.element_size()]
            assert torch.equal(got.contiguous().view(as_int), expected.contiguous().view(as_int)), name
        else:
            assert torch.equal(got, expected), name


# --------------------------------------------------------------------------------------------- sharding


def copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="module", params=["llama", "qwen3"])  # untied and tied embeddings
def checkpoints(request, tiny_model_factory, tmp_path_factory):
    """(kind, unsharded dir, sharded dir, transformers model)."""
    from transformers import AutoModelForCausalLM

    kind = request.param
    single = tiny_model_factory(kind)
    hf = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32).eval()
    sharded = tmp_path_factory.mktemp(f"sharded-{kind}")
    hf.save_pretrained(sharded, max_shard_size="200KB")
    copy_tokenizer(single, sharded)
    return kind, single, sharded, hf


def test_sharded_checkpoint_layout(checkpoints):
    _, single, sharded, _ = checkpoints
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3, shards
    assert all((sharded / s).is_file() for s in shards)
    assert safetensors_files(sharded) == [sharded / s for s in shards]
    # The shards hold exactly the single file's tensors.
    merged = {}
    for path in safetensors_files(sharded):
        merged.update(dict(read_safetensors(path)))
    assert_same_tensors(merged, load_file(single / "model.safetensors"))


def test_sharded_checkpoint_generates_like_unsharded_and_hf(checkpoints, tiny_model_factory):
    import random

    kind, single, sharded, hf = checkpoints
    rng = random.Random(7)
    prompts = [[rng.randrange(20, 49152) for _ in range(n)] for n in PROMPT_LENS]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)

    def pagellm_tokens(model_dir: Path) -> list[list[int]]:
        llm = LLM(model=str(model_dir), max_model_len=128, kv_cache_memory_bytes=4 << 20)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    from_sharded = pagellm_tokens(sharded)
    assert from_sharded == pagellm_tokens(single)

    from transformers import GenerationConfig

    hf.generation_config = GenerationConfig()  # no EOS: like ignore_eos=True
    for prompt, ours in zip(prompts, from_sharded):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                              pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == ref, f"{kind}: prompt of {len(prompt)} tokens"


# ------------------------------------------------------------------------------------ missing weight files


def test_no_safetensors_in_dir(tiny_model_factory, tmp_path):
    src = tiny_model_factory("llama")
    shutil.copy(src / "config.json", tmp_path / "config.json")
    copy_tokenizer(src, tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        safetensors_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(tmp_path), max_model_len=64, kv_cache_memory_bytes=1 << 20)


def test_missing_shard_named_by_index(checkpoints, tmp_path):
    _, _, sharded, _ = checkpoints
    broken = tmp_path / "broken"
    shutil.copytree(sharded, broken)
    shards = sorted(set(json.loads((broken / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (broken / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=shards[1]):
        LLM(model=str(broken), max_model_len=64, kv_cache_memory_bytes=1 << 20)


# ---------------------------------------------------------------------------------------- read_safetensors


def test_read_safetensors_matches_safetensors_all_dtypes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 5, generator=g),
        "f32.special": torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, 3.4e38]),
        "bf16": torch.randn(3, 4, 5, generator=g).to(torch.bfloat16),
        "f16": torch.randn(9, generator=g).to(torch.float16),
        "f64": torch.randn(2, 3, generator=g, dtype=torch.float64),
        "i64": torch.randint(-2**62, 2**62, (4,), generator=g, dtype=torch.int64),
        "i32": torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int32),
        "i16": torch.randint(-2**15, 2**15 - 1, (5,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-128, 127, (11,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (13,), generator=g, dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 8, generator=g),
    }
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "note": "test"})
    ours = dict(read_safetensors(path))
    assert "__metadata__" not in ours
    assert_same_tensors(ours, load_file(str(path)))
    assert_same_tensors(ours, tensors)


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(_DTYPES), st.lists(st.integers(0, 5), max_size=3)), min_size=1,
                max_size=6),
       st.integers(0, 2**32 - 1))
def test_read_safetensors_roundtrip_property(specs, seed):
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, (dtype, shape) in enumerate(specs):
        raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty((), dtype=dtype).element_size(),),
                            generator=g, dtype=torch.uint8)
        tensor = raw.view(dtype).reshape(shape) if raw.numel() else torch.empty(shape, dtype=dtype)
        if dtype == torch.bool:
            tensor = tensor.view(torch.uint8).bitwise_and(1).bool()  # only 0/1 bytes are valid bools
        tensors[f"t{i}.{dtype}".replace("torch.", "")] = tensor
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.safetensors"
        save_file(tensors, str(path))
        assert_same_tensors(dict(read_safetensors(path)), load_file(str(path)))


def _write_raw_safetensors(path: Path, tensors: dict[str, torch.Tensor], pad_header: bool) -> None:
    """A minimal, spec-conforming writer: tensors in the given order, header optionally not padded to 8 bytes."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.contiguous().view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
        dtype = {torch.float32: "F32", torch.uint8: "U8", torch.float16: "F16", torch.int64: "I64"}[tensor.dtype]
        header[name] = {"dtype": dtype, "shape": list(tensor.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    encoded = json.dumps(header).encode()
    if pad_header:
        encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + b"".join(blobs))


@pytest.mark.parametrize("pad_header", [True, False], ids=["header-padded", "header-unpadded"])
def test_read_safetensors_header_not_padded_to_8_bytes(tmp_path, pad_header):
    """The safetensors format does not require an 8-byte-aligned header (the `safetensors` package pads its own
    files, but reads unpadded ones); a reader must not depend on the alignment of the data section."""
    tensors = {"w": torch.tensor([1.5, -2.0, 3.25]), "h": torch.tensor([1.0, 2.0], dtype=torch.float16)}
    path = tmp_path / "raw.safetensors"
    _write_raw_safetensors(path, tensors, pad_header)
    reference = load_file(str(path))
    assert_same_tensors(reference, tensors)
    assert_same_tensors(dict(read_safetensors(path)), reference)


def test_read_safetensors_unaligned_tensor_offsets(tmp_path):
    """Also valid: a 3-byte uint8 tensor first, so the float32 tensor after it starts at an odd offset."""
    tensors = {"a": torch.tensor([1, 2, 3], dtype=torch.uint8), "b": torch.tensor([1.5, -2.0])}
    path = tmp_path / "odd.safetensors"
    _write_raw_safetensors(path, tensors, pad_header=True)
    reference = load_file(str(path))
    assert_same_tensors(reference, tensors)
    assert_same_tensors(dict(read_safetensors(path)), reference)


@pytest.mark.parametrize("tensor", [
    torch.tensor([1, 2, 65535], dtype=torch.uint16),
    torch.tensor([1, 2**32 - 1], dtype=torch.uint32),
    torch.tensor([0.5, -1.0]).to(torch.float8_e4m3fn),
    torch.tensor([0.5, -1.0]).to(torch.float8_e5m2),
], ids=["u16", "u32", "f8_e4m3", "f8_e5m2"])
def test_read_safetensors_other_dtypes(tmp_path, tensor):
    path = tmp_path / "other.safetensors"
    save_file({"x": tensor}, str(path))
    assert_same_tensors(dict(read_safetensors(path)), load_file(str(path)))
