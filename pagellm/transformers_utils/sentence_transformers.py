"""What a sentence-transformers checkpoint says about its embeddings, read from its files as vLLM reads them: the
pooling mode of its Pooling module (`modules.json`, then that module's `config.json`), whether a Normalize module
follows it, and the longest input it embeds (`sentence_bert_config.json`'s `max_seq_length`).

The engine takes these as the model's defaults (engine/config_builder.py): `--pooling` / `--pooler-config` and
`--max-model-len` override them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# sentence-transformers' pooling modes (its legacy `pooling_mode_*` flags and its `pooling_mode` names) -> the
# PoolerConfig pooling_type computing the same vector; None: a mode the pooler does not compute.
_MODES = {"cls": "CLS", "mean": "MEAN", "lasttoken": "LAST", "max": None, "mean_sqrt_len_tokens": None,
          "weightedmean": None}
_LEGACY_FLAGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_lasttoken": "lasttoken", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class SentenceTransformersConfig:
    pooling_modes: tuple[str, ...] | None  # the Pooling module's modes (sentence-transformers' names); None: none
    pooling_config: Path | None  # the file they come from
    normalize: bool  # a Normalize module follows the pooling
    max_seq_length: int | None  # inputs longer than this are not embedded by the reference; None: not set

    @property
    def pooling_type(self) -> str | None:
        """PoolerConfig's name for the pooling mode (None without a Pooling module). Raises a ValueError for a mode
        the pooler does not compute (max, weighted mean, several at once)."""
        if self.pooling_modes is None:
            return None
        modes = self.pooling_modes
        if len(modes) != 1 or _MODES.get(modes[0]) is None:
            raise ValueError(f"{self.pooling_config} pools by {' + '.join(modes) or 'no mode'}; pagellm pools by "
                             f"cls, mean or lasttoken. Pass --pooling cls, mean or last to embed with one of those.")
        return _MODES[modes[0]]


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"Cannot read the sentence-transformers config {path}: {exc}") from exc


def _pooling_modes(config: dict) -> tuple[str, ...]:
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for flag, mode in _LEGACY_FLAGS.items() if config.get(flag)]
    return (modes,) if isinstance(modes, str) else tuple(modes)


def read_sentence_transformers_config(model_dir: str | Path) -> SentenceTransformersConfig | None:
    """The checkpoint's sentence-transformers settings; None when `model_dir` has no modules.json."""
    model_dir = Path(model_dir)
    if not (model_dir / "modules.json").is_file():
        return None
    modules = _read_json(model_dir / "modules.json")
    modes, pooling_config = None, None
    for module in modules:
        if module.get("type", "").endswith(".Pooling"):
            pooling_config = model_dir / module.get("path", "") / "config.json"
            modes = _pooling_modes(_read_json(pooling_config))
    normalize = any(module.get("type", "").endswith(".Normalize") for module in modules)
    bert_config = model_dir / "sentence_bert_config.json"
    max_seq_length = _read_json(bert_config).get("max_seq_length") if bert_config.is_file() else None
    return SentenceTransformersConfig(modes, pooling_config, normalize, max_seq_length)
