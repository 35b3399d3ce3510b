"""`pagellm bench embed`: embedding throughput (inputs/s and prompt tokens/s) of `LLM.embed` on random-token prompts,
beside transformers' batched inference on the same prompts (padded batches of the base model, pooled and normalised
the same way), in one run; and how far apart the two sets of vectors are (the lowest cosine similarity).
"""
from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from pagellm.benchmarks.machine import machine_header
from pagellm.benchmarks.throughput import parse_range
from pagellm.pooling_params import PoolingParams


@dataclass
class EmbedResult:
    backend: str
    seconds: float
    num_inputs: int
    num_tokens: int

    @property
    def inputs_per_s(self) -> float:
        return self.num_inputs / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds

    def report(self) -> str:
        return (f"{self.backend:>12}: {self.seconds:.2f} s, {self.inputs_per_s:.1f} inputs/s, "
                f"{self.tokens_per_s:.0f} tokens/s")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=parse_range, default=(32, 256),
                        help="prompt length, or a MIN:MAX range drawn uniformly")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="transformers' batch size")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip the transformers baseline")
    parser.add_argument("--dataset-seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this file")


def make_prompts(num: int, input_len: tuple[int, int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(20, vocab) for _ in range(rng.randint(*input_len))] for _ in range(num)]


def run_hf(model, prompts: list[list[int]], pooling_type: str, normalize: bool,
           batch_size: int) -> tuple[EmbedResult, np.ndarray]:
    """The base model over right-padded batches; LAST takes each row's last real token, MEAN its masked mean."""
    device = next(model.parameters()).device
    vectors = []
    start = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = prompts[first:first + batch_size]
        lengths = torch.tensor([len(p) for p in batch], device=device)
        ids = torch.zeros((len(batch), int(lengths.max())), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(batch):
            ids[i, :len(p)] = torch.tensor(p)
            mask[i, :len(p)] = 1
        with torch.inference_mode():
            hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        if pooling_type == "LAST":
            pooled = hidden[torch.arange(len(batch), device=device), lengths - 1]
        elif pooling_type == "MEAN":
            pooled = (hidden * mask[..., None]).sum(dim=1) / lengths[:, None]
        else:
            pooled = hidden[:, 0]
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        vectors.append(pooled.cpu().numpy())
    elapsed = time.perf_counter() - start
    return EmbedResult("transformers", elapsed, len(prompts), sum(map(len, prompts))), np.concatenate(vectors)


def run(args: argparse.Namespace) -> dict:
    from pagellm import LLM
    from pagellm.engine.arg_utils import EngineArgs

    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    config = llm.llm_engine.config
    model_config, device = config.model_config, config.device_config.device
    pooler = model_config.pooler_config
    prompts = make_prompts(args.num_prompts, args.input_len, model_config.vocab_size, args.dataset_seed)
    print(machine_header())
    print(f"{len(prompts)} inputs of {args.input_len[0]}:{args.input_len[1]} tokens; {pooler.pooling_type} pooling, "
          f"{'normalized' if pooler.normalize else 'raw'}; {model_config.dtype}, {device}, "
          f"{torch.get_num_threads()} threads")
    # Warm-up on other prompts, so that the measured run finds none of its own in the prefix cache.
    warm_up = make_prompts(2, args.input_len, model_config.vocab_size, args.dataset_seed + 1)
    llm.embed([{"prompt_token_ids": p} for p in warm_up], use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.embed([{"prompt_token_ids": p} for p in prompts], PoolingParams(), use_tqdm=False)
    results = [EmbedResult("pagellm", time.perf_counter() - start, len(prompts), sum(map(len, prompts)))]
    ours = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    report: dict = {}
    if args.hf:
        from transformers import AutoModel

        llm.shutdown()
        del llm  # free the KV pool before the baseline runs
        model = AutoModel.from_pretrained(model_config.model, dtype=model_config.dtype).to(device).eval()
        hf_result, theirs = run_hf(model, prompts, pooler.pooling_type, pooler.normalize, args.hf_batch_size)
        results.append(hf_result)
        cosines = (ours * theirs).sum(axis=1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
        report["min_cosine_vs_transformers"] = float(cosines.min())
    print()
    for result in results:
        print(result.report())
    if args.hf:
        print(f"pagellm / transformers: {results[1].seconds / results[0].seconds:.2f}x; lowest cosine similarity "
              f"of the two vectors of an input: {report['min_cosine_vs_transformers']:.6f}")
    report.update({r.backend: {**asdict(r), "inputs_per_s": r.inputs_per_s, "tokens_per_s": r.tokens_per_s}
                   for r in results})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return report
