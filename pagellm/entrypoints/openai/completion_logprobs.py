"""The logprobs shapes the responses carry: OpenAI's legacy completion logprobs (`tokens`, `token_logprobs`,
`top_logprobs`, `text_offset`), which with echo start with the prompt's tokens, and vLLM's `prompt_logprobs`
(None for the first prompt token, then token id -> logprob, rank, text) on completions and chat."""
from __future__ import annotations

from pagellm.entrypoints.openai.protocol_responses import CompletionLogProbs, PromptLogprob, PromptLogprobs
from pagellm.outputs import Logprob

LOGPROB_FLOOR = -9999.0  # JSON has no -inf


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None], num_top: int,
                        text_offset: int, unscored_text: str = "") -> CompletionLogProbs:
    """Per token: its text, logprob, the `num_top` most likely tokens (most likely first, plus the chosen one),
    and where its text starts in the completion. A position without logprobs (an echoed prompt's first token,
    which nothing precedes) gets `unscored_text` and nulls, as OpenAI's echo."""
    result = CompletionLogProbs()
    for token_id, step in zip(token_ids, logprobs):
        if step is None:
            token = unscored_text
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            chosen = step[token_id]
            token = chosen.decoded_token or ""
            ranked = sorted(step.items(), key=lambda item: -item[1].logprob)[:num_top]
            if token_id not in dict(ranked):
                ranked.append((token_id, chosen))
            result.token_logprobs.append(max(chosen.logprob, LOGPROB_FLOOR))
            result.top_logprobs.append({lp.decoded_token or "": max(lp.logprob, LOGPROB_FLOOR) for _, lp in ranked})
        result.tokens.append(token)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def prompt_logprobs_response(prompt_ids: list[int], logprobs: list[dict[int, Logprob] | None] | None,
                             num_top: int | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs from the engine's: per position the prompt token and the `num_top` most likely
    (the engine may hold more, for echo), logprobs floored for JSON. None unless the request asked for them."""
    if num_top is None or logprobs is None:
        return None
    result: PromptLogprobs = []
    for token_id, step in zip(prompt_ids, logprobs):
        if step is None:
            result.append(None)
            continue
        result.append({
            candidate: PromptLogprob(logprob=max(lp.logprob, LOGPROB_FLOOR), rank=lp.rank,
                                     decoded_token=lp.decoded_token)
            for candidate, lp in step.items()
            if candidate == token_id or (lp.rank is not None and lp.rank <= num_top)})
    return result
