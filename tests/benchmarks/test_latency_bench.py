"""`pagellm bench latency`, `bench sweep` and `bench accuracy` end to end on a tiny model, the sweep's metric
maths, and the F32 GGUF that llama.cpp's float32 run reads (written with the `gguf` package)."""
from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from pagellm.benchmarks.latency_backends import LatencyResult, write_f32_gguf
from pagellm.benchmarks.sweep import row


def cli(*args: str) -> str:
    result = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "bench", *args], capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_latency_against_transformers_with_step_split(tiny_model_factory):
    # A 16-token step budget chunks the batch of 3 prompts of 12 over three steps, two of them mixed with decodes:
    # decode is timed on the decode-only steps after them.
    out = cli("latency", "--model", str(tiny_model_factory("llama")), "--backends", "pagellm,hf", "--batch-size",
              "1,3", "--input-len", "12", "--output-len", "32", "--repeats", "2", "--step-split",
              "--kv-cache-memory", "8MiB", "--max-num-batched-tokens", "16", "--kv-cache-dtype", "float16")
    assert "pagellm step split, batch 3" in out and "forward" in out and "sample" in out
    assert any(line.startswith("CPU: ") and "; C kernels: " in line for line in out.splitlines())  # where it ran
    rows = [line.split() for line in out.splitlines()
            if line.split()[:1] in (["pagellm"], ["transformers"]) and line.split()[1].isdigit()]
    assert sorted((r[0], r[1]) for r in rows) == [("pagellm", "1"), ("pagellm", "3"), ("transformers", "1"),
                                                   ("transformers", "3")]
    assert all(float(r[2]) > 0 and float(r[4]) > 0 for r in rows)  # prefill and decode tok/s
    kv_mb = {(r[0], r[1]): float(r[6]) for r in rows}  # a float16 cache: half the bytes of transformers' float32
    assert kv_mb[("pagellm", "3")] == pytest.approx(kv_mb[("transformers", "3")] / 2, abs=0.05)
    assert "KV cache float16" in out
    assert "pagellm / transformers at batch 3: prefill" in out
    assert "quantization none" in out  # a float checkpoint: nothing packed by default


def test_sweep_writes_csv_and_png(tiny_model_factory, tmp_path):
    cli("sweep", "--model", str(tiny_model_factory("llama")), "--backends", "pagellm,hf", "--concurrency", "1,2",
        "--input-len", "8", "--output-len", "48", "--output", str(tmp_path / "sweep"), "--kv-cache-memory", "8MiB")
    with open(tmp_path / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["backend"], r["concurrency"]) for r in rows] == [
        ("pagellm", "1"), ("transformers", "1"), ("pagellm", "2"), ("transformers", "2")]
    assert all(float(r["total_tok_s"]) > 0 and float(r["tpot_ms"]) > 0 for r in rows)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_sweep_row_maths():
    # 4 requests, 100 prompt tokens in 2 s (200 tok/s), 50 output tokens each in 5 s (40 tok/s).
    r = row(LatencyResult("x", 4, prefill_tok_s=200.0, decode_tok_s=40.0, weight_bytes=1, kv_bytes_per_token=0),
            100, 50)
    assert r["total_tok_s"] == pytest.approx(4 * 150 / 7, abs=0.01)
    assert r["output_tok_s"] == pytest.approx(4 * 50 / 7, abs=0.01)
    assert r["tpot_ms"] == pytest.approx(100.0)


def test_decode_roofline_counts_weights_and_every_sequence_s_kv_reads():
    from pagellm.benchmarks.latency_backends import decode_step_bytes
    from pagellm.benchmarks.machine import kv_bytes_per_token

    # SmolLM2-135M: 30 layers, 3 KV heads of 64 -> K and V in float32 are 2 * 30 * 3 * 64 * 4 bytes per token.
    config = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    assert kv_bytes_per_token(config, 4) == 46080 and kv_bytes_per_token(config, 2) == 23040
    result = LatencyResult("x", 8, prefill_tok_s=1.0, decode_tok_s=1.0, weight_bytes=10**6, kv_bytes_per_token=100)
    # Decode steps attend to 129..132 cached tokens for input 128, output 4: 130.5 on average, per sequence.
    assert decode_step_bytes(result, 128, 4) == 10**6 + 8 * 130.5 * 100


