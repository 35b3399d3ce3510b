"""Suffix decoding (vLLM's `suffix` method, after Arctic Inference's SuffixDecoding): the drafter matches the
sequence's last tokens against the request's own prompt and output so far and against a bounded cache of finished
requests' outputs, and continues with the most frequent next tokens.

For each match length n up to `suffix_decoding_max_tree_depth`, the occurrences of the sequence's last n tokens that
are followed by a token give an empirical next-token distribution. The draft walks it greedily (the most frequent
token, the latest occurrence breaking ties; the occurrences then narrow to those followed by it) while the product of
the chosen tokens' frequencies stays >= `suffix_decoding_min_token_prob`, for at most
`suffix_decoding_max_spec_factor` * n tokens (and the drafter's length, see adaptive.py). Its score is the sum of those
products, the expected number of accepted tokens if the frequencies held; the draft with the highest score wins
(ties: the longer match), the request's own sequence winning ties against the cache. The occurrences of the last n
tokens change only at the match lengths the occurrences of the last token reach, and a shorter match is walked only
if its cap could beat the best score, so a step costs a vectorised scan of the sequence for its last token and a few
small NumPy operations: no tree is kept.

The cache holds the outputs of the last `suffix_decoding_max_cached_requests` finished requests (0: none; the oldest
leaves first), indexed by token pairs, so its matches are at least two tokens long; a pair's latest
`CACHE_OCCURRENCES` occurrences are searched (a pair as common as ". The" in 10,000 outputs would otherwise cost
milliseconds a step). It takes about 55 bytes per cached token (the pair index): some 140 MB at the default 10,000
outputs of 256 tokens.
"""
from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pagellm.config import SpeculativeConfig
from pagellm.core.request import Request

SEP = -1  # between cached outputs and around a sequence: no token equals it, so no match crosses it
DENSE_ROWS = 64  # up to this many occurrences, NumPy's per-call cost outweighs its per-element speed
CACHE_OCCURRENCES = 1024  # the latest occurrences of a pair the cache searches: a frequent one's cost stays bounded


@dataclass
class SuffixDraft:
    token_ids: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)  # each token's estimated probability, given the ones before it
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


def best_draft(corpus: np.ndarray, ends: np.ndarray, pattern: np.ndarray, max_tokens: int, max_spec_factor: float,
               min_token_prob: float) -> SuffixDraft:
    """The best draft after `pattern` from `corpus`, whose positions `ends` end occurrences of at least the last
    token of `pattern`. Every sequence in `corpus` has SEP before and after it."""
    if not len(ends):
        return SuffixDraft()
    # Each occurrence's match length: how many of the pattern's last tokens it ends (SEP stops it; index 0 is SEP).
    # Many occurrences (a common token) are narrowed one token at a time, the last few compared all at once.
    lengths = np.zeros(len(ends), dtype=np.int64)
    alive = np.arange(len(ends))
    n = 1
    while len(alive) > DENSE_ROWS and n < len(pattern):
        same = corpus[ends[alive] - n] == pattern[-n - 1]
        lengths[alive[~same]] = n
        alive, n = alive[same], n + 1
    lengths[alive] = n
    if n < len(pattern):
        back = np.maximum(ends[alive, None] - np.arange(n, len(pattern)), 0)
        equal = corpus[back] == pattern[::-1][n:]
        lengths[alive] += np.where(equal.all(axis=1), len(pattern) - n, equal.argmin(axis=1))
    best = SuffixDraft()
    # The occurrences of the last n tokens change only at these lengths; from the longest match down, a shorter one
    # is walked only if its cap could beat the best score (each token adds at most 1; ties go to the longer match).
    for n in np.unique(lengths)[::-1].tolist():
        cap = min(max_tokens, int(n * max_spec_factor + 1e-6))
        if cap <= best.score:
            continue
        draft = _walk(corpus, ends[lengths >= n], cap, min_token_prob)
        if draft.score > best.score:
            best = draft
            best.match_len = n
    return best


def _most_frequent(followers: np.ndarray, ends: np.ndarray) -> tuple[int, int]:
    """The most frequent follower and its count, the one whose latest occurrence is latest on a tie."""
    if len(followers) > DENSE_ROWS:
        values, inverse, counts = np.unique(followers, return_inverse=True, return_counts=True)
        latest = np.full(len(values), -1, dtype=np.int64)
        np.maximum.at(latest, inverse.reshape(-1), ends)
        choice = int(np.argmax(np.where(counts == counts.max(), latest, -1)))
        return int(values[choice]), int(counts[choice])
    seen: dict[int, int] = {}
    last: dict[int, int] = {}
    for token, end in zip(followers.tolist(), ends.tolist()):
        seen[token] = seen.get(token, 0) + 1
        last[token] = end  # ends ascend
    token = max(seen, key=lambda t: (seen[t], last[t]))
    return token, seen[token]


