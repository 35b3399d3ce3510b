"""With the C kernels unavailable (PAGELLM_DISABLE_C_KERNELS=1, as on a machine without a compiler) the engine runs
on its PyTorch paths and a GGUF model's packed weights are dequantized: the same greedy tokens as with the kernels.
The switch is read when the kernels are first loaded, so the kernel-less run is a separate process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from pagellm import LLM, SamplingParams

SCRIPT = """
import json, sys
from pagellm import LLM, SamplingParams
from pagellm.kernels import linear
llm = LLM(model=sys.argv[1] or None, max_model_len=256, kv_cache_memory_bytes=16 << 20)
out = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                   use_tqdm=False)
weight_bytes = llm.llm_engine.engine_core.executor.collective_rpc("weight_bytes")[0]
print(json.dumps({"tokens": [o.outputs[0].token_ids for o in out], "kernels": linear.available(),
                  "weight_bytes": weight_bytes}))
"""


def test_default_model_same_tokens_without_c_kernels(make_token_prompts):
    prompts = make_token_prompts([5, 30], seed=3)
    llm = LLM(max_model_len=256, kv_cache_memory_bytes=16 << 20)
    expected = [o.outputs[0].token_ids for o in llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)]
    env = dict(os.environ, PAGELLM_DISABLE_C_KERNELS="1")
    result = subprocess.run([sys.executable, "-c", SCRIPT, "", json.dumps(prompts)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["kernels"] is False
    assert report["tokens"] == expected
    assert report["weight_bytes"] > 500e6  # the packed weights were dequantized to float32
