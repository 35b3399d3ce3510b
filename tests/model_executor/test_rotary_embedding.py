"""RoPE tables: built on the device the model is built on, whatever the RoPE type, and equal to transformers'."""
import pytest
import torch
from transformers import AutoConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from pagellm.model_executor.layers.rotary_embedding import RotaryEmbedding


@pytest.mark.parametrize("kind", ["llama", "llama3"])
def test_tables_follow_the_device_the_model_is_built_on(tiny_model_factory, kind):
    """The loader builds the model under `torch.device(device)`; transformers' scaled-RoPE initialisers return CPU
    tensors, which once met a position range made on that device (a CUDA/CPU mix). The meta device stands in for
    CUDA here: it fails the same way on a mix."""
    config = AutoConfig.from_pretrained(tiny_model_factory(kind))
    with torch.device("meta"):
        rope = RotaryEmbedding(config, config.hidden_size // config.num_attention_heads, 1024)
    assert rope.cos_cache.device.type == rope.sin_cache.device.type == "meta"
    assert rope.cos_cache.shape == (1024, config.hidden_size // config.num_attention_heads)


@pytest.mark.parametrize("kind", ["llama", "llama3"])
def test_tables_equal_transformers(tiny_model_factory, kind):
    config = AutoConfig.from_pretrained(tiny_model_factory(kind))
    head_dim = config.hidden_size // config.num_attention_heads
    rope = RotaryEmbedding(config, head_dim, 1024)
    positions = torch.arange(1024)
    x = torch.zeros(1, 1024, head_dim)
    cos, sin = LlamaRotaryEmbedding(config)(x, positions[None])
    torch.testing.assert_close(rope.cos_cache, cos[0], rtol=0, atol=1e-6)
    half = head_dim // 2  # pagellm's sine carries rotate-half's sign in its first half
    torch.testing.assert_close(rope.sin_cache[:, half:], sin[0, :, half:], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[:, :half], -sin[0, :, :half], rtol=0, atol=1e-6)
