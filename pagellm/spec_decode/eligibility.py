"""Which requests speculate. Verification samples every drafted position from that position's logits (rejection
sampling, see verify.py), which is exact for requests whose logits processing does not depend on the tokens before
it in the step: greedy ones and ones sampled with temperature, top-k, top-p, min-p, logit bias and seeds. Others
decode one token per step as without speculation: stop strings (found after detokenizing, so tokens past one could
be kept), penalties, bad words, min_tokens still counting, a thinking budget, grammars (the bitmask covers one
position), beams, the first sample of n > 1, pooling."""
from __future__ import annotations

from pagellm.core.request import Request


def may_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (not params.stop and not params.needs_penalties and not request.bad_words_token_ids
            and request.num_output_tokens >= max(params.min_tokens, 1) and params.thinking_token_budget is None
            and request.structured_output_request is None and request.beam_group is None
            and request.pooling_params is None)
