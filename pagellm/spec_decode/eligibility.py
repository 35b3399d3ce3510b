"""Which requests speculate. Verification samples every drafted position from that position's logits, which is
exact for greedy requests whose logits processing does not depend on the tokens before it in the step. Others decode
one token per step as without speculation: sampling at temperature > 0 (no rejection sampler yet), stop strings
(found after detokenizing, so tokens past one could be kept), penalties, bad words, min_tokens still counting, a
thinking budget, grammars (the bitmask covers one position), beams, the first sample of n > 1, pooling."""
from __future__ import annotations

from pagellm.core.request import Request


def may_speculate(request: Request) -> bool:
    params = request.sampling_params
    return (params.is_greedy and not params.stop and not params.needs_penalties and not request.bad_words_token_ids
            and request.num_output_tokens >= max(params.min_tokens, 1) and params.thinking_token_budget is None
            and request.structured_output_request is None and request.beam_group is None
            and request.pooling_params is None)
