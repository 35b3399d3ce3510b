"""Multi-process scripts without an `if __name__ == '__main__':` guard. Run as a fresh interpreter, such a script gets
forked worker ranks (which never import it again) whose tokens equal the in-process engine's, with -tp 3 and with
-pp 2, even after torch's OpenMP threads ran in the script (a forked rank's main thread would wait on them forever);
a killed worker still fails it fast; forced spawn fails it with the guard to add; and no process is left behind.
In process: the variable's values, and spawn where fork is unsafe (CUDA, a busy thread) or impossible."""
from __future__ import annotations

import json
import logging
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

from pagellm import process_utils
from pagellm.process_utils import GUARD, get_mp_context, quiet_thread

MULTIPROC_METHOD_VARIABLE = "PAGELLM_WORKER_MULTIPROC_METHOD"

SCRIPT = '''
import argparse, json, os, signal, time

import torch

from pagellm import LLM, SamplingParams

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("-tp", type=int, default=1)
parser.add_argument("-pp", type=int, default=1)
parser.add_argument("--reference", action="store_true", help="first run the in-process engine")
parser.add_argument("--kill-worker", action="store_true")
args = parser.parse_args()
prompts = [{"prompt_token_ids": [20 + 97 * i + j for j in range(5 + 3 * i)]} for i in range(3)]
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
engine_args = dict(model=args.model, max_model_len=64, kv_cache_memory_bytes=4 << 20)
if args.reference:
    reference = LLM(**engine_args).generate(prompts, params, use_tqdm=False)
    print(json.dumps({"reference": [o.outputs[0].token_ids for o in reference]}), flush=True)
torch.ones(1 << 22).exp_()  # at least this, whatever the reference ran: torch's OpenMP threads now exist here
llm = LLM(**engine_args, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
          distributed_executor_backend="mp")
workers = [worker.process for worker in llm.llm_engine.engine_core.executor.workers]
print(json.dumps({"pids": [w.pid for w in workers], "methods": [type(w).__name__ for w in workers]}), flush=True)
if args.kill_worker:
    for i, prompt in enumerate(prompts):
        llm.llm_engine.add_request(str(i), prompt, SamplingParams(max_tokens=50, ignore_eos=True))
    for step in range(200):
        if step == 2:
            os.kill(workers[-1].pid, signal.SIGKILL)
            print(json.dumps({"killed_at": time.monotonic()}), flush=True)
        llm.llm_engine.step()
outputs = llm.generate(prompts, params, use_tqdm=False)
print(json.dumps({"outputs": [o.outputs[0].token_ids for o in outputs]}), flush=True)
'''


@pytest.fixture(scope="module")
def three_head_model(tiny_model_factory) -> Path:
    """3 query and KV heads, an MLP of 96 columns and 2 layers: splits over 3 ranks or 2 stages."""
    return tiny_model_factory("llama", hidden_size=48, intermediate_size=96, num_attention_heads=3,
                              num_key_value_heads=3)


