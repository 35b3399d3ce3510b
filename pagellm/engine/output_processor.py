"""Turns engine Requests into user-facing RequestOutputs: one IncrementalDetokenizer per live request (created on
add, dropped on finish or abort), stop strings, finish reasons, and per-step streaming-safe text."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.engine.detokenizer import IncrementalDetokenizer
from pagellm.engine.request import Request
from pagellm.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)  # one per updated request
    # Requests a stop string ended that the engine core still runs: request id -> the matched string.
    stopped: dict[str, str] = field(default_factory=dict)


@dataclass(eq=False)
class _RequestState:
    request: Request
    detokenizer: IncrementalDetokenizer | None  # None with detokenize=False
    num_processed_tokens: int = 0  # output tokens already fed to the detokenizer
    stop_reason: str | None = None  # the stop string that ended it, once found
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)  # converted so far
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once complete


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, _RequestState] = {}

    def add_request(self, request: Request) -> None:
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer.from_params(self.tokenizer, params) if params.detokenize else None
        self.request_states[request.request_id] = _RequestState(request, detokenizer)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.request_states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def process_outputs(self, requests: list[Request], delta: bool = False) -> OutputProcessorOutput:
        """Feed each updated request's new tokens to its detokenizer and build its RequestOutput.

        Unfinished requests get the text that no later stop string can retract (cumulative, or with `delta`
        only what is new since the last call); finished ones get their whole final text. Requests a stop
        string ended are listed in `stopped` for the caller to finish in the engine core.
        """
        result = OutputProcessorOutput()
        for request in requests:
            state = self.request_states.get(request.request_id)
            if state is None:  # aborted meanwhile
                continue
            new_token_ids = request.output_token_ids[state.num_processed_tokens:]
            state.num_processed_tokens = request.num_output_tokens
            detokenizer = state.detokenizer
            if detokenizer is not None and state.stop_reason is None:
                stop_str = detokenizer.update(new_token_ids, finished=request.is_finished)
                if stop_str is not None:
                    # Any held-back partial character lies after the match, so it is cut with the rest.
                    state.stop_reason = stop_str
                    if not request.is_finished:
                        result.stopped[request.request_id] = stop_str
            finished = request.is_finished or state.stop_reason is not None
            result.request_outputs.append(self._make_output(state, finished, delta))
            if finished:
                del self.request_states[request.request_id]
        return result

    def _make_output(self, state: _RequestState, finished: bool, delta: bool) -> RequestOutput:
        request = state.request
        if state.stop_reason is not None:
            finish_reason, stop_reason = "stop", state.stop_reason
        else:
            finish_reason, stop_reason = request.finish_reason, request.stop_reason
        detokenizer = state.detokenizer
        text = detokenizer.get_next_output_text(finished, delta) if detokenizer is not None else ""
        params = request.sampling_params
        logprobs = cumulative = None
        if params.logprobs is not None:
            state.logprobs += [self._to_logprobs(e) for e in request.logprobs[len(state.logprobs):]]
            logprobs, cumulative = list(state.logprobs), request.cumulative_logprob
        if (params.prompt_logprobs is not None and state.prompt_logprobs is None
                and len(request.prompt_logprobs) >= request.num_prompt_tokens - 1):
            state.prompt_logprobs = [None] + [self._to_logprobs(e) for e in request.prompt_logprobs]
        completion = CompletionOutput(index=0, text=text, token_ids=list(request.output_token_ids),
                                      cumulative_logprob=cumulative, logprobs=logprobs,
                                      finish_reason=finish_reason if finished else None,
                                      stop_reason=stop_reason if finished else None)
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=finished,
                             prompt_logprobs=state.prompt_logprobs)

    def _to_logprobs(self, entry: tuple[list[int], list[float], list[int]]) -> dict[int, Logprob]:
        ids, values, ranks = entry
        texts = self.tokenizer.batch_decode([[t] for t in ids])
        return {t: Logprob(v, r, text) for t, v, r, text in zip(ids, values, ranks, texts)}
