"""The decode steps a latency target (`--target-tpot-ms`) plans with, measured when the engine starts.

The scheduler's model of step time (core/sched/step_time.py) charges a decode batch the time of the smallest batch
it has seen that is at least as large, because a batch's time rises in stairs where the kernels change path (on one
2-core host 12 rows took 19 ms, 13 rows 29, 32 rows 41, 33 rows 55). A batch larger than any seen can only be
guessed, and a wave planned on a guess that lands on a stair misses the target. So before any request, a ladder of
batch sizes runs on throwaway one-token sequences, through the executor as a real step runs (every rank, the
sampler included), and the scheduler observes each step, up to the first size whose step takes longer than the
target (or max_num_seqs). Real steps then refine the model. vLLM profiles memory at start; this profiles time.
"""
from __future__ import annotations

import time

from pagellm.config import SchedulerConfig
from pagellm.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from pagellm.core.sched.scheduler import Scheduler
from pagellm.executor.abstract import Executor
from pagellm.logger import init_logger
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)

# Dense where kernels switch paths (small batches), sparser above.
LADDER = (1, 2, 4, *range(8, 64, 4), *range(64, 256, 16), 256)
REPEATS = 3  # steps per size: the model keeps their median
PROFILE_CONTEXT = 128  # positions each row attends over (the model moves its cost to a real step's context)


def profile_decode_steps(executor: Executor, scheduler: Scheduler, config: SchedulerConfig, max_model_len: int,
                         num_blocks: int, block_size: int, num_kv_groups: int) -> None:
    """Run the ladder's decode steps (each sequence one token attending over PROFILE_CONTEXT positions of whatever
    its own KV blocks hold) and let `scheduler` observe them; the workers drop the sequences at the end."""
    assert config.target_tpot_ms is not None
    target_s = config.target_tpot_ms / 1e3
    params = SamplingParams(temperature=0.0)
    started = time.perf_counter()
    largest = 0
    context = min(PROFILE_CONTEXT, max_model_len)
    blocks_per_row = -(-context // block_size)
    for rows in (size for size in LADDER if size * blocks_per_row <= num_blocks and size <= config.max_num_seqs):
        output = SchedulerOutput()
        for i in range(rows):
            request_id = f"step-profile-{i}"  # sent in full each step: the workers replace their state
            blocks = list(range(i * blocks_per_row, (i + 1) * blocks_per_row))
            output.new_requests.append(NewRequestData(request_id, [0] * context, [], params))
            output.scheduled.append(ScheduledRequest(request_id, 1, context - 1, new_block_ids=blocks,
                                                     replaces_block_table=True,
                                                     new_group_block_ids=[blocks] * (num_kv_groups - 1)))
        for _ in range(REPEATS):
            start = time.perf_counter()
            executor.submit_model(output, None)
            executor.collect_model_output()
            seconds = time.perf_counter() - start
            scheduler.observe_step_time(output, seconds)
        largest = rows
        if seconds > target_s:
            break
    executor.submit_model(SchedulerOutput(finished_req_ids=[f"step-profile-{i}" for i in range(largest)]), None)
    executor.collect_model_output()
    logger.info("Decode steps profiled for the latency target: batches of 1 to %d rows in %.1f s.", largest,
                time.perf_counter() - started)
