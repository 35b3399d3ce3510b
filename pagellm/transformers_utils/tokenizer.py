"""Tokenizer and generation-config loading through transformers (real tokenizers and chat templates)."""
from __future__ import annotations

from pathlib import Path


def get_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"Could not load a tokenizer from {path}: {exc}. Pass tokenizer=<dir with "
                         f"tokenizer.json or tokenizer.model>.") from exc
    return tokenizer


def get_eos_token_ids(model_dir: str | Path, hf_config, tokenizer) -> frozenset[int]:
    """EOS ids from generation_config.json (which may list several), else the model config, else the tokenizer."""
    from transformers import GenerationConfig

    eos = None
    if (Path(model_dir) / "generation_config.json").is_file():
        eos = GenerationConfig.from_pretrained(str(model_dir)).eos_token_id
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return frozenset()
    return frozenset([eos] if isinstance(eos, int) else eos)
