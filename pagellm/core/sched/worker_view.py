"""What the workers hold of each sequence, kept on the scheduler's side: turns a scheduled request into the diff
the workers need (see output.py), sending a sequence in full the first time they see it."""
from __future__ import annotations

from dataclasses import dataclass

from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request
from pagellm.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput


@dataclass(slots=True)
class _Held:
    """The workers have the sequence's first `num_tokens` tokens and `num_blocks` blocks."""

    num_tokens: int
    num_blocks: int


class WorkerView:
    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        self._held: dict[str, _Held] = {}

    def fill(self, scheduled: ScheduledRequest, request: Request, output: SchedulerOutput) -> None:
        """Set the tokens and blocks the workers lack; a sequence they do not hold is added to
        `output.new_requests` in full, and its whole block table sent."""
        request_id = request.request_id
        held = self._held.get(request_id)
        rewritten = self.kv_cache_manager.take_rewritten_table(request_id)
        if held is None:
            output.new_requests.append(NewRequestData(
                request_id, list(request.prompt_token_ids), list(request.output_token_ids), request.sampling_params,
                request.eos_token_ids, request.bad_words_token_ids, request.pooling_params, request.lora_request))
            held = self._held[request_id] = _Held(request.num_tokens, 0)
        else:
            scheduled.new_token_ids = request.all_token_ids[held.num_tokens:]
            held.num_tokens = request.num_tokens
        if held.num_blocks == 0 or rewritten:
            scheduled.replaces_block_table, held.num_blocks = True, 0
        manager = self.kv_cache_manager
        scheduled.new_block_ids = manager.get_block_ids(request_id, held.num_blocks)
        scheduled.new_group_block_ids = [manager.get_block_ids(request_id, held.num_blocks, group)
                                         for group in range(1, len(manager.groups))]
        held.num_blocks += len(scheduled.new_block_ids)

    def forget(self, request_id: str) -> None:
        """The workers drop the sequence (finished or preempted); it is sent in full if it comes back."""
        self._held.pop(request_id, None)
