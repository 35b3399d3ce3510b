"""A step's flat model inputs (`ModelInputs`), built from the worker's batch of sequences: token ids, positions, the
slot mapping and attention metadata of every KV cache group, the logits rows to sample, and the lists of prefill
chunks that want prompt logprobs or pooling.

Decodes come first, then prefill chunks. Everything is computed on the CPU with NumPy (one vectorised pass for the
slot mapping), and on CUDA all of a step's integer inputs (token ids, positions, slot mapping, block tables, lengths,
logits rows) go to the device as one buffer in one pinned, non-blocking copy (model_executor/host_copy.py).

With async scheduling (see core/sched/async_scheduling.py) a sequence's input token may be one the previous step
sampled but the host has not seen yet: it is taken from that step's sampled tokens on the device.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.lora.context import LoRABatch
from pagellm.lora.worker_manager import LoRAWorkerManager
from pagellm.model_executor.host_copy import StagedCopy
from pagellm.model_executor.layers.attention import AttentionBackend, AttentionMetadata, PrefillLayout
from pagellm.model_executor.layers.pooler import PoolingChunk
from pagellm.worker.input_batch import BatchedRequest


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[BatchedRequest]  # one per logits row, in order (repeated for num_samples > 1)
    # (request, flat index of its first token this step): prefill chunks whose prompt logprobs are wanted
    prompt_logprobs: list[tuple[BatchedRequest, int]] = field(default_factory=list)
    # Async scheduling: requests whose input token the previous step did not sample (it failed, or their sampling did)
    missing_pending: list[str] = field(default_factory=list)
    pooling: list[PoolingChunk] = field(default_factory=list)  # the step's chunks of pooling requests
    lora: LoRABatch | None = None  # the rows of each LoRA adapter, when any sequence runs with one


def build_model_inputs(batch: list[BatchedRequest], block_size: int, num_kv_groups: int, backend: AttentionBackend,
                       device: torch.device, lora_manager: LoRAWorkerManager | None,
                       last_sampled: tuple[torch.Tensor, dict[str, int]] | None) -> ModelInputs:
    """The step's inputs for `batch`, with `backend`'s attention metadata for each of the `num_kv_groups` groups.
    `last_sampled`: the previous step's sampled tokens on the device and each request's row in them (its first
    sample), which the sequences with a pending input token read; None when no step left any."""
    # Decodes first: they share one batched attention call. A decode's query is its last token and any
    # speculative drafts after it; each query token is a decode row of its own (its position, its length), so a
    # verify step runs through the same batched attention and the one-call CPU decode step as plain decodes.
    decodes = [r for r in batch if r.num_tokens == 1 + r.num_spec_tokens]
    prefills = [r for r in batch if r.num_tokens != 1 + r.num_spec_tokens]
    ordered = decodes + prefills
    bs = block_size

    query_lens = np.array([r.num_tokens for r in ordered], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
    num_tokens = int(query_lens.sum())
    req_index = np.repeat(np.arange(len(ordered)), query_lens)
    offsets = np.arange(num_tokens) - starts[req_index]
    positions = np.array([r.num_computed_tokens for r in ordered], dtype=np.int64)[req_index] + offsets
    max_blocks = max(len(r.block_ids) for r in ordered)
    # One table per KV cache group; every group's tables are equally long.
    block_tables = [np.zeros((len(ordered), max_blocks), dtype=np.int64) for _ in range(num_kv_groups)]
    for i, r in enumerate(ordered):
        for table, group_ids in zip(block_tables, r.block_tables):
            table[i, :len(group_ids)] = group_ids
    slot_mappings = [table[req_index, positions // bs] * bs + positions % bs for table in block_tables]
    input_ids = np.fromiter((t for r in ordered for t in r.token_ids), dtype=np.int64, count=num_tokens)

    # n > 1: the same last-token logits row is sampled once per sequence. Speculative decoding: each of the
    # last 1 + num_spec_tokens positions is sampled, in order.
    sampled_rows = [i for i, r in enumerate(ordered) if r.needs_sample for _ in range(r.num_samples)
                    for _ in range(r.num_spec_tokens + 1)]
    back = np.array([r.num_spec_tokens - j for r in ordered if r.needs_sample for _ in range(r.num_samples)
                     for j in range(r.num_spec_tokens + 1)], dtype=np.int64)
    logits_indices = starts[sampled_rows] + query_lens[sampled_rows] - 1 - back
    # Async scheduling: inputs that are the previous step's sampled tokens, taken from them on the device.
    last_tokens, last_rows = last_sampled or (None, {})
    pending = [(int(starts[i] + query_lens[i] - 1), r.request_id) for i, r in enumerate(ordered) if r.pending_token]
    taken = [(slot, last_rows[rid]) for slot, rid in pending if rid in last_rows]

    # Every integer input of the step reaches the device in one copy.
    staged = StagedCopy()
    ids, pos, logits_rows = (staged.add(a) for a in (input_ids, positions, logits_indices))
    slots = [staged.add(a) for a in slot_mappings]
    n = len(decodes)
    rows = int(query_lens[:n].sum())  # decode rows: one per query token
    if decodes:
        width = max(len(r.block_ids) for r in decodes)
        tables = [staged.add(table[req_index[:rows], :width]) for table in block_tables]
        lens = staged.add(positions[:rows] + 1)
    # The backend stages what its prefill reads (one table per chunk, or Triton's one-launch PrefillBatch).
    context_lens = np.array([r.num_computed_tokens for r in prefills])
    layouts = [PrefillLayout(starts[n:], query_lens[n:], context_lens, table[n:],
                             [r.block_tables[g] for r in prefills])
               for g, table in enumerate(block_tables)]
    prefill = [backend.stage_prefills(staged, layout) for layout in layouts]
    if taken:
        destinations, sources = (staged.add(column) for column in zip(*taken))
    t = staged.send(device)

    if taken:
        t[ids][t[destinations]] = last_tokens[t[sources]]
    metas = [backend.build_metadata(t[slots[g]], rows, t[tables[g]] if decodes else None,
                                    t[lens] if decodes else None, layouts[g], [t[h] for h in prefill[g]])
             for g in range(num_kv_groups)]
    meta = metas[0]
    meta.kv_groups = metas[1:]
    prompt_logprobs = [(r, int(starts[i])) for i, r in enumerate(ordered)
                       if r.sampling_params.prompt_logprobs is not None
                       and r.num_computed_tokens < len(r.prompt_token_ids) - 1]
    missing = [rid for _, rid in pending if rid not in last_rows]
    pooling = [PoolingChunk(r.request_id, int(starts[i]), r.num_tokens, r.num_computed_tokens,
                            len(r.prompt_token_ids), r.pooling_params)
               for i, r in enumerate(ordered) if r.pooling_params is not None]
    lora = lora_manager.batch([r.lora_request for r in ordered], query_lens) if lora_manager else None
    return ModelInputs(t[ids], t[pos], meta, t[logits_rows], [ordered[i] for i in sampled_rows], prompt_logprobs,
                       missing, pooling, lora)
