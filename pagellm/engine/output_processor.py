"""Turns finished engine Requests into user-facing RequestOutputs (detokenized text, finish reasons)."""
from __future__ import annotations

from pagellm.engine.request import Request
from pagellm.outputs import CompletionOutput, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def make_output(self, request: Request) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True),
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
        )
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, outputs=[completion],
                             finished=request.is_finished)
