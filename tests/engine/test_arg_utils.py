"""`--quantization` (and `--quantize-activations`) resolution in EngineArgs: the default per model kind and device,
and clear errors; `--kv-cache-dtype`."""
from __future__ import annotations

import pytest
import torch

from pagellm.engine.arg_utils import EngineArgs


def resolved(**kwargs):
    return EngineArgs(**kwargs).create_engine_config().model_config


def test_gguf_model_defaults_to_packed_weights(smollm2_dir):
    config = resolved(model=str(smollm2_dir))
    assert config.quantization == "gguf" and config.gguf_file.endswith(".gguf")
    # Packed kernels compute in float32 on the CPU: another dtype means float weights.
    assert resolved(model=str(smollm2_dir), dtype="bfloat16").quantization == "none"
    assert resolved(model=None, quantization="none").quantization == "none"


def test_float_checkpoint_defaults_to_none_and_may_ask_for_int8(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    assert resolved(model=model).quantization == "none"
    assert resolved(model=model).gguf_file is None
    assert resolved(model=model, quantization="int8").quantization == "int8"
    assert resolved(model=model, quantization="int8", quantize_activations=True).quantize_activations


@pytest.mark.parametrize("kwargs, message", [
    (dict(quantization="gguf"), "needs a .gguf model file"),
    (dict(quantization="fp8"), "quantization must be one of gguf, int8, none"),
    (dict(quantization="int8", dtype="bfloat16"), "runs on the CPU in float32 only"),
    (dict(quantize_activations=True), "--quantize-activations works on packed weights"),
])
def test_bad_quantization_is_a_clear_error(tiny_model_factory, kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolved(model=str(tiny_model_factory("llama")), **kwargs)


def test_kv_cache_dtype_resolves_against_the_model_dtype(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    auto = EngineArgs(model=model).create_engine_config()
    assert auto.cache_config.kv_dtype(auto.model_config.dtype) == torch.float32
    half = EngineArgs(model=model, kv_cache_dtype="float16").create_engine_config()
    assert half.cache_config.kv_dtype(half.model_config.dtype) == torch.float16
    bf16 = EngineArgs(model=model, dtype="bfloat16").create_engine_config()
    assert bf16.cache_config.kv_dtype(bf16.model_config.dtype) == torch.bfloat16
    fp8 = EngineArgs(model=model, kv_cache_dtype="fp8").create_engine_config()  # vLLM's name for e4m3
    assert fp8.cache_config.kv_dtype(fp8.model_config.dtype) == torch.float8_e4m3fn
    e5m2 = EngineArgs(model=model, kv_cache_dtype="fp8_e5m2").create_engine_config()
    assert e5m2.cache_config.kv_dtype(e5m2.model_config.dtype) == torch.float8_e5m2
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16, fp8, "
                                         "fp8_e4m3, fp8_e5m2, got 'int4'; fix --kv-cache-dtype"):
        EngineArgs(model=model, kv_cache_dtype="int4").create_engine_config()


@pytest.mark.parametrize("capability, expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                  ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_dtype_on_cuda_is_float16_where_the_gpu_has_no_bfloat16(monkeypatch, capability, expected):
    """vLLM's choice: V100 and T4 (compute capability 7.x) get float16, Ampere and newer bfloat16; the CPU float32.
    Explicit dtypes are kept."""
    from pagellm.config import resolve_dtype

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", torch.device("cuda")) == expected
    assert resolve_dtype("bfloat16", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32


def test_max_num_seqs_auto_needs_a_latency_target(tiny_model_factory):
    model = str(tiny_model_factory("llama"))
    with pytest.raises(ValueError, match="--target-tpot-ms"):
        EngineArgs(model=model, max_num_seqs="auto").create_engine_config()
    scheduler = EngineArgs(model=model, max_num_seqs="auto", target_tpot_ms=50).create_engine_config().scheduler_config
    assert (scheduler.max_num_seqs, scheduler.target_tpot_ms) == (256, 50)
    with pytest.raises(ValueError, match="target_tpot_ms must be positive"):
        EngineArgs(model=model, target_tpot_ms=0).create_engine_config()
