"""The draft model of speculative method `draft_model`, resolved into its own ModelConfig when the engine's config is
built (vLLM's `SpeculativeConfig.draft_model_config`), and the limits it runs under: one rank, the target's
vocabulary and context, full attention (its K/V lives in blocks addressed by the target's block tables, see
worker/draft_proposer.py)."""
from __future__ import annotations

import dataclasses

import torch

from pagellm.config import ModelConfig, ParallelConfig, SpeculativeConfig
from pagellm.model_executor.layers.attention import layer_sliding_window
from pagellm.model_executor.model_loader.gguf_loader import gguf_source
from pagellm.model_executor.model_loader.resolve import resolve_model_dir
from pagellm.model_executor.models.registry import is_encoder_only, resolve_architecture


def resolve_draft_model(spec: SpeculativeConfig | None, target: ModelConfig, parallel: ParallelConfig,
                        on_cpu: bool) -> SpeculativeConfig | None:
    """`spec` with its draft's ModelConfig (the target's dtype; a GGUF draft keeps its packed weights on the CPU in
    float32, as the target would); `spec` itself for other methods. Raises ValueError naming the setting that rules
    the draft out."""
    if spec is None or spec.method != "draft_model":
        return spec
    from transformers import AutoConfig

    if parallel.world_size > 1:
        raise ValueError("speculative_config method 'draft_model' runs on one rank: drop --tensor-parallel-size / "
                         "--pipeline-parallel-size, or use method 'ngram'.")
    if target.runner != "generate" or any(layer_sliding_window(target.hf_config, i) is not None
                                          for i in range(target.num_layers)):
        raise ValueError("speculative_config method 'draft_model' needs a generating target model whose layers all "
                         "attend fully (no sliding window); use method 'ngram' for this model.")
    model_dir = resolve_model_dir(spec.model)
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    architecture = resolve_architecture(hf_config)
    if is_encoder_only(architecture):
        raise ValueError(f"speculative_config.model {spec.model!r} is an encoder-only model ({architecture}); the "
                         f"draft must be a causal LM.")
    if hf_config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config.model {spec.model!r} has a vocabulary of {hf_config.vocab_size} "
                         f"tokens, the target {target.vocab_size}: the draft must share the target's tokenizer.")
    if any(layer_sliding_window(hf_config, i) is not None for i in range(hf_config.num_hidden_layers)):
        raise ValueError(f"speculative_config.model {spec.model!r} has sliding-window layers; the draft must "
                         f"attend fully.")
    limit = getattr(hf_config, "max_position_embeddings", None) or 2048
    if limit < target.max_model_len:
        raise ValueError(f"speculative_config.model {spec.model!r} takes {limit} positions, fewer than max_model_len "
                         f"({target.max_model_len}); lower --max-model-len to {limit}.")
    gguf_file = gguf_source(model_dir)
    packed = gguf_file is not None and on_cpu and target.dtype == torch.float32
    draft = ModelConfig(model=str(model_dir), tokenizer=target.tokenizer, hf_config=hf_config,
                        architecture=architecture, dtype=target.dtype, max_model_len=target.max_model_len,
                        seed=target.seed, quantization="gguf" if packed else "none",
                        gguf_file=str(gguf_file) if gguf_file else None, enforce_eager=True)
    return dataclasses.replace(spec, draft_model_config=draft)
