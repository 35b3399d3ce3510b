"""GGUF -> Hugging Face checkpoint conversion.

Owns turning a GGUF file of a supported architecture (`GGUF_ARCHITECTURES`) into a cached HF-style directory
(config.json, model.safetensors, tokenizer files, generation_config.json, and gguf_source.json naming the file) that
the rest of pagellm loads like any other checkpoint: dequantization via the ``gguf`` package, llama.cpp's
tensor renaming, (for Llama) Q/K row permutation and (for MoE models) stacking of the experts' matrices undone, and
an atomic on-disk cache keyed by the file's identity. `gguf_config` turns the metadata into config.json;
`gguf_weights` reads the same tensors packed, for the CPU kernels.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import re
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import save_file

from pagellm import envs
from pagellm.model_executor.model_loader.gguf_architectures import (
    CONFIG_TENSORS,
    EXPERT,
    GGUF_ARCHITECTURES,
    GLOBAL_TENSORS,
    GGUFArchitecture,
)
from pagellm.model_executor.model_loader.gguf_config import build_config, gguf_metadata

# Bump whenever the output layout changes, so stale cache entries are never reused.
CONVERTER_VERSION = "8"


SUPPORTED_ARCHITECTURES = tuple(GGUF_ARCHITECTURES)
# Names the GGUF file a converted directory came from and where each tensor sits in it, so the weights can be read
# packed from the file itself without parsing its metadata again (several seconds for a 50k-token vocabulary).
GGUF_SOURCE_FILE = "gguf_source.json"

_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def convert_gguf_to_hf_dir(
    gguf_path: str | os.PathLike, cache_root: str | os.PathLike | None = None
) -> pathlib.Path:
    """Convert a GGUF file (of an architecture in GGUF_ARCHITECTURES) into a Hugging Face-style checkpoint directory
    (cached)."""
    path = pathlib.Path(gguf_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {str(path)!r}")
    path = path.resolve()
    out_dir = _cache_dir(path, cache_root)
    if out_dir.is_dir():
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = pathlib.Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp_dir, 0o755)  # mkdtemp's 0700 would make the published cache entry private
        _convert(path, tmp_dir)
        try:
            os.replace(tmp_dir, out_dir)
        except OSError:
            # Another process finished the same conversion first; its result is equivalent.
            if not out_dir.is_dir():
                raise
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return out_dir


def _cache_dir(path: pathlib.Path, cache_root: str | os.PathLike | None) -> pathlib.Path:
    root = pathlib.Path(cache_root).expanduser() if cache_root else envs.cache_root()
    st = path.stat()
    ident = f"{CONVERTER_VERSION}\0{path}\0{st.st_size}\0{st.st_mtime_ns}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:24]
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", path.stem)[:64]
    return root / "gguf" / f"{stem}-{digest}"


def _convert(path: pathlib.Path, out_dir: pathlib.Path) -> None:
    reader = gguf.GGUFReader(path)
    arch = gguf_metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"Unsupported GGUF architecture {arch!r} in {str(path)!r}; "
            f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = {t.name: t for t in reader.tensors}
    architecture = GGUF_ARCHITECTURES[arch]
    config = build_config(reader, arch, tensors)
    plans = {name: _plan(name, architecture, config) for name in tensors if name not in CONFIG_TENSORS}
    state_dict = _build_state_dict(tensors, plans)
    # Llama's attention_bias puts a bias on all four projections; Qwen2 has them on Q, K and V only (its class
    # knows), so the output projection's bias decides.
    config["attention_bias"] = any(".self_attn.o_proj." in n and n.endswith(".bias") for n in state_dict)
    config["mlp_bias"] = any(".mlp." in n and n.endswith(".bias") for n in state_dict)

    save_file(state_dict, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    del state_dict
    _write_json(out_dir / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in config}
    _write_json(out_dir / "generation_config.json", generation)
    _save_tokenizer(path, out_dir, gguf_metadata(reader, "tokenizer.chat_template"))
    index = [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape.tolist()],
              "offset": int(t.data_offset), "bytes": int(t.n_bytes), **plans[t.name]._asdict()}
             for t in reader.tensors if t.name in plans]
    st = path.stat()
    _write_json(out_dir / GGUF_SOURCE_FILE, {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                                             "tensors": index})


def gguf_source(model_dir: str | os.PathLike) -> pathlib.Path | None:
    """The GGUF file a converted checkpoint directory was made from, if it is still there unchanged."""
    source = _read_source(model_dir)
    return None if source is None else pathlib.Path(source["path"])


def gguf_tensor_index(model_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """Each weight of the source file: name, ggml type, shape (GGUF order), byte offset and length, and how it becomes
    the Hugging Face tensor (`TensorPlan`)."""
    source = _read_source(model_dir)
    if source is None:
        raise FileNotFoundError(f"{model_dir} was not converted from a GGUF file that is still there unchanged.")
    return source["tensors"]


def _read_source(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    marker = pathlib.Path(model_dir) / GGUF_SOURCE_FILE
    if not marker.is_file():
        return None
    source = json.loads(marker.read_text(encoding="utf-8"))
    path = pathlib.Path(source["path"])
    if not path.is_file() or (path.stat().st_size, path.stat().st_mtime_ns) != (source["size"], source["mtime_ns"]):
        return None
    return source


def dequantize_tensor(tensor: Any) -> torch.Tensor:
    """One GGUF tensor as a torch tensor in HF (row-major, reversed GGUF) shape."""
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float32))
    elif qtype == GGMLQuantizationType.F16:
        out = torch.from_numpy(np.array(tensor.data, dtype=np.float16))
    elif qtype == GGMLQuantizationType.BF16:
        out = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
    else:
        values = gguf.quants.dequantize(tensor.data, qtype)
        out = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    return out.reshape(shape)


def unpermute_rows(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of convert_hf_to_gguf's rotary permute: per head, interleaved (x0,y0,x1,y1..) -> halves."""
    rest = weight.shape[1:]
    return (weight.reshape(n_head, weight.shape[0] // n_head // 2, 2, *rest)
            .transpose(1, 2).reshape(weight.shape).contiguous())


class TensorPlan(NamedTuple):
    """How one GGUF tensor becomes a Hugging Face one (or, for stacked experts, one per expert)."""
    hf_name: str
    unpermute_heads: int  # heads whose rows llama.cpp permuted (see `unpermute_rows`); 0: none
    value_offset: float  # added to the values (undoes llama.cpp's +1 on Gemma's norms)
    experts: int  # the tensor stacks this many experts' matrices, named by `expert_names`; 0: a single tensor


def expert_names(hf_name: str, experts: int) -> list[str]:
    """The Hugging Face names of a planned tensor's parts (`TensorPlan.hf_name`, `.experts`): one per stacked expert
    (outermost dimension), in order, else its one name."""
    return [hf_name.replace(EXPERT, str(j)) for j in range(experts)] if experts else [hf_name]


def _plan(name: str, architecture: GGUFArchitecture, config: dict[str, Any]) -> TensorPlan:
    if m := _LAYER_RE.match(name):
        layer, stem, kind = m.groups()
        module = architecture.hf_layer_tensor(stem)
        hf_name = f"model.layers.{layer}.{module}.{kind}" if module else None
    elif (m := _GLOBAL_RE.match(name)) and m.group(1) in GLOBAL_TENSORS:
        hf_name = f"{GLOBAL_TENSORS[m.group(1)]}.{m.group(2)}"
    else:
        hf_name = None
    if hf_name is None:
        raise ValueError(f"Unexpected tensor {name!r} in a GGUF file of architecture {architecture.model_type!r}")
    heads = 0
    if architecture.rotary_permuted and ".attn_q." in name:
        heads = config["num_attention_heads"]
    elif architecture.rotary_permuted and ".attn_k." in name:
        heads = config["num_key_value_heads"]
    offset = -architecture.norm_offset if name.endswith("norm.weight") else 0.0
    return TensorPlan(hf_name, heads, offset, config["num_experts"] if EXPERT in hf_name else 0)


def _build_state_dict(tensors: dict[str, Any], plans: dict[str, TensorPlan]) -> dict[str, torch.Tensor]:
    state_dict: dict[str, torch.Tensor] = {}
    for name, plan in plans.items():
        weight = dequantize_tensor(tensors[name])
        if plan.unpermute_heads:
            weight = unpermute_rows(weight, plan.unpermute_heads)
        if plan.value_offset:
            weight = weight + plan.value_offset
        names = expert_names(plan.hf_name, plan.experts)
        if plan.experts and (weight.ndim != 3 or weight.shape[0] != plan.experts):
            raise ValueError(f"GGUF tensor {name!r} of shape {tuple(weight.shape)} does not stack "
                             f"{plan.experts} experts")
        # each expert's matrix its own tensor (safetensors refuses views that share storage)
        parts = [w.clone() for w in weight] if plan.experts else [weight]
        state_dict.update(zip(names, parts, strict=True))
    return state_dict


def _save_tokenizer(path: pathlib.Path, out_dir: pathlib.Path, chat_template: str | None) -> None:
    from transformers import AutoTokenizer

    with _architecture_known_to_transformers(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(out_dir))
    # transformers>=5 may put the template only in chat_template.jinja and skip special_tokens_map.json;
    # write both into the classic places so consumers reading the JSON files alone see them.
    config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    if chat_template is not None and tok_config.get("chat_template") != chat_template:
        tok_config["chat_template"] = chat_template
        _write_json(config_path, tok_config)
    if not (out_dir / "special_tokens_map.json").exists():
        _write_json(out_dir / "special_tokens_map.json", dict(tokenizer.special_tokens_map))


@contextlib.contextmanager
def _architecture_known_to_transformers(path: pathlib.Path) -> Iterator[None]:
    """transformers reads the tokenizer of a GGUF file only for the architectures whose weights it converts, although
    the tokenizer does not depend on them: for one it lacks (smollm3), list it while the tokenizer loads."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    architecture = str(gguf_metadata(gguf.GGUFReader(str(path)), "general.architecture"))
    supported = gguf_utils.GGUF_SUPPORTED_ARCHITECTURES
    added = architecture not in supported
    if added:
        supported.append(architecture)
    try:
        yield
    finally:
        if added:
            supported.remove(architecture)


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")