def _walk(corpus: np.ndarray, ends: np.ndarray, cap: int, min_token_prob: float) -> SuffixDraft:
    draft = SuffixDraft()
    prob = 1.0
    while len(draft.token_ids) < cap:
        followers = corpus[ends + 1]
        live = followers != SEP
        if not live.all():
            ends, followers = ends[live], followers[live]
        if len(ends) == 1:  # one occurrence: the rest of the draft is what follows it, at the same probability
            tail = corpus[ends[0] + 1:ends[0] + 1 + cap - len(draft.token_ids)]
            stop = np.flatnonzero(tail == SEP)
            tail = tail[:stop[0]] if len(stop) else tail
            draft.token_ids += tail.tolist()
            draft.probs += [prob] * len(tail)
            break
        if not len(ends):
            break
        token, count = _most_frequent(followers, ends)
        prob *= count / len(followers)
        if prob < min_token_prob:
            break
        draft.token_ids.append(token)
        draft.probs.append(prob)
        ends = ends[followers == token] + 1
    return draft


class SuffixCache:
    """Finished requests' outputs, oldest first, each between SEP tokens in one array, with the positions of every
    token pair. Evicted outputs stay in the array (their positions skipped) until they make up half of it."""

    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self.entries: deque[tuple[int, int]] = deque()  # (start, end) of each output in `tokens`
        self._reset()

    def _reset(self) -> None:
        self.tokens = np.full(1024, SEP, dtype=np.int64)
        self.size = 1  # tokens[0] is SEP
        self.start = 1  # positions before it are evicted
        self.index: dict[int, array] = {}  # a << 32 | b -> positions of every b that follows an a

    def add(self, output: list[int]) -> None:
        if self.max_requests == 0 or not output:
            return
        start, end = self.size, self.size + len(output)
        if end + 1 > len(self.tokens):
            grown = np.full(max(2 * len(self.tokens), end + 1), SEP, dtype=np.int64)
            grown[:self.size] = self.tokens[:self.size]
            self.tokens = grown
        self.tokens[start:end] = output
        self.size = end + 1  # the SEP after it
        for position in range(start + 1, end):
            self.index.setdefault(output[position - start - 1] << 32 | output[position - start],
                                  array("q")).append(position)
        self.entries.append((start, end))
        while len(self.entries) > self.max_requests:
            self.entries.popleft()
            self.start = self.entries[0][0]
        if self.start > self.size // 2:
            self._compact()

    def _compact(self) -> None:
        outputs = [self.tokens[start:end].tolist() for start, end in self.entries]
        self.entries.clear()
        self._reset()
        for output in outputs:
            self.add(output)

    def ends(self, a: int, b: int) -> np.ndarray:
        """Positions of the b of the latest `CACHE_OCCURRENCES` live occurrences of the pair (a, b)."""
        positions = self.index.get(a << 32 | b)
        if positions is None:
            return np.empty(0, dtype=np.int64)
        found = np.frombuffer(positions, dtype=np.int64)[-CACHE_OCCURRENCES:]
        return found[found >= self.start] if found[0] < self.start else found.copy()

    @property
    def outputs(self) -> list[list[int]]:
        return [self.tokens[start:end].tolist() for start, end in self.entries]


@dataclass
class _Sequence:
    """A request's tokens as the drafter searches them: SEP, the tokens, SEP."""

    tokens: np.ndarray
    length: int = 0


class SuffixProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.k = config.num_speculative_tokens
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_spec_factor = config.suffix_decoding_max_spec_factor
        self.min_token_prob = config.suffix_decoding_min_token_prob
        self.cache = SuffixCache(config.suffix_decoding_max_cached_requests)
        # Held until the request finishes (every request does: stopped, aborted or failed), when its output goes into
        # the cache: a weak reference could let it go first.
        self.sequences: dict[Request, _Sequence] = {}

    def draft(self, request: Request, max_tokens: int | None = None) -> SuffixDraft:
        """The best draft of at most min(k, max_tokens) tokens to follow the request's tokens so far."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        sequence = self._sync(request)
        tokens, length = sequence.tokens, sequence.length
        if k <= 0 or length < 2:
            return SuffixDraft()
        pattern = tokens[max(1, length + 1 - self.max_depth):length + 1]
        own = best_draft(tokens, np.flatnonzero(tokens[1:length] == tokens[length]) + 1, pattern, k,
                         self.max_spec_factor, self.min_token_prob)
        if not self.cache.entries or len(pattern) < 2:
            return own
        cached = best_draft(self.cache.tokens, self.cache.ends(int(pattern[-2]), int(pattern[-1])), pattern, k,
                            self.max_spec_factor, self.min_token_prob)
        return cached if cached.score > own.score else own

    def step_planned(self) -> None:
        """Once a step: the outputs of requests that finished since go into the cache."""
        for request in [request for request in self.sequences if request.is_finished]:
            self.cache.add(request.output_token_ids)
            del self.sequences[request]

    def _sync(self, request: Request) -> _Sequence:
        """The request's search array, extended by the tokens it gained since the last draft."""
        tokens = request.all_token_ids
        sequence = self.sequences.get(request)
        if sequence is None or sequence.length > len(tokens):
            sequence = self.sequences[request] = _Sequence(np.full(2 * len(tokens) + 16, SEP, dtype=np.int64))
        start, end = sequence.length, len(tokens)
        if end + 2 > len(sequence.tokens):
            grown = np.full(2 * end + 16, SEP, dtype=np.int64)
            grown[:start + 1] = sequence.tokens[:start + 1]
            sequence.tokens = grown
        if end > start:
            sequence.tokens[start + 1:end + 1] = tokens[start:end]
            sequence.length = end
        return sequence
