"""DeepSeek-R1 (`--reasoning-parser deepseek_r1`): `<think>…</think>`, the start tag usually written by the chat
template at the end of the prompt (`<｜Assistant｜><think>\\n`), so the output starts inside reasoning."""
from __future__ import annotations

from pagellm.reasoning.abs_parser import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
