"""Verifying a draft: how many draft tokens a request keeps, given the tokens the worker sampled at the verify step's
1 + k positions. This is vLLM's rejection sampling for drafters whose proposals are deterministic (prompt lookup).

The worker samples each position from the target distribution p there (the request's temperature, min-p, top-k,
top-p, logit bias and grammar applied exactly as for any other sample; greedy is the argmax), and the draft is kept
while it equals the samples. Under a grammar, position i is masked by its own bitmask row, the grammar's state after
draft[:i] (structured_output/), so p is the constrained distribution a plain step would sample there, and every
token kept is one the grammar allows.

A deterministic drafter proposes x with q = one-hot(x); rejection sampling accepts x with probability
min(1, p(x) / q(x)) = p(x), which is the probability that a sample t ~ p equals x, and on rejection draws from
normalize(max(0, p - q)) = p without x, which is the law of t given t != x: so the sample at the first mismatch is
the recovered token, and after a fully accepted draft the last position's sample is the bonus token from p. Every
emitted token thus has the target's distribution given the tokens before it, and its logprobs are the target
model's at that position.
"""
from __future__ import annotations

from collections.abc import Sequence


def num_accepted(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """Draft tokens kept: the leading ones equal to the token sampled at their position (`sampled` holds
    len(draft) + 1 tokens; the one after the kept drafts is emitted with them)."""
    count = 0
    while count < len(draft) and draft[count] == sampled[count]:
        count += 1
    return count
