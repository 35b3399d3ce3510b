"""SmolLM3: which layers go without RoPE and which slide (transformers' rule), logits equal to transformers' float32
model on the same random weights through a paged prefill and decodes, and the one-call CPU decode step declined
for a model with NoPE layers. The whole engine: tests/entrypoints/test_llm_smollm3.py."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from pagellm.kernels.decoder import FusedDecoder
from pagellm.model_executor.layers.attention import AttentionMetadata, PrefillChunk
from pagellm.model_executor.model_loader.loader import iterate_weights
from pagellm.model_executor.models.registry import get_model_class, resolve_architecture
from pagellm.model_executor.models.smollm3 import SmolLM3ForCausalLM

BLOCK_SIZE = 4
TOKENS = [101, 2042, 77, 9001, 35, 46000, 12, 5, 300, 31000, 20, 21, 22, 23, 24, 25, 4000, 17, 17, 900, 48000, 3]
PREFILL = 18  # then one decode per remaining token
NUM_BLOCKS = 1 + (len(TOKENS) + BLOCK_SIZE - 1) // BLOCK_SIZE  # block 0 unused


@pytest.mark.parametrize("fields", [
    dict(num_hidden_layers=8),  # the default interval: layers 3 and 7 without RoPE
    dict(num_hidden_layers=6, no_rope_layer_interval=3, use_sliding_window=True, sliding_window=8),
    dict(num_hidden_layers=4, no_rope_layers=[0, 1, 1, 0]),
])
def test_nope_and_sliding_layers_follow_transformers(fields):
    from transformers import SmolLM3Config
    from transformers.models.smollm3.modeling_smollm3 import SmolLM3Model

    config = SmolLM3Config(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
                           vocab_size=32, pad_token_id=None, bos_token_id=None, eos_token_id=None, **fields)
    hf = SmolLM3Model(config)
    model = SmolLM3ForCausalLM(config, max_position=64)
    for ours, theirs in zip(model.layers, hf.layers, strict=True):
        assert (ours.self_attn.rotary_emb is not None) == bool(theirs.self_attn.use_rope)
        assert ours.self_attn.attn.sliding_window == theirs.self_attn.sliding_window
    assert any(layer.self_attn.rotary_emb is None for layer in model.layers)


def _model(model_dir):
    config = AutoConfig.from_pretrained(model_dir)
    model = get_model_class(resolve_architecture(config))(config, max_position=64)
    model.load_weights(iterate_weights(str(model_dir)))
    return model.eval()


def _logits(model) -> torch.Tensor:
    """The logits after each token of TOKENS: a prefill of PREFILL tokens into a paged cache, then decodes."""
    attn = model.layers[0].self_attn
    caches = [torch.zeros(2, attn.num_kv_heads, NUM_BLOCKS, BLOCK_SIZE, attn.head_dim) for _ in model.layers]
    blocks = torch.arange(1, NUM_BLOCKS)
    slots = [int(blocks[p // BLOCK_SIZE]) * BLOCK_SIZE + p % BLOCK_SIZE for p in range(len(TOKENS))]
    rows = []
    with torch.inference_mode():
        meta = AttentionMetadata(torch.tensor(slots[:PREFILL]), 0, None, None, [PrefillChunk(0, PREFILL, 0, blocks)])
        hidden = model(torch.tensor(TOKENS[:PREFILL]), torch.arange(PREFILL), caches, meta)
        rows.append(model.compute_logits(hidden))
        for position in range(PREFILL, len(TOKENS)):
            meta = AttentionMetadata(torch.tensor([slots[position]]), 1, blocks[None], torch.tensor([position + 1]),
                                     [])
            hidden = model(torch.tensor([TOKENS[position]]), torch.tensor([position]), caches, meta)
            rows.append(model.compute_logits(hidden))
    return torch.cat(rows)


@pytest.mark.parametrize("overrides", [dict(), dict(use_sliding_window=True, sliding_window=6)],
                         ids=["nope", "nope-sliding"])
def test_logits_equal_transformers(overrides, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("smollm3", **overrides)
    model = _model(model_dir)
    assert isinstance(model, SmolLM3ForCausalLM)
    assert [layer.self_attn.rotary_emb is None for layer in model.layers] == [False, True, False, True]
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        want = hf(torch.tensor([TOKENS])).logits[0]
    got = _logits(model)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # The check can fail: rotating the NoPE layers too gives other logits.
    for layer in model.layers:
        layer.self_attn.rotary_emb = model.rotary_emb
    assert not torch.allclose(_logits(model), want, rtol=1e-2, atol=1e-2)


def test_fused_decode_step_skips_the_rotation_of_nope_layers(tiny_model_factory):
    """The one C call runs NoPE layers too, without their rotation (test_fused_decoder.py compares its tokens and
    logprobs with the module path)."""
    fused = _model(tiny_model_factory("smollm3")).fused_decoder()
    assert isinstance(fused, FusedDecoder)
    assert [w.cos_table is None for w in fused._weights] == [False, True, False, True]  # layers 1 and 3: NoPE
