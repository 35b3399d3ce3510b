"""pagellm's compute kernels: C for the CPU, Triton for CUDA.

Each C source has one binding module, which owns its build flags, its ctypes signature table (`SIGNATURES`, each
entry under the C prototype it mirrors) and its Python callers:

- `linear_cpu.c` (with its textual fragments `linear_tiles.inc` and its per-instruction-set template
  `linear_tiles_isa.inc`, `linear_int8.inc`, `linear_fused.inc`, and the
  ggml block decoders `ggml_blocks.h`, `ggml_k_quants.h`): `linear`, x W^T with W packed in its GGUF type.
- `paged_attention_cpu.c` (`kv_types.h`, `simd_exp.h`): `paged_attention`, decode attention and the cache write.
- `elementwise_cpu.c` (`simd_exp.h`): `elementwise`, RMSNorm, SiLU- and tanh-GELU-and-multiply, RoPE.
- `decoder_cpu.c`: `decoder`, a whole decode step through the other three by function pointer.

`build` compiles a source on first use (cached), binds its table, and returns None where it cannot, so every
caller keeps a PyTorch path. `triton_attention` is the CUDA attention, imported only where it runs.
tests/kernels/test_bindings.py checks each table against its C source; `.clang-format` at the repository root
formats the C sources. Nothing is imported here: loading a kernel builds it.
"""
