"""The mixture-of-experts MLP against transformers' own Qwen3-MoE sparse block on the same weights (loaded from the
checkpoint's per-expert tensors), and its routing against the formula written out."""
from __future__ import annotations

import pytest
import torch

from pagellm.model_executor.layers.moe import MixtureOfExperts, route

HIDDEN, INTERMEDIATE, EXPERTS = 64, 32, 8


def hf_sparse_block(top_k: int, norm_topk_prob: bool, seed: int = 0):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
                            num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob)
    block = Qwen3MoeSparseMoeBlock(config).eval()
    for parameter in block.parameters():
        torch.nn.init.normal_(parameter, std=0.2)
    return block


def checkpoint_tensors(block) -> dict[str, torch.Tensor]:
    """The block's weights under a checkpoint's per-expert names (what save_pretrained writes)."""
    state = block.state_dict()
    tensors = {"gate.weight": state["gate.weight"]}
    for expert in range(EXPERTS):
        gate, up = state["experts.gate_up_proj"][expert].chunk(2, dim=0)
        tensors[f"experts.{expert}.gate_proj.weight"] = gate
        tensors[f"experts.{expert}.up_proj.weight"] = up
        tensors[f"experts.{expert}.down_proj.weight"] = state["experts.down_proj"][expert]
    return tensors


def load(moe: MixtureOfExperts, tensors: dict[str, torch.Tensor]) -> None:
    moe.gate.load_weight(tensors["gate.weight"], "none")
    for index, expert in enumerate(moe.experts):
        expert.gate_up_proj.load_shard(tensors[f"experts.{index}.gate_proj.weight"], 0, "none")
        expert.gate_up_proj.load_shard(tensors[f"experts.{index}.up_proj.weight"], 1, "none")
        expert.down_proj.load_weight(tensors[f"experts.{index}.down_proj.weight"], "none")


@pytest.mark.parametrize("top_k, renormalize", [(2, True), (2, False), (1, True), (8, False)])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_matches_transformers_sparse_block(top_k, renormalize, num_tokens):
    block = hf_sparse_block(top_k, renormalize)
    # The checkpoint layout is gate rows then up rows per expert; transformers' fused tensor must agree with it.
    assert block.experts.gate_up_proj.shape == (EXPERTS, 2 * INTERMEDIATE, HIDDEN)
    moe = MixtureOfExperts(HIDDEN, INTERMEDIATE, EXPERTS, top_k, renormalize)
    load(moe, checkpoint_tensors(block))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(num_tokens))
    with torch.inference_mode():
        expected = block(x.unsqueeze(0))
        expected = (expected[0] if isinstance(expected, tuple) else expected).squeeze(0)
        torch.testing.assert_close(moe(x), expected, rtol=1e-5, atol=1e-5)


def test_route_is_the_softmax_top_k():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0], [3.0, 0.5, 0.0, -1.0]])
    weights, experts = route(logits, 2, renormalize=False)
    probs = logits.exp() / logits.exp().sum(dim=-1, keepdim=True)
    assert experts.tolist() == [[3, 2], [0, 1]]
    torch.testing.assert_close(weights, probs.gather(1, experts))
    renormalized, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(renormalized, weights / weights.sum(dim=-1, keepdim=True))


def test_experts_nobody_chose_are_not_run(monkeypatch):
    moe = MixtureOfExperts(HIDDEN, INTERMEDIATE, EXPERTS, 2, True)
    load(moe, checkpoint_tensors(hf_sparse_block(2, True)))
    calls: list[int] = []
    for index, expert in enumerate(moe.experts):
        original = expert.partial
        monkeypatch.setattr(expert, "partial", lambda x, i=index, f=original: (calls.append((i, x.shape[0])), f(x))[1])
    x = torch.randn(3, HIDDEN)
    with torch.inference_mode():
        _, chosen = route(moe.gate(x), 2, True)
        moe(x)
    assert sorted(i for i, _ in calls) == sorted(set(chosen.flatten().tolist()))  # each chosen expert once
    assert sum(rows for _, rows in calls) == 3 * 2  # every (token, expert) pair exactly once


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MixtureOfExperts(HIDDEN, INTERMEDIATE, 4, 5, True)