def test_f32_gguf_keeps_metadata_and_dequantizes_every_tensor(tmp_path):
    rng = np.random.default_rng(0)
    source = tmp_path / "model.Q8_0.gguf"
    writer = gguf.GGUFWriter(str(source), "llama")
    writer.add_block_count(1)
    writer.add_token_list(["a", "b", "c"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    quantized = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(quantized, QT.Q8_0), raw_dtype=QT.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    target = write_f32_gguf(source, tmp_path / "model.F32.gguf")
    before, after = gguf.GGUFReader(source), gguf.GGUFReader(target)
    assert after.get_field("general.file_type").contents() == int(gguf.LlamaFileType.ALL_F32)
    assert after.get_field("tokenizer.ggml.tokens").contents() == ["a", "b", "c"]
    assert after.get_field("llama.block_count").contents() == 1
    for old, new in zip(before.tensors, after.tensors):
        assert new.name == old.name and new.tensor_type == QT.F32
        assert list(new.shape) == list(old.shape)
        np.testing.assert_array_equal(np.asarray(new.data).reshape(-1),
                                      gguf.quants.dequantize(old.data, old.tensor_type).reshape(-1))


def test_accuracy_of_int8_against_float32(tiny_model_factory, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("The paged KV cache stores keys and values in fixed-size blocks. " * 8)
    out = cli("accuracy", "--model", str(tiny_model_factory("llama")), "--quantization", "int8", "--text", str(text),
              "--max-text-tokens", "60", "--greedy-tokens", "4", "--kv-cache-memory", "8MiB")
    float32, int8 = map(float, re.search(r"float32 ([0-9.]+), int8 ([0-9.]+)", out).groups())
    assert 1 < float32 and 1 < int8 and abs(int8 - float32) / float32 < 0.1  # a close but not identical model
    assert "per-token logprob difference: mean" in out
    assert "decode-step logprob difference over 32 generated tokens" in out
    assert "greedy tokens identical:" in out and "of 32" in out


def test_accuracy_of_a_float16_kv_cache(tiny_model_factory, tmp_path):
    """Same weights, a float16 cache: a prompt of one chunk attends to its own float32 K/V, so its perplexity is
    unchanged; decode steps read rounded K/V and move a little."""
    text = tmp_path / "text.txt"
    text.write_text("The paged KV cache stores keys and values in fixed-size blocks. " * 8)
    out = cli("accuracy", "--model", str(tiny_model_factory("llama")), "--kv-cache-dtype", "float16", "--text",
              str(text), "--max-text-tokens", "60", "--greedy-tokens", "8", "--kv-cache-memory", "8MiB")
    baseline, half = re.search(r"float32 ([0-9.]+), default \+ float16 KV cache ([0-9.]+)", out).groups()
    assert baseline == half
    largest = float(re.search(r"decode-step logprob difference over 64 generated tokens: mean [0-9.]+, max ([0-9.]+)",
                              out).group(1))
    assert 1e-5 < largest < 0.05


FAKE_LLAMA_CPP = '''
import time


class Llama:
    """Stands in for llama_cpp.Llama: eval costs 1 ms plus 0.1 ms per token."""

    def __init__(self, model_path, **kwargs):
        open(model_path, "rb").close()

    def reset(self):
        pass

    def eval(self, tokens):
        time.sleep(0.001 + 0.0001 * len(tokens))


# The low-level batch API, same costs per llama_decode; it checks what a batch holds.
class _Params:
    pass


class _Batch:
    def __init__(self, capacity):
        self.n_tokens = 0
        self.token, self.pos, self.n_seq_id, self.logits = ([0] * capacity for _ in range(4))
        self.seq_id = [[0] for _ in range(capacity)]


DECODED = []  # (sequence, position) of every token decoded, in order


def llama_backend_init():
    pass


def llama_model_default_params():
    return _Params()


llama_context_default_params = llama_model_default_params


def llama_model_load_from_file(path, params):
    open(path, "rb").close()
    return object()


def llama_init_from_model(model, params):
    assert params.n_seq_max >= 1 and params.n_ctx > 0
    DECODED.clear()  # a new context starts every sequence over
    return object()


def llama_batch_init(capacity, embd, n_seq_max):
    return _Batch(capacity)


def llama_decode(context, batch):
    DECODED.extend((batch.seq_id[i][0], batch.pos[i]) for i in range(batch.n_tokens))
    time.sleep(0.001 + 0.0001 * batch.n_tokens)
    return 0


def llama_batch_free(batch):
    # every sequence's positions came in order, each once
    for sequence in {s for s, _ in DECODED}:
        positions = [p for s, p in DECODED if s == sequence]
        assert positions == list(range(len(positions))), positions


def llama_free(context):
    pass


def llama_model_free(model):
    pass
'''


def test_llama_cpp_peer_plumbing(tmp_path, monkeypatch):
    """The parent/child protocol of the llama.cpp backends (the real binding builds llama.cpp for ~15 minutes, so a
    stand-in with known costs replaces it here; the figures in the README come from the real one)."""
    from pagellm.benchmarks.latency_backends import bench_llama_cpp
    from pagellm.benchmarks.throughput import BenchRequest, run_llama_cpp

    package = tmp_path / "fake" / "llama_cpp"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(FAKE_LLAMA_CPP)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "fake"), os.environ.get("PYTHONPATH", "")]))
    model = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(model), "llama")
    writer.add_tensor("output.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    hf_config = SimpleNamespace(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32)
    result = bench_llama_cpp("llama.cpp", model, [list(range(100))], output_len=20, repeats=1, hf_config=hf_config)
    assert result.batch_size == 1
    assert 100 / 0.011 * 0.3 < result.prefill_tok_s <= 100 / 0.011  # one eval of 100 tokens: 11 ms
    assert 20 / (20 * 0.0011) * 0.3 < result.decode_tok_s <= 1 / 0.0011  # one eval per token: 1.1 ms
    # three sequences together: their 300 prompt tokens in one decode (31 ms), then 20 steps of three (1.3 ms each)
    batched = bench_llama_cpp("llama.cpp", model, [list(range(100))] * 3, output_len=20, repeats=1,
                              hf_config=hf_config)
    assert batched.batch_size == 3
    assert 300 / 0.031 * 0.3 < batched.prefill_tok_s <= 300 / 0.031
    assert batched.decode_tok_s <= 3 / 0.0013
    assert batched.decode_tok_s > 1.5 * result.decode_tok_s  # 2.5x: three tokens a step for 0.2 ms more
    assert result.weight_bytes == 4 * 32 * 4
    assert result.kv_bytes_per_token == 2 * 2 * 2 * 8 * 2  # K and V, 2 layers, 2 KV heads of 8, F16

    served = run_llama_cpp(str(model), [BenchRequest(list(range(50)), 10), BenchRequest(list(range(30)), 5)])
    # batched: both prompts in one decode (80 tokens), then 4 steps of two sequences and 5 of one
    expected = (0.001 + 0.008) + 4 * 0.0012 + 5 * 0.0011
    assert expected <= served.elapsed < expected * 3 + 0.05
    assert (served.prompt_tokens, served.output_tokens) == (80, 15)


@pytest.mark.parametrize("mix", ["Q3_K_M", "Q4_K_M"])  # Q5_K_M takes the same path as Q4_K_M
def test_random_gguf_has_the_mix_and_runs_packed(tmp_path, mix):
    """`bench random-gguf`: a file of TinyLlama's layer shapes in one of llama.cpp's _M mixes that pagellm loads
    packed and decodes with finite logprobs (the weights are random: only the arithmetic is real)."""
    from pagellm import LLM, SamplingParams

    path = tmp_path / "random.gguf"
    assert f"1 layers, {mix}" in cli("random-gguf", str(path), "--layers", "1", "--mix", mix)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType[mix.removesuffix("_M")]
    larger = gguf.GGMLQuantizationType.Q4_K if mix == "Q3_K_M" else gguf.GGMLQuantizationType.Q6_K
    assert types["blk.0.ffn_down.weight"] == types["blk.0.attn_v.weight"] == larger
    llm = LLM(model=str(path), max_model_len=64, kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0] < path.stat().st_size * 1.01
    out = llm.generate([{"prompt_token_ids": [5, 60, 200, 7]}],
                       SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    assert all(np.isfinite(lp.logprob) for entry in out.outputs[0].logprobs for lp in entry.values())


def test_latency_through_generate_and_the_server(tiny_model_factory):
    """--through: the same prompts timed through LLM.generate() and through the OpenAI server's streams (a child
    process), each printed with its ratio to the engine's steps, and the server's TPOT."""
    out = cli("latency", "--model", str(tiny_model_factory("llama")), "--batch-size", "1,2", "--input-len", "8",
              "--output-len", "8", "--repeats", "1", "--through", "step,generate,server", "--kv-cache-memory", "8MiB")
    rows = {(m[1], m[2]): line.split() for line in out.splitlines()
            if (m := re.match(r"\s*(pagellm(?: generate\(\)| server)?)\s+(\d+)\s+[\d.]+\s", line))}
    assert set(rows) == {(name, batch) for name in ("pagellm", "pagellm generate()", "pagellm server")
                         for batch in ("1", "2")}, out
    assert all(float(r[-6]) > 0 and float(r[-4]) > 0 for r in rows.values())  # prefill and decode tok/s
    assert out.count("/ pagellm steps at batch") == 4  # generate() and server, at batch 1 and 2
    assert re.search(r"pagellm server, batch 2: mean time between a stream's tokens \(TPOT\) [\d.]+ ms", out)


def test_latency_refuses_an_unknown_through():
    result = subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "bench", "latency", "--through", "x"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "unknown --through x" in result.stderr
