"""A sentence-transformers checkpoint's own settings (transformers_utils/sentence_transformers.py) as the engine's
defaults: its Pooling module's mode in the legacy flags or the current `pooling_mode` key, a Normalize module, and
max_seq_length; --pooling and --pooler-config override them, and a mode the pooler cannot compute is refused with
the flag that gets past it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagellm.config import PoolerConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.transformers_utils.sentence_transformers import read_sentence_transformers_config


def write_modules(path: Path, pooling: dict | None, normalize: bool, max_seq_length: int | None = None) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (path / "1_Pooling").mkdir(exist_ok=True)
        (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    if max_seq_length is not None:
        (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_seq_length}))
    return path


def test_no_modules_json_means_no_config(tmp_path):
    assert read_sentence_transformers_config(tmp_path) is None


@pytest.mark.parametrize(("pooling", "expected"), [
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),
    ({"pooling_mode_mean_tokens": True}, "MEAN"),
    ({"pooling_mode_lasttoken": True}, "LAST"),
    ({"pooling_mode": "mean"}, "MEAN"),
    ({"pooling_mode": ["lasttoken"]}, "LAST"),
])
def test_pooling_modes(tmp_path, pooling, expected):
    config = read_sentence_transformers_config(write_modules(tmp_path, pooling, normalize=False))
    assert config.pooling_type == expected and config.normalize is False and config.max_seq_length is None


@pytest.mark.parametrize("pooling", [{"pooling_mode_max_tokens": True}, {"pooling_mode": ["mean", "max"]}, {}])
def test_modes_the_pooler_cannot_compute_are_refused(tmp_path, pooling):
    config = read_sentence_transformers_config(write_modules(tmp_path, pooling, normalize=True))
    with pytest.raises(ValueError, match="Pass --pooling cls, mean or last"):
        _ = config.pooling_type


def engine_config(model_dir: Path, **args):
    return EngineArgs(model=str(model_dir), **args).create_engine_config().model_config


def test_engine_defaults_and_overrides(tmp_path):
    from transformers import BertConfig

    BertConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
               max_position_embeddings=512, architectures=["BertModel"]).save_pretrained(tmp_path)
    write_modules(tmp_path, {"pooling_mode_max_tokens": True}, normalize=False, max_seq_length=128)
    # The unsupported mode is read only when nothing overrides it.
    with pytest.raises(ValueError, match="pools by max"):
        engine_config(tmp_path)
    config = engine_config(tmp_path, pooling="cls")
    assert config.pooler_config == PoolerConfig(pooling_type="CLS", normalize=False)
    assert config.max_model_len == 128  # max_seq_length, below max_position_embeddings
    assert engine_config(tmp_path, pooler_config={"pooling_type": "MEAN", "normalize": True}).pooler_config == (
        PoolerConfig(pooling_type="MEAN", normalize=True))
    with pytest.raises(ValueError, match="max_seq_length"):
        engine_config(tmp_path, pooling="cls", max_model_len=256)
    # --pooler-config's normalize alone keeps the model's pooling type.
    write_modules(tmp_path, {"pooling_mode": "mean"}, normalize=True)
    assert engine_config(tmp_path, pooler_config={"normalize": False}).pooler_config == PoolerConfig(
        pooling_type="MEAN", normalize=False)
