"""Applies each SchedulerOutput to the worker's persistent InputBatch, turns the step's batch into flat model
inputs (worker/model_inputs.py), runs the model over the paged cache, and samples.

A request whose own work fails (its prompt logprobs, pooling or sampling: worker/isolated_outputs.py) is reported in
`ModelRunnerOutput.failed` and the rest of the batch keeps its results.

With async scheduling (see core/sched/async_scheduling.py) a step may be prepared before the previous step's sampled
tokens reach the host: the runner keeps each step's sampled tokens on the device for the next step's inputs, and
the step's own output is an `AsyncModelRunnerOutput` whose tokens are copied to the host behind its kernels.

Pooling requests (embeddings, scores) sample nothing: each of their chunks is pooled from the final-norm hidden
states (model_executor/layers/pooler.py) and returned in `ModelRunnerOutput.pooler_output`, on the rank that
samples, beside the sampled tokens of the rest of the batch.

A step with sequences that sample under a grammar is run in two calls on the rank that samples (vLLM's split):
`execute_model` runs the forward pass and keeps the logits, while the engine computes the grammar bitmask;
`sample_tokens` masks the constrained rows with it and samples. Other ranks never sample (their results are not
read), so they never wait for a bitmask.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagellm.config import LoRAConfig, ModelConfig
from pagellm.core.kv.kv_cache_groups import KVCacheGroup, layer_positions
from pagellm.core.sched.output import GrammarOutput, SchedulerOutput
from pagellm.logger import init_logger
from pagellm.lora.context import lora_batch
from pagellm.lora.worker_manager import LoRAWorkerManager
from pagellm.model_executor.layers.attention import AttentionBackend, assign_kv_groups, select_backend
from pagellm.model_executor.model_loader.loader import load_model
from pagellm.outputs import LogprobsEntry
from pagellm.worker.async_output import AsyncModelRunnerOutput
from pagellm.worker.cuda_graphs import Capture, DecodeGraphs
from pagellm.worker.input_batch import BatchedRequest, InputBatch, attach_grammar_bitmask
from pagellm.worker.isolated_outputs import BatchSampler, compute_prompt_logprobs, pool
from pagellm.worker.model_inputs import ModelInputs, build_model_inputs

logger = init_logger(__name__)


@dataclass
class ModelRunnerOutput:
    # request id -> its sampled tokens: one, or `num_samples` for the first sample of an n > 1 request.
    sampled_token_ids: dict[str, list[int]]
    # request id -> one logprobs entry per sampled token, for requests that asked.
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # request id -> (index of the first entry, entries): prompt logprobs of this step's prefill chunk.
    prompt_logprobs: dict[str, tuple[int, list]] = field(default_factory=dict)
    # request id -> why its part of the step failed (it gets no results; the engine fails it alone).
    failed: dict[str, str] = field(default_factory=dict)
    # seconds spent in prepare_inputs, forward (model, logits, prompt logprobs) and sample
    phase_seconds: dict[str, float] = field(default_factory=dict)
    # request id -> its chunk's pooled contribution (float32), for pooling requests (see layers/pooler.py).
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)
    # request id -> the draft made for its placeholder slots (speculative method draft_model, see the worker).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class ForwardResult:
    """A step's results before sampling: what `sample_tokens` needs when the step waits for its grammar bitmask."""

    sampled: list[BatchedRequest]  # one per logits row
    logits: torch.Tensor
    prompt_logprobs: dict[str, tuple[int, list]]
    failed: dict[str, str]
    phase_seconds: dict[str, float]
    # Async scheduling: each logits row's last input token, on the device (the pending ones are known only there),
    # when a row has one pending.
    last_inputs: torch.Tensor | None = None
    pooler_output: dict[str, np.ndarray] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, block_size: int, device: torch.device,
                 samples: bool = True, async_output: bool = False, lora_config: LoRAConfig | None = None,
                 kv_groups: list[KVCacheGroup] | None = None) -> None:
        """`kv_groups`: the model's KV cache groups (core/kv/kv_cache_groups.py; None: one group of every layer)."""
        self.model_config = model_config
        self.kv_groups = kv_groups
        self.num_kv_groups = len(kv_groups) if kv_groups else 1
        self.lora_config = lora_config
        self.lora_manager: LoRAWorkerManager | None = None  # with --enable-lora, once the model is loaded
        self.block_size = block_size
        self.device = device
        self.samples = samples  # False on ranks whose results nobody reads: they stop after the logits
        self.async_output = async_output  # return AsyncModelRunnerOutput (async scheduling)
        # The last step's sampled tokens on the device, and each request's row in them (its first sample).
        self._last_sampled: tuple[torch.Tensor, dict[str, int]] | None = None
        # The step whose sampling waits for its grammar bitmask, with the constrained request ids.
        self._awaiting_grammar: tuple[ForwardResult, list[str]] | None = None
        self.model: torch.nn.Module | None = None
        # The attention backend the step's metadata is built for: picked once, with the model (its device and dtype).
        self.attn_backend: AttentionBackend | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.batch_sampler: BatchSampler | None = None  # made with the model
        self.input_batch = InputBatch()

    def load_model(self) -> None:
        self.model = load_model(self.model_config, self.device)
        self.attn_backend = select_backend(self.device, self.model_config.dtype)
        self.batch_sampler = BatchSampler(self.model_config.vocab_size, self.device)
        if self.num_kv_groups > 1:
            assign_kv_groups(self.model, {layer: g for layer, (g, _) in layer_positions(self.kv_groups).items()})
        if self.lora_config is not None and self.lora_config.enable_lora:
            self.lora_manager = LoRAWorkerManager(self.lora_config, self.model, self.model_config.hf_config,
                                                  self.device)
        logger.info("Model weights: %.1f MB (quantization: %s).", self.weight_bytes() / 1e6,
                    self.model_config.quantization)

    @torch.inference_mode()
    def capture_decode_graphs(self, max_batch: int, scratch_block: int, capture: Capture | None = None) -> None:
        """Capture the decode forward for batches of up to `max_batch` sequences over the current KV cache, whose
        block `scratch_block` no request owns (padding rows write there)."""
        max_blocks = -(-self.model_config.max_model_len // self.block_size)
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, max_batch, max_blocks, self.block_size,
                                          scratch_block, self.device, capture)

    def forget_requests(self) -> None:
        """Drop every sequence's state (after the profiling run)."""
        self.input_batch = InputBatch()
        self._last_sampled = None

    def weight_bytes(self) -> int:
        """Bytes of the weight matrices as stored (packed or float): what one decode step streams from memory."""
        tensors = [*self.model.named_parameters(), *self.model.named_buffers()]
        return sum(t.nbytes for name, t in tensors if t.dim() == 2 and "rotary_emb" not in name)

    # ---- inputs ------------------------------------------------------------------------------------------
    def prepare_inputs(self, batch: list[BatchedRequest]) -> ModelInputs:
        """The step's flat inputs (worker/model_inputs.py). Async scheduling: the previous step's sampled tokens are
        taken by this step whether it needs them or not: a step that fails before sampling leaves none behind, so no
        later step can read stale tokens."""
        assert self.attn_backend is not None, "load_model() picks the attention backend"
        last_sampled, self._last_sampled = self._last_sampled, None
        return build_model_inputs(batch, self.block_size, self.num_kv_groups, self.attn_backend, self.device,
                                  self.lora_manager, last_sampled)

    # ---- execution ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, output: SchedulerOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput | None:
        """Run the step and sample; None when this rank samples sequences under a grammar: their bitmask is still
        being computed, and `sample_tokens` finishes the step."""
        start = time.perf_counter()
        batch = self.input_batch.update(output)
        if not batch:
            return ModelRunnerOutput({})
        inputs = self.prepare_inputs(batch)
        prepared = time.perf_counter()
        hidden = self._forward(inputs)
        if hidden is None:  # a pipeline stage before the last: it sent its activations on, the last one samples
            return ModelRunnerOutput({}, phase_seconds={"prepare_inputs": prepared - start,
                                                        "forward": time.perf_counter() - prepared})
        failed = dict.fromkeys(inputs.missing_pending, "The previous step sampled no token for this request.")
        prompt_logprobs = (compute_prompt_logprobs(self.model.compute_logits, hidden, inputs.prompt_logprobs,
                                                   self.device, failed) if inputs.prompt_logprobs else {})
        # Every tensor-parallel rank pools (classify rows compute logits, gathered across the ranks); the rank that
        # samples returns the vectors.
        pooled = pool(self.model.compute_logits, hidden, inputs.pooling, failed) if inputs.pooling else {}
        # Every tensor-parallel rank computes the logits (they are gathered across the ranks).
        logits = self.model.compute_logits(hidden[inputs.logits_indices]) if inputs.sampled else None
        phases = {"prepare_inputs": prepared - start, "forward": time.perf_counter() - prepared}
        if logits is None or not self.samples:
            return ModelRunnerOutput({}, prompt_logprobs=prompt_logprobs, failed=failed, phase_seconds=phases,
                                     pooler_output=pooled if self.samples else {})
        last_inputs = (inputs.input_ids[inputs.logits_indices] if any(r.pending_token for r in inputs.sampled)
                       else None)
        step = ForwardResult(inputs.sampled, logits, prompt_logprobs, failed, phases, last_inputs, pooled)
        if output.structured_output_request_ids:
            self._awaiting_grammar = (step, output.structured_output_request_ids)
            return None
        return self._sample_step(step)

    def _forward(self, inputs: ModelInputs) -> torch.Tensor | None:
        graphs, meta = self.decode_graphs, inputs.meta
        # A step with LoRA rows runs eagerly: the graphs hold the base model only.
        graphs = graphs if inputs.lora is None else None
        bucket = graphs.bucket(meta.num_decodes) if graphs is not None and not meta.prefills else None
        if bucket is not None:
            return graphs.run(bucket, inputs.input_ids, inputs.positions, meta)
        with lora_batch(inputs.lora):
            return self.model(inputs.input_ids, inputs.positions, self.kv_caches, meta)

    @torch.inference_mode()
    def sample_tokens(self, grammar: GrammarOutput) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        """Finish the step `execute_model` left waiting: its constrained rows masked by `grammar`, then sampled. If
        the bitmask could not be computed, the constrained requests fail alone."""
        if self._awaiting_grammar is None:
            raise RuntimeError("sample_tokens was called, but no step waits for a grammar bitmask.")
        (step, request_ids), self._awaiting_grammar = self._awaiting_grammar, None
        if grammar.error is not None:
            logger.error("%s; the step's %d constrained requests fail.", grammar.error, len(request_ids))
            step.failed.update(dict.fromkeys(request_ids, grammar.error))
        else:
            attach_grammar_bitmask(step.sampled, request_ids, grammar.grammar_bitmask)
        return self._sample_step(step)

    def _sample_step(self, step: ForwardResult) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        start = time.perf_counter()
        assert self.batch_sampler is not None, "load_model() makes the sampler"
        rows, tokens, entries = self.batch_sampler.sample(step.logits, step.sampled, step.failed, step.last_inputs)
        row_of: dict[str, int] = {}
        for i, row in enumerate(rows):
            row_of.setdefault(step.sampled[row].request_id, i)
        self._last_sampled = (tokens, row_of)
        phases = {**step.phase_seconds, "sample": time.perf_counter() - start}

        def finish(token_ids: list[int]) -> ModelRunnerOutput:
            sampled: dict[str, list[int]] = {}
            logprobs: dict[str, list[LogprobsEntry]] = {}
            for row, token, entry in zip(rows, token_ids, entries):  # rows ascend: n > 1 samples stay in order
                request_id = step.sampled[row].request_id
                sampled.setdefault(request_id, []).append(token)
                if entry is not None:
                    logprobs.setdefault(request_id, []).append(entry)
            return ModelRunnerOutput(sampled, logprobs, step.prompt_logprobs, step.failed, phases, step.pooler_output)

        return AsyncModelRunnerOutput(tokens, finish) if self.async_output else finish(tokens.tolist())
