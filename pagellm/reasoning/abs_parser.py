"""The reasoning parser's base class: where a request's output starts (from its rendered prompt), and the split of
the output into reasoning and content, whole (`extract`) or as a stream of text deltas (`ReasoningStreamer`).

The split works on the detokenized text, so it holds for tags of one added token (Qwen3's and DeepSeek-R1's
`<think>`, kept in the text: they are not special tokens) and for tags spelled over several tokens alike. Both
ways run the same state machine, so a stream's deltas always add up to the whole split:

- at the start of the output, whitespace and a start tag the model writes itself are dropped (vLLM strips
  `<think>` from the output too);
- then everything is reasoning up to the first end tag, and everything after it is content;
- a parser whose request turned thinking off (`thinking_disabled`) passes everything through as content.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, NamedTuple


class ReasoningSplit(NamedTuple):
    reasoning: str | None
    content: str | None


def _held_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that is a proper prefix of `tag` (0 if none)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningParser:
    """One request's view of a model family's reasoning tags. Subclasses name the tags and may read the request's
    chat_template_kwargs (`thinking_disabled`)."""

    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"

    def __init__(self, prompt: str, chat_template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.prompt_closes_reasoning = self.closes_reasoning(prompt)

    @classmethod
    def closes_reasoning(cls, prompt: str) -> bool:
        """Whether the prompt itself ends by closing reasoning (thinking turned off by the template), so that the
        whole output is content. The engine asks it too, of a prompt's last tokens, to start a grammar at once."""
        return prompt.rstrip().endswith(cls.end_tag)

    def thinking_disabled(self) -> bool:
        """Whether the request's output is all content (subclasses add their template switches)."""
        return self.prompt_closes_reasoning

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self.start_tag, self.end_tag, reasoning=not self.thinking_disabled())

    def extract(self, text: str) -> ReasoningSplit:
        return self.streamer().feed(text, finished=True)


class ReasoningStreamer:
    """The split of one output, fed its text deltas in order (`finished` with the last one)."""

    def __init__(self, start_tag: str, end_tag: str, reasoning: bool = True) -> None:
        self.start_tag, self.end_tag = start_tag, end_tag
        self.state = "start" if reasoning else "content"
        self.held = ""  # text not yet given out: it may begin a tag

    @property
    def in_reasoning(self) -> bool:
        return self.state != "content"

    def feed(self, delta: str, finished: bool) -> ReasoningSplit:
        text, self.held = self.held + delta, ""
        reasoning, content = "", ""
        if self.state == "start":
            stripped = text.lstrip()
            if stripped.startswith(self.start_tag):
                text, self.state = stripped[len(self.start_tag):], "reasoning"
            elif self.start_tag.startswith(stripped) and not finished:
                self.held = text  # only whitespace, or the start of a start tag, so far
                return ReasoningSplit(None, None)
            else:
                self.state = "reasoning"
        if self.state == "reasoning":
            end = text.find(self.end_tag)
            if end < 0:
                keep = 0 if finished else _held_suffix(text, self.end_tag)
                reasoning, self.held = text[:len(text) - keep], text[len(text) - keep:]
                return ReasoningSplit(reasoning or None, None)
            reasoning, text, self.state = text[:end], text[end + len(self.end_tag):], "content"
        content = text
        return ReasoningSplit(reasoning or None, content or None)
