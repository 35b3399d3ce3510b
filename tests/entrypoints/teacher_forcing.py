"""Whole-engine outputs against transformers, teacher-forced: one uncached transformers forward over each sequence's
own tokens, so every position is checked whatever came before it. Logprobs agree within LOGPROB_TOLERANCE; a
greedy token may differ from transformers' argmax only where its top two logits are within NEAR_TIE (a float
near-tie). Also: the same run in a child process with PAGELLM_ATTENTION_BACKEND forced (read once per process)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

NEAR_TIE = 0.02
LOGPROB_TOLERANCE = 1e-4


def check_teacher_forced(hf_model, prompt: list[int], tokens: list[int], logprobs: list[float],
                         greedy: bool = True, what: str = "") -> None:
    """`logprobs` (of `tokens`) are transformers' log p(token | prompt + tokens before it); greedy tokens are its
    argmax up to a near-tie."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([prompt + tokens])).logits[0]
    reference = logits[len(prompt) - 1:-1].float().log_softmax(-1)
    expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=LOGPROB_TOLERANCE,
                               msg=f"{len(prompt)}-token prompt{what}")
    if greedy:
        margins = reference.max(-1).values - expected
        assert (margins < NEAR_TIE).all(), (len(prompt), margins)


def assert_matches_transformers(hf_model, output, greedy: bool = True) -> None:
    """Every completion of a RequestOutput (requested with logprobs=0 or more) against transformers."""
    for completion in output.outputs:
        tokens = completion.token_ids
        logprobs = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        check_teacher_forced(hf_model, output.prompt_token_ids, tokens, logprobs, greedy,
                             f", sequence {completion.index}")


BACKEND_SCRIPT = """
import json, sys
import torch
from pagellm import LLM, SamplingParams
from pagellm.model_executor.layers.attention import attention_backend
llm = LLM(model=sys.argv[1], max_model_len=512, kv_cache_memory_bytes=8 << 20, block_size=8,
          max_num_batched_tokens=48)
params = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True, logprobs=0)
out = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print(json.dumps({"backend": attention_backend("cpu", torch.float32),
                  "outputs": [[o.prompt_token_ids, o.outputs[0].token_ids,
                               [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]]
                              for o in out]}))
"""


def greedy_with_backend(backend: str, model_dir: Path, prompts: list[dict],
                        max_tokens: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt, greedy tokens, their logprobs) per prompt, from a child process running `backend`."""
    env = dict(os.environ, PAGELLM_ATTENTION_BACKEND=backend, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the engine switches the interpreter on itself, on the CPU
    result = subprocess.run([sys.executable, "-c", BACKEND_SCRIPT, str(model_dir), json.dumps(prompts),
                             str(max_tokens)], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == backend
    return report["outputs"]
