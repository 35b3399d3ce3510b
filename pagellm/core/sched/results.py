"""Applying a step's results to its requests: computed tokens, prompt logprobs, the sampled tokens with their
logprobs and grammar advances, forks (n > 1 at the first sample; beams chosen more than once) and stop conditions;
for a pooling request, its chunk's pooled contribution, and its finish once the whole prompt is computed.

Each request, and each beam group once all its beams have their candidates, is updated on its own: an exception
fails that group alone (`Scheduler.update_from_output` fails it). Requests change queues only through the
transitions of RequestQueues (queues.py): a fork joins `running` right after its parent (`fork`), a sequence that
stops leaves it (`finish`).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.output import ScheduledRequest, SchedulerOutput
from pagellm.core.sched.queues import RequestQueues
from pagellm.exceptions import failure_reason
from pagellm.logger import init_logger
from pagellm.spec_decode.adaptive import AdaptiveDrafter
from pagellm.spec_decode.metrics import SpecDecodingStats
from pagellm.spec_decode.verify import num_accepted

logger = init_logger(__name__)


class ResultApplier:
    def __init__(self, max_model_len: int, queues: RequestQueues, kv_cache_manager: KVCacheManager,
                 drafter: AdaptiveDrafter | None = None) -> None:
        self.max_model_len = max_model_len
        self.queues = queues
        self.kv_cache_manager = kv_cache_manager
        self.spec_stats = SpecDecodingStats()
        self.drafter = drafter  # speculative decoding: told how each draft fared (it sets draft lengths)

    def apply(self, output: SchedulerOutput, sampled: dict[str, list[int]], logprobs: dict[str, list] | None,
              prompt_logprobs: dict | None, errors: dict[str, str],
              pooled: dict[str, np.ndarray] | None = None,
              drafts: dict[str, list[int]] | None = None) -> tuple[list[Request], list[BeamGroup]]:
        """Apply each scheduled request's results, then advance the beam groups whose beams all have their
        candidates; returns (sequences that got a token or finished pooling, beam groups that finished). `errors`
        (group id -> why) holds the groups that already failed, which are skipped; a request or group whose update
        raises is added to it. `pooled`: request id -> its chunk's pooled contribution. `drafts`: request id -> the
        draft the worker made for its placeholders (speculative method draft_model, spec_decode/draft_model.py)."""
        updated: list[Request] = []
        finished_groups: list[BeamGroup] = []
        ready_groups: dict[str, BeamGroup] = {}
        for scheduled in output.scheduled:
            request = self.queues.requests.get(scheduled.request_id)
            if request is None or request.group_id in errors:  # aborted while the step ran, or its group failed
                continue
            try:
                if request.pooling_params is not None:
                    updated += self._update_pooling(request, scheduled, pooled or {})
                    continue
                if scheduled.spec_token_ids and drafts and request.request_id in drafts:
                    scheduled = dataclasses.replace(scheduled, spec_token_ids=drafts[request.request_id])
                updated += self._update_request(request, scheduled, sampled, logprobs, prompt_logprobs)
            except Exception as exc:
                logger.exception("Updating request %s failed; it fails alone.", request.request_id)
                errors[request.group_id] = failure_reason(exc)
                continue
            if request.beam_group is not None and request.beam_group.ready:
                ready_groups[request.group_id] = request.beam_group
        for group_id, group in ready_groups.items():
            if group_id in errors:
                continue
            try:
                if self._advance_beams(group):
                    finished_groups.append(group)
            except Exception as exc:
                logger.exception("Advancing beam search %s failed; it fails alone.", group_id)
                errors[group_id] = failure_reason(exc)
        return updated, finished_groups

    def _update_request(self, request: Request, scheduled: ScheduledRequest, sampled: dict[str, list[int]],
                        logprobs: dict[str, list] | None, prompt_logprobs: dict | None) -> list[Request]:
        """Apply one scheduled request's results; returns its sequences that got a token (several when it
        forks)."""
        request.num_step_tokens = 1
        if scheduled.spec_token_ids:
            return self._accept_draft(request, scheduled, sampled[request.request_id],
                                      (logprobs or {}).get(request.request_id))
        request.num_computed_tokens += scheduled.num_tokens
        self.kv_cache_manager.cache_full_blocks(request)
        if prompt_logprobs and request.request_id in prompt_logprobs:
            first, entries = prompt_logprobs[request.request_id]
            have = len(request.prompt_logprobs)
            if first <= have:
                request.prompt_logprobs.extend(entries[have - first:])
        if not scheduled.needs_sample:
            return []
        entries = (logprobs or {}).get(request.request_id) or [None] * scheduled.num_samples
        if request.beam_group is not None:
            ids, values, _ = entries[0]
            request.beam_candidates = (ids[1:], values[1:])  # the top-k, after the sampled (argmax) token
            return []
        tokens = sampled[request.request_id]
        sequences = [request] + self._fork_samples(request, len(tokens) - 1)
        for sequence, token, entry in zip(sequences, tokens, entries):
            if entry is not None:
                sequence.logprobs.append(entry)
                sequence.cumulative_logprob += entry[1][0]
            structured = sequence.structured_output_request
            if structured is not None:  # raises, failing the request, before the token is kept
                structured.accept_token(sequence.output_token_ids, token)
            sequence.append_output_token(token)
            status = check_stop(sequence, self.max_model_len)
            if status is not None:
                self.queues.finish(sequence, status)
        return sequences

    def _accept_draft(self, request: Request, scheduled: ScheduledRequest, tokens: list[int],
                      entries: list | None) -> list[Request]:
        """Speculative decoding: `tokens` holds the token sampled at each of the 1 + k positions. Draft tokens are
        kept while they equal the samples, and the sample after them comes with them (rejection sampling, see
        spec_decode/verify.py); a grammar advances over each token emitted. Emission stops at a stop condition
        (a completed grammar among them). The K/V of rejected positions is dropped by moving `num_computed_tokens`
        back (their slots are overwritten later; the blocks stay with the request, which writes them next)."""
        draft = scheduled.spec_token_ids
        num_kept = num_accepted(draft, tokens)
        self.spec_stats.observe(len(draft), num_kept)
        if self.drafter is not None:
            self.drafter.observe(request, len(draft), num_kept)
        # Computed: the step's first input (the last known token) and the accepted draft tokens.
        num_computed = scheduled.num_computed_tokens + scheduled.num_tokens - len(draft) + num_kept
        request.num_step_tokens = 0
        structured = request.structured_output_request
        for index, token in enumerate(tokens[:num_kept + 1]):
            if structured is not None:  # each token was sampled under its position's bitmask row
                structured.accept_token(request.output_token_ids, token)
            request.num_step_tokens += 1
            if entries is not None:
                request.logprobs.append(entries[index])
                request.cumulative_logprob += entries[index][1][0]
            request.append_output_token(token)
            status = check_stop(request, self.max_model_len)
            if status is not None:
                self.queues.finish(request, status)
                return [request]
        request.num_computed_tokens = num_computed
        self.kv_cache_manager.cache_full_blocks(request)
        return [request]

    def _update_pooling(self, request: Request, scheduled: ScheduledRequest,
                        pooled: dict[str, np.ndarray]) -> list[Request]:
        """Add the chunk's pooled contribution (contributions sum to the pooled vector); once the whole prompt is
        computed the request finishes, its blocks freed (those it filled stay in the prefix cache)."""
        request.num_computed_tokens += scheduled.num_tokens
        self.kv_cache_manager.cache_full_blocks(request)
        part = pooled.get(request.request_id)
        if part is not None:
            request.pooled_data = part if request.pooled_data is None else request.pooled_data + part
        if request.num_computed_tokens < request.num_prompt_tokens:
            return []
        if request.pooled_data is None:
            raise RuntimeError(f"The worker returned no pooled output for request {request.request_id}.")
        self.queues.finish(request, RequestStatus.FINISHED_STOPPED)
        return [request]

    def _fork_samples(self, request: Request, num_forks: int) -> list[Request]:
        """n > 1: sequences 1..n-1 of `request`, sharing its blocks, running right after it. With a seed, sequence
        i continues from seed + i."""
        params = request.sampling_params
        children = []
        for index in range(1, num_forks + 1):
            seed = None if params.seed is None else params.seed + index
            children.append(request.fork(f"{request.group_id}/{index}", index,
                                         dataclasses.replace(params, n=1, seed=seed)))
        self.queues.fork(request, children)
        return children

    def _advance_beams(self, group: BeamGroup) -> bool:
        """Apply the group's choice: beams chosen k times fork k - 1 copies, beams not chosen are freed. True when
        that finished the group (all its beams are freed)."""
        choices = group.select()
        by_parent: dict[Request, list] = {}
        for choice in choices:
            by_parent.setdefault(choice.parent, []).append(choice)
        for beam in group.beams:
            beam.beam_candidates = None
            if beam not in by_parent:
                self.queues.finish(beam, RequestStatus.FINISHED_ABORTED)
        beams = []
        for parent, picks in by_parent.items():
            # Forks copy the parent's tokens, so they are made before the parent takes its own next token.
            for choice in picks[1:]:
                child = parent.fork(group.next_beam_id(), 0)
                self.queues.fork(parent, [child])
                child.append_output_token(choice.token_id)
                child.cumulative_logprob = choice.cum_logprob
                beams.append(child)
            parent.append_output_token(picks[0].token_id)
            parent.cumulative_logprob = picks[0].cum_logprob
            beams.append(parent)
        beams.sort(key=lambda b: b.cumulative_logprob, reverse=True)
        group.beams = beams
        if not group.is_done(self.max_model_len):
            return False
        for beam in beams:
            self.queues.finish(beam, RequestStatus.FINISHED_LENGTH)
        group.finish()
        return True


def check_stop(request: Request, max_model_len: int) -> RequestStatus | None:
    """How the request finishes after its newest token, if it does; a stop also sets its `stop_reason`."""
    token = request.output_token_ids[-1]
    params = request.sampling_params
    if not params.ignore_eos and token in request.eos_token_ids:
        request.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    if token in params.stop_token_ids:
        request.stop_reason = token
        return RequestStatus.FINISHED_STOPPED
    structured = request.structured_output_request
    if structured is not None and structured.grammar.is_terminated():  # the output is complete
        request.stop_reason = None
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
