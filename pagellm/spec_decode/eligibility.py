"""Which requests speculate. Verification samples every drafted position from that position's logits (rejection
sampling, see verify.py), which is exact for requests whose logits processing at a position depends only on the
draft tokens before it, known when the step is planned: greedy ones and ones sampled with temperature, top-k, top-p,
min-p, logit bias and seeds, and grammars (structured outputs: the draft is cut to the prefix the grammar allows,
and each verified position gets its own bitmask row, the grammar's state after the drafts before it; see
structured_output/). Others decode one token per step as without speculation: stop strings (found after
detokenizing, so tokens past one could be kept), penalties, bad words, min_tokens still counting, a thinking budget,
beams, the first sample of n > 1, pooling."""
from __future__ import annotations

from pagellm.core.request import Request


def may_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (not params.stop and not params.needs_penalties and not request.bad_words_token_ids
            and request.num_output_tokens >= max(params.min_tokens, 1) and params.thinking_token_budget is None
            and request.beam_group is None and request.pooling_params is None)
