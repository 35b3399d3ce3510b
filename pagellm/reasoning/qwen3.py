"""Qwen3 (`--reasoning-parser qwen3`): `<think>…</think>`, written by the model (Qwen3's template) or opened by the
template (Qwen3-Thinking-2507, Qwen3.5). `chat_template_kwargs: {"enable_thinking": false}` turns thinking off:
Qwen3's template then ends the prompt with an empty `<think>\\n\\n</think>\\n\\n`, and the output is content (as
vLLM's parser: also with a template that does not write the empty block)."""
from __future__ import annotations

from pagellm.reasoning.abs_parser import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinking_disabled(self) -> bool:
        return super().thinking_disabled() or self.chat_template_kwargs.get("enable_thinking", True) is False
