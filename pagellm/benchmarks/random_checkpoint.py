"""`pagellm bench random-checkpoint`: write a random-weight Hugging Face Llama checkpoint (config.json,
model.safetensors, a tokenizer) with the exact shapes of a real model, vocabulary included, to measure on a GPU
what such a model costs (`bench latency --model DIR --device cuda --backends pagellm,hf`) with no model hub.

Weights are normal with std 0.02 (norms 1), so activations stay finite through every layer. The tokenizer is
byte-level BPE over the 256 byte tokens, one merge, and filler tokens up to the model's vocabulary size, so every id
the model can sample decodes; the outputs are meaningless, the arithmetic and memory traffic are the real model's.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from pagellm.benchmarks.random_gguf import SPECIALS, byte_level_vocab

# Real models' configurations (Hugging Face names); the vocabulary sizes are theirs, so the LM head costs what it
# costs in the real model.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES: dict[str, dict[str, object]] = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, max_position_embeddings=131072),
    "llama-3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                       rope_theta=500000.0, max_position_embeddings=8192),
    "tinyllama-1.1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=False,
                           rope_theta=10000.0, max_position_embeddings=2048),
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", type=Path, help="the directory to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: the real model's)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="dtype of the stored weights")
    parser.add_argument("--seed", type=int, default=0)


def config_dict(shape: str, layers: int | None) -> dict:
    fields = dict(SHAPES[shape])
    if layers is not None:
        if layers < 1:
            raise SystemExit(f"--layers must be at least 1, got {layers}.")
        fields["num_hidden_layers"] = layers
    return dict(model_type="llama", architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, bos_token_id=1,
                eos_token_id=2, hidden_act="silu", attention_bias=False, mlp_bias=False, **fields)


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama checkpoint with this config, by its Hugging Face name."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    head_dim = config["head_dim"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    for i in range(config["num_hidden_layers"]):
        layer = {"self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
                 "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
                 "mlp.down_proj": (hidden, inter), "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,)}
        shapes.update({f"model.layers.{i}.{name}.weight": shape for name, shape in layer.items()})
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


def write_tokenizer(output: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = byte_level_vocab()
    tokens += [f"<filler_{i}>" for i in range(vocab_size - len(tokens))]
    backend = Tokenizer(models.BPE({token: i for i, token in enumerate(tokens)}, [("Ġ", "t")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=SPECIALS[1], eos_token=SPECIALS[2],
                                        unk_token=None)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.save_pretrained(output)


def run(args: argparse.Namespace) -> int:
    from safetensors.torch import save_file

    config = config_dict(args.shape, args.layers)
    output: Path = args.output
    output.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    tensors = {}
    for name, shape in weight_shapes(config).items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=generator) * 0.02).to(dtype)
    save_file(tensors, output / "model.safetensors", metadata={"format": "pt"})
    (output / "config.json").write_text(json.dumps(dict(config, torch_dtype=args.dtype), indent=2))
    write_tokenizer(output, config["vocab_size"])
    num_params = sum(t.numel() for t in tensors.values())
    print(f"wrote {output}: {args.shape} shapes, {config['num_hidden_layers']} layers, {num_params / 1e9:.2f}B "
          f"parameters in {args.dtype} ({(output / 'model.safetensors').stat().st_size / 1e9:.2f} GB)")
    return 0
