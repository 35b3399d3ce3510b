"""--cpu-affinity: which cores each rank gets (worker/cpu_affinity.py, ParallelConfig.cpu_slot), the errors for a
wrong list, and the binding itself, read back from the kernel (/proc) for each worker process of a TP=2 engine."""
from __future__ import annotations

import os

import pytest

from pagellm import LLM, SamplingParams
from pagellm.config import ParallelConfig
from pagellm.engine.arg_utils import EngineArgs
from pagellm.worker.cpu_affinity import parse_cores, slot_groups


def test_auto_splits_the_cores_into_disjoint_contiguous_groups():
    assert slot_groups("auto", 2, list(range(8))) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert slot_groups("auto", 3, list(range(8))) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert slot_groups("auto", 1, [2, 5]) == [[2, 5]]
    # more ranks than cores: one core each, round robin (they must share)
    assert slot_groups("auto", 3, [0, 1]) == [[0], [1], [0]]


def test_a_list_names_each_ranks_cores():
    assert parse_cores("0-3,8") == [0, 1, 2, 3, 8]
    assert slot_groups("0-1|2,3", 2, list(range(4))) == [[0, 1], [2, 3]]


@pytest.mark.parametrize("spec,slots,message", [
    ("0|1|2", 2, "3 core groups"),
    ("0|9", 2, "cores [9]"),
    ("0-x|1", 2, "not a core list"),
    ("3-1|1", 2, "not a core list"),
])
def test_a_wrong_list_is_refused_with_what_to_fix(spec, slots, message):
    with pytest.raises(ValueError, match="--cpu-affinity") as error:
        slot_groups(spec, slots, [0, 1, 2, 3])
    assert message in str(error.value)


def test_engine_args_refuse_a_wrong_list_before_any_rank_starts(model_dir):
    with pytest.raises(ValueError, match="1 core groups"):
        EngineArgs(model=str(model_dir), tensor_parallel_size=2, cpu_affinity="0").create_engine_config()


def test_slots_count_the_ranks_that_run_at_once():
    # tp 2 x pp 2 without overlap: the stages take turns and share a slot; the second replica comes after the first
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2,
                            data_parallel_rank=1)
    assert config.concurrent_ranks == 4
    assert [config.cpu_slot(rank) for rank in range(4)] == [2, 3, 2, 3]
    overlapped = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, pipeline_overlap=True)
    assert overlapped.concurrent_ranks == 4
    assert [overlapped.cpu_slot(rank) for rank in range(4)] == [0, 1, 2, 3]


def _bound_cores(pid: int, everything: set[int]) -> set[int]:
    """The kernel's view of a process: the cores its bound threads (those allowed fewer than `everything`) may run
    on. The worker's own thread and its OpenMP pool are bound; helper threads started before keep the whole mask."""
    bound: set[int] = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as status:
            line = next(line for line in status if line.startswith("Cpus_allowed_list:"))
        allowed = set(parse_cores(line.split(":", 1)[1].strip()))
        if allowed != everything:
            bound |= allowed
    return bound


def test_each_tensor_parallel_rank_runs_on_its_own_cores(model_dir):
    cores = sorted(os.sched_getaffinity(0))
    llm = LLM(model=str(model_dir), tensor_parallel_size=2, cpu_affinity="auto", max_model_len=128,
              kv_cache_memory_bytes=4 << 20)
    executor = llm.llm_engine.engine_core.executor
    want = slot_groups("auto", 2, cores)
    assert executor.collective_rpc("__getattribute__", "cpu_cores") == want
    if len(cores) >= 2:  # on one core nothing is narrower than the whole mask
        assert not set(want[0]) & set(want[1])
        assert [_bound_cores(worker.process.pid, set(cores)) for worker in executor.workers] == [set(g) for g in want]
    # and the engine still serves
    output = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, ignore_eos=True),
                          use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
