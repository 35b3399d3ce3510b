"""Speculative method `draft_model`, the worker's side: a smaller model (or the target's own quantized file) drafts
greedily at the start of each step, into the placeholder slots the scheduler reserved (spec_decode/draft_model.py).

The draft model has its own KV cache tensors, with as many blocks as the target's and addressed by the same block
tables and slots, so it needs no allocator of its own (the worker's KV budget counts both models' bytes per block).
The draft computes each prompt chunk beside the target (in the same step, so under its token budget) and a decoding
request's tokens only when it drafts. `valid` tracks, per request, how many leading positions hold draft K/V of the
request's own tokens; each drafting step first runs the draft over the tokens after them up to the last known one
(the catch-up: the last sample, and the last draft when all were kept, or the tokens decoded since the request last
drafted; the whole prompt after a prefix-cache hit), which gives the first draft token, then k - 1 one-token decode
steps, the step's drafting requests and prompt chunks batched together. Positions of
rejected drafts are rewritten later, since `valid` never passes a request's computed tokens. A request the worker
is sent in full (new, forked, resumed after preemption) starts again at 0, so blocks shared through the prefix cache
or a fork are only ever rewritten with the same tokens' K/V; copy-on-write copies apply to the draft's cache too.

Drafts are the draft model's argmax: deterministic, so the target's verification (spec_decode/verify.py) keeps the
target's distribution at any temperature.
"""
from __future__ import annotations

import dataclasses

import torch

from pagellm.config import CacheConfig, ModelConfig
from pagellm.core.sched.output import SchedulerOutput
from pagellm.sampling_params import SamplingParams
from pagellm.worker.cache_engine import CacheEngine, kv_bytes_per_block
from pagellm.worker.input_batch import BatchedRequest
from pagellm.worker.model_runner import ModelRunner

MAX_DECODE_ROWS = 8  # the longest catch-up run as decode rows


class DraftModelProposer:
    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, device: torch.device) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.device = device
        # The draft's own runner: its model, its attention backend and input preparation; its InputBatch mirrors
        # the target's from the same SchedulerOutputs (tokens and block tables).
        self.runner = ModelRunner(model_config, cache_config.block_size, device, samples=False)
        self.cache: CacheEngine | None = None
        self.valid: dict[str, int] = {}  # request id -> leading positions whose draft K/V is the request's own
        self._params = SamplingParams(temperature=0.0)  # the runner's inputs want one; the draft takes the argmax

    def load_model(self) -> None:
        self.runner.load_model()

    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.cache_config)

    def attach_cache(self, num_blocks: int) -> None:
        self.cache = CacheEngine(self.model_config, self.cache_config, num_blocks, self.device)
        self.runner.kv_caches = self.cache.kv_caches

    def copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """The step's copy-on-write copies, in the draft's cache."""
        if self.cache is not None and blocks_to_copy:
            self.cache.copy_blocks(blocks_to_copy)

    @torch.inference_mode()
    def propose(self, output: SchedulerOutput) -> tuple[SchedulerOutput, dict[str, list[int]]]:
        """Apply the step's diffs to the draft's view of the sequences and fill every placeholder draft; returns
        the step as the target runs it (the drafts in place of the placeholders) and the drafts by request id."""
        for request_id in (*output.finished_req_ids, *output.preempted_req_ids):
            self.valid.pop(request_id, None)
        for data in output.new_requests:
            self.valid[data.request_id] = 0
        batch = self.runner.input_batch.update(output)
        for request in batch:  # positions past the computed ones may hold rejected drafts' K/V
            self.valid[request.request_id] = min(self.valid.get(request.request_id, 0), request.num_computed_tokens)
        drafting = [r for r in batch if r.num_spec_tokens]
        # Prompt chunks (not plain decodes) of requests whose draft K/V is in step: the draft computes them beside
        # the target, so its prompt's K/V is written under the step's token budget, not as one long catch-up
        # inside a later decode step (vLLM's draft model also runs over every prompt chunk).
        following = [r for r in batch if not r.num_spec_tokens and r.pooling_params is None
                     and (r.num_tokens > 1 or not r.needs_sample) and self.valid[r.request_id] == r.num_computed_tokens]
        if not drafting and not following:
            return output, {}
        drafts = self._draft(drafting, following)
        if not drafts:
            return output, {}
        scheduled = [dataclasses.replace(s, spec_token_ids=drafts[s.request_id]) if s.request_id in drafts else s
                     for s in output.scheduled]
        return dataclasses.replace(output, scheduled=scheduled), drafts

    def _draft(self, requests: list[BatchedRequest], following: list[BatchedRequest]) -> dict[str, list[int]]:
        """`num_spec_tokens` greedy draft tokens for each of `requests`, after its tokens up to
        num_computed_tokens; the first forward pass also computes the `following` prompt chunks."""
        states = self.runner.input_batch.requests
        drafts: dict[str, list[int]] = {r.request_id: [] for r in requests}
        wanted = {r.request_id: r.num_spec_tokens for r in requests}
        rows = [BatchedRequest(r.request_id, r.token_ids, r.num_computed_tokens, r.block_ids, self._params,
                               needs_sample=False) for r in following]
        for r in requests:  # the catch-up: the draft's missing positions, through the last known token
            begin, last = self.valid[r.request_id], r.num_computed_tokens
            # A short one (after a verify step) runs as decode rows, one per token, as a verify step does: the CPU's
            # fused decode step, not the prefill path (2 tokens: 13 vs 33 ms on the default model's Q4_1 file).
            # Every row then gets logits; the last is the draft's.
            num_tokens = last + 1 - begin
            rows.append(BatchedRequest(r.request_id, states[r.request_id].all_token_ids[begin:last + 1], begin,
                                       r.block_ids, self._params, needs_sample=True,
                                       num_spec_tokens=num_tokens - 1 if num_tokens <= MAX_DECODE_ROWS else 0))
        for r in following:
            self.valid[r.request_id] = r.num_computed_tokens + r.num_tokens
        while rows:
            tokens = self._argmax(rows)
            next_rows = []
            for row in rows:
                if not row.needs_sample:
                    continue
                draft = drafts[row.request_id]
                draft.append(tokens[row.request_id])
                if len(draft) < wanted[row.request_id]:
                    position = row.num_computed_tokens + row.num_tokens
                    next_rows.append(BatchedRequest(row.request_id, [draft[-1]], position, row.block_ids,
                                                    self._params, needs_sample=True))
            rows = next_rows
        for r in requests:  # written: the catch-up and the k - 1 decode steps' inputs
            self.valid[r.request_id] = r.num_computed_tokens + r.num_spec_tokens
        return drafts

    def _argmax(self, rows: list[BatchedRequest]) -> dict[str, int]:
        """One forward pass of the draft over `rows`, writing their K/V; each sampling row's next token, greedily."""
        runner = self.runner
        inputs = runner.prepare_inputs(rows)
        hidden = runner.model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta)
        if not inputs.sampled:
            return {}
        tokens = runner.model.compute_logits(hidden[inputs.logits_indices]).argmax(dim=-1).tolist()
        # A request's rows come in order: its last row's token is kept.
        return {request.request_id: token for request, token in zip(inputs.sampled, tokens)}
