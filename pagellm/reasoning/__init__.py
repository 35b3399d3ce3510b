"""Reasoning output: splitting a model's `<think>…</think>` text from its answer (vLLM's reasoning parsers, by
vLLM's `--reasoning-parser` names), for the OpenAI server's `reasoning_content` and the other chat front ends.

The interface (see abs_parser.py):

- `get_reasoning_parser(name)` -> the parser class registered under `name` (`REASONING_PARSERS` lists them);
  `ValueError` naming the choices for an unknown one.
- `parser = cls(prompt, chat_template_kwargs)`: one per request (and choice). The rendered prompt tells where the
  output starts: a prompt that ends by closing reasoning (Qwen3's template with `enable_thinking: false` ends in
  `<think>\\n\\n</think>\\n\\n`) makes the whole output content; otherwise the output starts inside reasoning
  (whether the template opened `<think>` or the model writes it itself).
- `parser.extract(text) -> ReasoningSplit(reasoning, content)`: a whole output; a field that is empty is None.
  Reasoning never closed (cut by max_tokens) is all reasoning, content None (vLLM's qwen3 and deepseek_r1).
- `streamer = parser.streamer()`; `streamer.feed(delta, finished) -> ReasoningSplit` of text deltas: a suffix
  that may be the start of a tag is held back until the next delta decides it (as stop strings are held back),
  and the deltas of a stream add up to `extract` of the whole text.
- `cls.start_tag` / `cls.end_tag`: the tags as text (the engine's thinking budget encodes them to token ids).
"""
from __future__ import annotations

from pagellm.reasoning.abs_parser import ReasoningParser, ReasoningSplit, ReasoningStreamer
from pagellm.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from pagellm.reasoning.qwen3 import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"Unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)} "
                         f"(--reasoning-parser).") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStreamer", "get_reasoning_parser"]
