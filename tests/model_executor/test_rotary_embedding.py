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


def test_partial_rotary_equals_phi3():
    """Phi-4-mini rotates the first 3/4 of each head and passes the rest through."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    config = Phi3Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, partial_rotary_factor=0.75,
                        max_position_embeddings=256)
    head_dim = 64
    rope = RotaryEmbedding(config, head_dim, 256)
    assert rope.rotary_dim == 48 and rope.cos_cache.shape == (256, 48)
    positions = torch.randint(0, 256, (7,))
    q, k = torch.randn(7, 2, head_dim), torch.randn(7, 1, head_dim)
    ours_q, ours_k = rope(rope.tables(positions, q), q.clone(), k.clone())
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(ours_q, want_q[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_k, want_k[0].transpose(0, 1), rtol=0, atol=1e-5)
    torch.testing.assert_close(ours_q[..., 48:], q[..., 48:], rtol=0, atol=0)


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_each_layer_type_has_its_own_parameters_as_in_gemma3(layer_type):
    """Gemma 3: sliding-window layers rotate with base 10,000, full-attention layers with 1,000,000 (and the
    config's scaling)."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = Gemma3TextConfig(hidden_size=64, head_dim=32, num_attention_heads=2, num_key_value_heads=1,
                              num_hidden_layers=6, max_position_embeddings=512,
                              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                                               "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                  "rope_theta": 1_000_000.0}})
    rope = RotaryEmbedding(config, 32, 512, layer_type=layer_type)
    positions = torch.arange(512)
    cos, sin = Gemma3RotaryEmbedding(config)(torch.zeros(1, 512, 32), positions[None], layer_type)
    torch.testing.assert_close(rope.cos_cache, cos[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin_cache[:, 16:], sin[0, :, 16:], rtol=0, atol=1e-6)
