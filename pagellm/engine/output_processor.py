"""Turns the engine core's per-step snapshots (EngineCoreOutput) into user-facing RequestOutputs: one
IncrementalDetokenizer per sequence (created on add or when a request forks into n sequences, dropped on finish
or abort), stop strings, finish reasons, logprobs, and per-step streaming-safe text. A pooling request gets one
PoolingRequestOutput, when it finishes, with its vector truncated and normalised (`finish_pooled`).

It reads no live engine state, so it can run in another thread than the engine core. A request whose output
cannot be built (say, its detokenization raises) is dropped and reported in `failed`; the others go on."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagellm.core.request import Request
from pagellm.engine.core_output import EngineCoreOutput
from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.logger import init_logger
from pagellm.model_executor.layers.pooler import finish_pooled
from pagellm.outputs import CompletionOutput, Logprob, LogprobsEntry, PoolingOutput, PoolingRequestOutput, RequestOutput
from pagellm.pooling_params import PoolingParams
from pagellm.sampling_params import SamplingParams

logger = init_logger(__name__)


@dataclass
class OutputProcessorOutput:
    # One per request with news (a pooling request's one output, when it finishes).
    request_outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    # Sequences a stop string ended that the engine core still runs: sequence id -> the matched string.
    stopped: dict[str, str] = field(default_factory=dict)
    # Requests whose outputs could not be built: request id -> why. Their state is gone; the caller aborts them
    # in the engine core and reports the error.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class _SequenceState:
    index: int
    detokenizer: IncrementalDetokenizer | None  # None with detokenize=False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    num_sent_tokens: int = 0  # delta mode: tokens (and logprobs) already returned
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    last_output: CompletionOutput | None = None  # the latest cumulative completion, for n > 1 outputs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: dict[int, _SequenceState] = field(default_factory=dict)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens: int | None = None

    @property
    def finished(self) -> bool:
        return len(self.sequences) == self.params.n and all(s.finished for s in self.sequences.values())


@dataclass(eq=False)
class _PoolingState:
    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, _RequestState | _PoolingState] = {}

    def add_request(self, request: Request) -> None:
        if request.pooling_params is not None:
            self.request_states[request.request_id] = _PoolingState(
                request.request_id, request.prompt_token_ids, request.pooling_params)
            return
        self.request_states[request.request_id] = _RequestState(
            request.request_id, request.prompt, request.prompt_token_ids, request.sampling_params)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, outputs: list[EngineCoreOutput], delta: bool = False) -> OutputProcessorOutput:
        """Feed each sequence's new tokens to its detokenizer and build one RequestOutput per request with news.

        Unfinished sequences get the text no later stop string can retract (cumulative, or with `delta` only what
        is new since the last call: text, token ids and logprobs); finished ones get their whole final text. A
        request is finished when all of its n sequences are. Sequences a stop string ended are listed in
        `stopped` for the caller to finish in the engine core.
        """
        result = OutputProcessorOutput()
        touched: dict[str, list[_SequenceState]] = {}
        for output in outputs:
            state = self.request_states.get(output.group_id)
            if state is None or state.request_id in result.failed:  # aborted meanwhile, or failed this step
                continue
            if isinstance(state, _PoolingState):
                self._finish_pooling(state, output, result)
                continue
            try:
                sequence = self._apply(state, output, result)
            except Exception as exc:
                self._fail(state.request_id, exc, result)
                continue
            if sequence is not None:
                touched.setdefault(state.request_id, []).append(sequence)
        for request_id, sequences in touched.items():
            state = self.request_states.get(request_id)
            if not isinstance(state, _RequestState):
                continue
            try:
                result.request_outputs.append(self._make_output(state, sequences, delta))
            except Exception as exc:
                self._fail(request_id, exc, result)
                continue
            if state.finished:
                del self.request_states[request_id]
        return result

    def _finish_pooling(self, state: _PoolingState, output: EngineCoreOutput, result: OutputProcessorOutput) -> None:
        try:
            if output.pooled_data is None:
                raise RuntimeError("the engine finished the pooling request without its pooled vector")
            data = torch.from_numpy(finish_pooled(output.pooled_data, state.params))
        except Exception as exc:
            self._fail(state.request_id, exc, result)
            return
        del self.request_states[state.request_id]
        result.request_outputs.append(PoolingRequestOutput(state.request_id, PoolingOutput(data),
                                                           state.prompt_token_ids, True, output.num_cached_tokens))

    def _apply(self, state: _RequestState, output: EngineCoreOutput,
               result: OutputProcessorOutput) -> _SequenceState | None:
        """One sequence's news; returns the sequence, or None when a stop string already ended it."""
        sequence = state.sequences.get(output.index)
        if sequence is None:
            sequence = self._add_sequence(state, output.index)
        if sequence.finished:  # stopped by a stop string; the core had one more step in flight
            return None
        state.num_cached_tokens = output.num_cached_tokens
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = [None] + [self._to_logprobs(e) for e in output.prompt_logprobs]
        self._update_sequence(sequence, output, result)
        return sequence

    def _fail(self, request_id: str, exc: Exception, result: OutputProcessorOutput) -> None:
        logger.error("Building the output of request %s failed; it fails alone.", request_id, exc_info=exc)
        result.failed[request_id] = f"{type(exc).__name__}: {exc}"
        del self.request_states[request_id]

    def _add_sequence(self, state: _RequestState, index: int) -> _SequenceState:
        params = state.params
        detokenizer = IncrementalDetokenizer.from_params(self.tokenizer, params) if params.detokenize else None
        state.sequences[index] = sequence = _SequenceState(index, detokenizer)
        return sequence

    def _update_sequence(self, sequence: _SequenceState, output: EngineCoreOutput,
                         result: OutputProcessorOutput) -> None:
        sequence.token_ids += output.new_token_ids
        if output.new_logprobs is not None:
            sequence.logprobs += [self._to_logprobs(e) for e in output.new_logprobs]
            sequence.cumulative_logprob += sum(e[1][0] for e in output.new_logprobs)
        sequence.finish_reason, sequence.stop_reason = output.finish_reason, output.stop_reason
        if sequence.detokenizer is not None:
            stop_str = sequence.detokenizer.update(output.new_token_ids, finished=output.finish_reason is not None)
            if stop_str is not None:
                # Any held-back partial character lies after the match, so it is cut with the rest.
                if output.finish_reason is None:
                    result.stopped[output.request_id] = stop_str
                sequence.finish_reason, sequence.stop_reason = "stop", stop_str

    def _make_output(self, state: _RequestState, sequences: list[_SequenceState], delta: bool) -> RequestOutput:
        for sequence in sequences:
            sequence.last_output = self._completion(state, sequence, delta)
        if delta:
            completions = [s.last_output for s in sequences]
            prompt_logprobs = None if state.prompt_logprobs_sent else state.prompt_logprobs
        else:
            completions = [state.sequences[i].last_output for i in sorted(state.sequences)]
            prompt_logprobs = state.prompt_logprobs
        state.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(request_id=state.request_id, prompt=state.prompt,
                             prompt_token_ids=state.prompt_token_ids, outputs=completions, finished=state.finished,
                             prompt_logprobs=prompt_logprobs, num_cached_tokens=state.num_cached_tokens)

    def _completion(self, state: _RequestState, sequence: _SequenceState, delta: bool) -> CompletionOutput:
        finished = sequence.finished
        detokenizer = sequence.detokenizer
        text = detokenizer.get_next_output_text(finished, delta) if detokenizer is not None else ""
        start = sequence.num_sent_tokens if delta else 0
        sequence.num_sent_tokens = len(sequence.token_ids)
        wants_logprobs = state.params.logprobs is not None
        return CompletionOutput(index=sequence.index, text=text, token_ids=sequence.token_ids[start:],
                                cumulative_logprob=sequence.cumulative_logprob if wants_logprobs else None,
                                logprobs=sequence.logprobs[start:] if wants_logprobs else None,
                                finish_reason=sequence.finish_reason if finished else None,
                                stop_reason=sequence.stop_reason if finished else None)

    def _to_logprobs(self, entry: LogprobsEntry) -> dict[int, Logprob]:
        ids, values, ranks = entry
        texts = self.tokenizer.batch_decode([[t] for t in ids])
        return {t: Logprob(v, r, text) for t, v, r, text in zip(ids, values, ranks, texts)}
