"""Turns a SchedulerOutput into flat model inputs, runs the model over the paged cache, and samples.

Inputs are built on the CPU with NumPy (one vectorised pass for the slot mapping) and, on CUDA, staged in
pinned host buffers and copied with non_blocking=True.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagellm.config import ModelConfig
from pagellm.core.sched_output import ScheduledRequest, SchedulerOutput
from pagellm.model_executor.layers.attention import AttentionMetadata, PrefillChunk
from pagellm.model_executor.layers.sampler import Sampler, SamplingTensors
from pagellm.model_executor.model_loader.loader import load_model


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampled: list[ScheduledRequest]  # requests whose last token's logits are sampled, in logits order


class ModelRunner:
    def __init__(self, model_config: ModelConfig, block_size: int, device: torch.device) -> None:
        self.model_config = model_config
        self.block_size = block_size
        self.device = device
        self.model = None
        self.kv_caches: list[torch.Tensor] = []
        self.sampler = Sampler()
        self.generators: dict[str, torch.Generator] = {}

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.device)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    # ---- inputs ------------------------------------------------------------------------------------------
    def prepare_inputs(self, output: SchedulerOutput) -> ModelInputs:
        # Decodes (one query token) first: they share one batched attention call.
        decodes = [r for r in output.scheduled if r.num_tokens == 1]
        prefills = [r for r in output.scheduled if r.num_tokens != 1]
        ordered = decodes + prefills
        bs = self.block_size

        query_lens = np.array([r.num_tokens for r in ordered], dtype=np.int64)
        starts = np.concatenate(([0], np.cumsum(query_lens)[:-1]))
        num_tokens = int(query_lens.sum())
        req_index = np.repeat(np.arange(len(ordered)), query_lens)
        offsets = np.arange(num_tokens) - starts[req_index]
        positions = np.array([r.num_computed_tokens for r in ordered], dtype=np.int64)[req_index] + offsets
        max_blocks = max(len(r.block_ids) for r in ordered)
        block_table = np.zeros((len(ordered), max_blocks), dtype=np.int64)
        for i, r in enumerate(ordered):
            block_table[i, :len(r.block_ids)] = r.block_ids
        slot_mapping = block_table[req_index, positions // bs] * bs + positions % bs
        input_ids = np.fromiter((t for r in ordered for t in r.token_ids), dtype=np.int64, count=num_tokens)

        decode_tables = decode_seq_lens = decode_mask = None
        if decodes:
            n = len(decodes)
            decode_blocks = max(len(r.block_ids) for r in decodes)
            seq_lens = positions[:n] + 1
            decode_tables = self._to_device(np.ascontiguousarray(block_table[:n, :decode_blocks]))
            mask = np.arange(decode_blocks * bs)[None, :] < seq_lens[:, None]
            decode_mask = self._to_device(mask[None, :, None, :])
            decode_seq_lens = self._to_device(seq_lens)
        chunks = [
            PrefillChunk(query_start=int(starts[i]), query_len=r.num_tokens, context_len=r.num_computed_tokens,
                         block_ids=self._to_device(np.array(r.block_ids, dtype=np.int64)))
            for i, r in enumerate(ordered) if i >= len(decodes)
        ]
        sampled_rows = [i for i, r in enumerate(ordered) if r.needs_sample]
        logits_indices = starts[sampled_rows] + query_lens[sampled_rows] - 1
        meta = AttentionMetadata(self._to_device(slot_mapping), len(decodes), decode_tables, decode_seq_lens,
                                 decode_mask, chunks)
        return ModelInputs(self._to_device(input_ids), self._to_device(positions), meta,
                           self._to_device(logits_indices), [ordered[i] for i in sampled_rows])

    def sampling_tensors(self, requests: list[ScheduledRequest]) -> SamplingTensors:
        params = [r.sampling_params for r in requests]
        vocab = self.model_config.vocab_size
        top_k = [p.top_k if p.top_k > 0 else vocab for p in params]
        generators = {}
        for row, (request, p) in enumerate(zip(requests, params)):
            if p.seed is not None and not p.is_greedy:
                generator = self.generators.get(request.request_id)
                if generator is None:
                    generator = torch.Generator(self.device).manual_seed(p.seed)
                    self.generators[request.request_id] = generator
                generators[row] = generator
        return SamplingTensors(
            temperature=torch.tensor([0.0 if p.is_greedy else p.temperature for p in params],
                                     dtype=torch.float32, device=self.device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
            top_k=torch.tensor(top_k, dtype=torch.int64, device=self.device),
            all_greedy=all(p.is_greedy for p in params),
            needs_top_k=any(k < vocab for k in top_k),
            needs_top_p=any(p.top_p < 1.0 for p in params),
            generators=generators,
        )

    # ---- execution ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_req_ids:
            self.generators.pop(request_id, None)
        if output.is_empty:
            return ModelRunnerOutput({})
        inputs = self.prepare_inputs(output)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        if not inputs.sampled:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        tokens = self.sampler(logits, self.sampling_tensors(inputs.sampled)).tolist()
        return ModelRunnerOutput({r.request_id: t for r, t in zip(inputs.sampled, tokens)})