def run_script(tmp_path: Path, *args: str, method: str | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    """Run the unguarded script in a fresh interpreter; returns the process and its JSON lines merged, with
    `ended_at`. Tagged with a marker in its environment, which every process it starts inherits, to check that none
    is left afterwards."""
    script = tmp_path / "unguarded.py"
    script.write_text(SCRIPT)
    marker = f"unguarded-{uuid.uuid4().hex}"
    env = {**os.environ, "PAGELLM_TEST_MARKER": marker}
    env.pop(MULTIPROC_METHOD_VARIABLE, None)
    if method is not None:
        env[MULTIPROC_METHOD_VARIABLE] = method
    result = subprocess.run([sys.executable, str(script), *args], env=env, capture_output=True, text=True, timeout=240,
                            check=False)
    lines = {"ended_at": time.monotonic()}
    for line in result.stdout.splitlines():
        if line.startswith("{"):
            lines.update(json.loads(line))
    deadline = time.monotonic() + 5.0
    while (left := processes_marked(marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left behind: {left}"
    return result, lines


def processes_marked(marker: str) -> list[int]:
    """Live processes whose environment holds `marker`."""
    found = []
    needle = f"PAGELLM_TEST_MARKER={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") and \
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours
            pass
    return found


@pytest.mark.parametrize("parallel", [["-tp", "3"], ["-pp", "2"]], ids=["tp3", "pp2"])
def test_an_unguarded_script_forks_its_ranks_and_gets_the_reference_tokens(tmp_path, three_head_model, parallel):
    """With 2 stages on this machine's cores each rank uses several OpenMP threads: the case that would hang."""
    result, lines = run_script(tmp_path, str(three_head_model), *parallel, "--reference")
    assert result.returncode == 0, result.stderr[-3000:]
    assert lines["methods"] == ["ForkProcess"] * int(parallel[1])
    assert lines["outputs"] == lines["reference"]
    assert len(lines["outputs"][0]) == 6


def test_a_killed_worker_fails_an_unguarded_script_fast(tmp_path, three_head_model):
    result, lines = run_script(tmp_path, str(three_head_model), "-tp", "3", "--kill-worker")
    assert result.returncode != 0
    assert "EngineDeadError" in result.stderr and "exited unexpectedly" in result.stderr
    assert "outputs" not in lines
    assert lines["ended_at"] - lines["killed_at"] < 15.0  # the failure, the other ranks stopped, the interpreter exit


def test_forced_spawn_fails_an_unguarded_script_saying_to_add_the_guard(tmp_path, three_head_model):
    """Each spawned rank imports the script again and would start its own engine there: it refuses, and so the
    script fails, both naming the guard."""
    result, lines = run_script(tmp_path, str(three_head_model), "-pp", "2", method="spawn")
    assert result.returncode != 0
    assert "pids" not in lines
    assert "pagellm was started while this process, a child started with spawn" in result.stderr
    final_error = result.stderr.strip().splitlines()[-1]
    assert "EngineDeadError" in final_error and GUARD in final_error


# ---- in process --------------------------------------------------------------------------------------------------

def test_the_variable_picks_the_method_and_names_the_allowed_ones(monkeypatch):
    for method in ("fork", "spawn", "forkserver"):
        monkeypatch.setenv(MULTIPROC_METHOD_VARIABLE, method)
        assert get_mp_context().get_start_method() == method
    monkeypatch.setenv(MULTIPROC_METHOD_VARIABLE, "thread")
    with pytest.raises(ValueError, match="must be one of fork, spawn, forkserver .*'thread'"):
        get_mp_context()


def test_spawn_with_a_warning_where_fork_is_unsafe(monkeypatch, caplog):
    monkeypatch.delenv(MULTIPROC_METHOD_VARIABLE, raising=False)
    monkeypatch.setattr(logging.getLogger("pagellm"), "propagate", True)
    current = threading.current_thread()
    monkeypatch.setattr(threading, "enumerate", lambda: [current])
    assert get_mp_context().get_start_method() == "fork"

    busy = threading.Thread(name="busy-thread")
    monkeypatch.setattr(threading, "enumerate", lambda: [current, busy])
    with caplog.at_level(logging.INFO, logger="pagellm"):
        assert get_mp_context().get_start_method() == "spawn"
    assert any(busy.name in record.getMessage() and MULTIPROC_METHOD_VARIABLE in record.getMessage()
               for record in caplog.records)
    quiet_thread(busy)  # one that only waits does not count
    assert get_mp_context().get_start_method() == "fork"

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert get_mp_context().get_start_method() == "spawn"
    monkeypatch.setenv(MULTIPROC_METHOD_VARIABLE, "fork")  # the variable overrides
    assert get_mp_context().get_start_method() == "fork"


def test_a_child_importing_the_main_script_is_told_to_add_the_guard(monkeypatch):
    monkeypatch.setattr(multiprocessing.current_process(), "_inheriting", True, raising=False)
    with pytest.raises(RuntimeError, match=f"Wrap the script's entry point in `{GUARD}`"):
        get_mp_context()
    monkeypatch.setattr(process_utils, "_main_is_imported_again", lambda: True)
    assert GUARD in process_utils.startup_hint(multiprocessing.get_context("spawn"))
    assert process_utils.startup_hint(multiprocessing.get_context("fork")) == ""
