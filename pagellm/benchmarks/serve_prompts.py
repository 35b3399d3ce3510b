"""The prompts of the HTTP benchmarks (`bench serve`, `bench soak`): random token sequences of given lengths (one
class, or a share of long ones for `--mix`) or a file's prompts, each with the length the server will see."""
from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(slots=True)
class BenchPrompt:
    prompt: str
    prompt_len: int
    output_len: int


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None):
    from pagellm.model_executor.model_loader.resolve import resolve_model_dir
    from pagellm.transformers_utils.tokenizer import get_tokenizer

    if name is None or name.endswith(".gguf"):
        return get_tokenizer(resolve_model_dir(name))
    return get_tokenizer(name)


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    low = max(1, math.floor(mean * (1 - ratio)))
    return rng.integers(low, max(low, math.ceil(mean * (1 + ratio))) + 1, size=n).tolist()


def random_prompts(tokenizer, n: int, input_len: int, output_len: int, ratio: float, seed: int) -> list[BenchPrompt]:
    rng = np.random.default_rng(seed)
    input_lens, output_lens = _lengths(rng, input_len, ratio, n), _lengths(rng, output_len, ratio, n)
    special = set(tokenizer.all_special_ids)
    allowed = np.array([i for i in range(len(tokenizer)) if i not in special])
    prompts = []
    for in_len, out_len in zip(input_lens, output_lens):
        # Decoding random ids and re-encoding the text can merge or split tokens; trim so the server sees at most
        # in_len tokens, and count what it will actually see.
        ids = tokenizer.encode(tokenizer.decode(rng.choice(allowed, size=in_len).tolist()),
                               add_special_tokens=False)[:in_len]
        prompts.append(BenchPrompt(tokenizer.decode(ids), len(ids), out_len))
    return prompts


def mixed_prompts(tokenizer, n: int, input_len: int, output_len: int, ratio: float, mix: tuple[float, int, int],
                  seed: int) -> tuple[list[BenchPrompt], list[bool]]:
    """Random prompts of which round(fraction * n) (at least one), at places drawn from the seed, are long; and
    which ones those are."""
    fraction, long_input_len, long_output_len = mix
    num_long = min(n, max(1, round(fraction * n)))
    long_at = set(np.random.default_rng(seed).choice(n, size=num_long, replace=False).tolist())
    short = iter(random_prompts(tokenizer, n - num_long, input_len, output_len, ratio, seed))
    long = iter(random_prompts(tokenizer, num_long, long_input_len, long_output_len, ratio, seed + 1))
    return [next(long) if i in long_at else next(short) for i in range(n)], [i in long_at for i in range(n)]


def file_prompts(path: str, tokenizer, n: int, output_len: int, ratio: float, seed: int) -> list[BenchPrompt]:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--dataset-path {path} is not a file")
    lines = [line for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    try:
        texts = [json.loads(line)["prompt"] for line in lines] if file.suffix in (".jsonl", ".json") else lines
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: every line must be a JSON object with a 'prompt' field ({exc})") from exc
    if not texts:
        raise ValueError(f"{path} holds no prompts")
    texts = [texts[i % len(texts)] for i in range(n)]  # cycle through the file to reach --num-prompts
    output_lens = _lengths(np.random.default_rng(seed), output_len, ratio, n)
    return [BenchPrompt(text, len(tokenizer.encode(text, add_special_tokens=False)), out_len)
            for text, out_len in zip(texts, output_lens)]
