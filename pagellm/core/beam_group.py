"""Beam search in the engine: a BeamGroup owns the live beams of one prompt (ordinary Requests whose KV blocks
are shared through forks) and decides, once every live beam has sampled its candidates, which beams continue.

Each beam samples greedily with `logprobs = 2 * beam_width`: the top tokens of the raw log-softmax are its
candidates. The beam then waits with nothing to compute until its siblings have theirs; `select` ranks every
(beam, token) pair by cumulative logprob, sets finished (EOS) candidates aside and returns the best
`beam_width` to continue. The scheduler applies the choice: a beam chosen k times forks k - 1 copies (sharing
its blocks, copy-on-write for the last one), a beam not chosen is freed.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagellm.beam_search import BeamSearchOutput, BeamSearchSequence, get_beam_search_score
from pagellm.core.request import Request
from pagellm.sampling_params import BeamSearchParams


@dataclass(slots=True)
class BeamChoice:
    parent: Request
    token_id: int
    cum_logprob: float


@dataclass(eq=False)
class BeamGroup:
    request_id: str
    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    beams: list[Request] = field(default_factory=list)  # live, best first after each selection
    completed: list[BeamSearchSequence] = field(default_factory=list)
    finished: bool = False
    _num_forks: int = 0

    def next_beam_id(self) -> str:
        self._num_forks += 1
        return f"{self.request_id}/beam{self._num_forks}"

    @property
    def ready(self) -> bool:
        """Every live beam has sampled its candidates."""
        return bool(self.beams) and all(beam.beam_candidates is not None for beam in self.beams)

    def select(self) -> list[BeamChoice]:
        """The next beams, best first. EOS candidates (unless ignore_eos) become completed sequences."""
        choices: list[BeamChoice] = []
        for beam in self.beams:
            token_ids, logprobs = beam.beam_candidates
            for token_id, logprob in zip(token_ids, logprobs):
                cum_logprob = beam.cumulative_logprob + logprob
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    self.completed.append(BeamSearchSequence(beam.all_token_ids + [token_id], cum_logprob,
                                                             finish_reason="stop"))
                else:
                    choices.append(BeamChoice(beam, token_id, cum_logprob))
        # All candidates have the same length, so the length penalty does not change their order.
        choices.sort(key=lambda c: c.cum_logprob, reverse=True)
        return choices[:self.params.beam_width]

    def is_done(self, max_model_len: int) -> bool:
        beam = self.beams[0]
        return beam.num_output_tokens >= self.params.max_tokens or beam.num_tokens >= max_model_len

    def finish(self) -> None:
        """The live beams become completed sequences (they reached max_tokens or max_model_len)."""
        self.completed += [BeamSearchSequence(list(b.all_token_ids), b.cumulative_logprob, finish_reason="length")
                           for b in self.beams]
        self.beams = []
        self.finished = True

    def result(self) -> BeamSearchOutput:
        """The best beam_width completed sequences by length-penalised score (text is decoded by the caller)."""
        def score(seq: BeamSearchSequence) -> float:
            return get_beam_search_score(seq.tokens, seq.cum_logprob, self.eos_token_ids, self.params.length_penalty)

        return BeamSearchOutput(sorted(self.completed, key=score, reverse=True)[:self.params.beam_width])
