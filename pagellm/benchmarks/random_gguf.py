"""`pagellm bench random-gguf`: write a random-weight Llama GGUF of a real model's layer shapes in a llama.cpp
quantization mix, to measure the kernels on realistic shapes beside llama.cpp (`bench latency --model FILE
--backends pagellm,llama.cpp`) when no such checkpoint is at hand (no model hub here).

Blocks are random bytes, every bit pattern a valid block, with small float16 scales so activations stay finite
through the layers. The vocabulary is the 256 byte tokens of a byte-level BPE, one merge and three special tokens;
the outputs are meaningless, the arithmetic is what a real file of these shapes costs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

T = GGMLQuantizationType
# Shapes: (hidden, intermediate, attention heads, KV heads) of known models.
SHAPES = {"tinyllama-1.1b": (2048, 5632, 32, 4), "llama-3.2-1b": (2048, 8192, 32, 8),
          "llama-3-8b": (4096, 14336, 32, 8)}
# Byte offsets of the float16 scales (d, dmin) in each block type this writer uses.
SCALE_OFFSETS = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,), T.Q8_0: (0,),
                 T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,)}
K_MIXES = {"Q3_K_M": T.Q3_K, "Q4_K_M": T.Q4_K, "Q5_K_M": T.Q5_K}  # llama.cpp's _M mixes: their main type
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level_vocab() -> list[str]:
    """The special tokens, the 256 byte tokens of a byte-level BPE and the one merge's token (tokenizers want at
    least one merge)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(bytes_to_unicode().values()) + ["Ġt"]


def mix_types(mix: str, layer: int) -> dict[str, GGMLQuantizationType]:
    """Each projection's type in `layer`: Q4_K_M (Q5_K_M) gives v and ffn_down Q6_K in every other layer (llama.cpp
    gives them to about half the layers) and the rest Q4_K (Q5_K); Q3_K_M gives v, the attention output and ffn_down
    Q4_K and the rest Q3_K; a single type name gives every matrix that type."""
    if mix == "Q3_K_M":
        return {"attn_q": T.Q3_K, "attn_k": T.Q3_K, "attn_v": T.Q4_K, "attn_output": T.Q4_K, "ffn_gate": T.Q3_K,
                "ffn_up": T.Q3_K, "ffn_down": T.Q4_K}
    if mix in K_MIXES:
        main = K_MIXES[mix]
        larger = T.Q6_K if layer % 2 == 0 else main
        return {"attn_q": main, "attn_k": main, "attn_v": larger, "attn_output": main, "ffn_gate": main,
                "ffn_up": main, "ffn_down": larger}
    return dict.fromkeys(("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"),
                         GGMLQuantizationType[mix])


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("output", type=Path, help="the .gguf file to write")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    parser.add_argument("--layers", type=int, default=6, help="decoder layers (the real models have 16-32)")
    parser.add_argument("--mix", choices=[*K_MIXES, *(t.name for t in SCALE_OFFSETS)],
                        default="Q4_K_M")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    hidden, intermediate, heads, kv_heads = SHAPES[args.shape]
    head_dim = hidden // heads
    rng = np.random.default_rng(args.seed)
    vocab = byte_level_vocab()
    writer = GGUFWriter(str(args.output), "llama")
    writer.add_name(f"random {args.shape} {args.mix}")
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(intermediate)
    writer.add_block_count(args.layers)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)

    def matrix(name: str, rows: int, columns: int, qtype: GGMLQuantizationType) -> None:
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        blocks = rng.integers(0, 256, size=(rows * columns // block_values, block_bytes), dtype=np.uint8)
        for offset in SCALE_OFFSETS[qtype]:
            scales = rng.uniform(-2e-4, 2e-4, size=(len(blocks), 1)).astype(np.float16)
            blocks[:, offset:offset + 2] = scales.view(np.uint8)
        writer.add_tensor(name, blocks.reshape(rows, -1), raw_dtype=qtype)

    embedding_type = T.Q6_K if args.mix in K_MIXES else GGMLQuantizationType[args.mix]
    matrix("token_embd.weight", len(vocab), hidden, embedding_type)
    for layer in range(args.layers):
        types, prefix = mix_types(args.mix, layer), f"blk.{layer}."
        writer.add_tensor(prefix + "attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(prefix + "ffn_norm.weight", np.ones(hidden, np.float32))
        for name, rows, columns in (("attn_q", hidden, hidden), ("attn_k", kv_heads * head_dim, hidden),
                                    ("attn_v", kv_heads * head_dim, hidden), ("attn_output", hidden, hidden),
                                    ("ffn_gate", intermediate, hidden), ("ffn_up", intermediate, hidden),
                                    ("ffn_down", hidden, intermediate)):
            matrix(f"{prefix}{name}.weight", rows, columns, types[name])
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    matrix("output.weight", len(vocab), hidden, embedding_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    print(f"wrote {args.output}: {args.shape} shapes, {args.layers} layers, {args.mix}, "
          f"{args.output.stat().st_size / 1e6:.1f} MB")
    return 0
