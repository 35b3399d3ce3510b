"""The reasoning parsers (pagellm/reasoning/) against a reference split written here with `re` and str.partition
(vLLM's rules: a start tag the output opens with is dropped, reasoning runs to the first end tag, reasoning never
closed is all reasoning), whole and streamed in every split of the text."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagellm.reasoning import REASONING_PARSERS, ReasoningSplit, get_reasoning_parser

OPENED = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"  # the template opens reasoning
PLAIN = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # the model writes <think> itself
CLOSED = PLAIN + "<think>\n\n</think>\n\n"  # Qwen3's template with enable_thinking false


def reference(text: str, thinking: bool = True) -> ReasoningSplit:
    if not thinking:
        return ReasoningSplit(None, text or None)
    opening = re.match(r"\s*<think>", text)
    reasoning, _, content = text[opening.end():].partition("</think>") if opening else text.partition("</think>")
    return ReasoningSplit(reasoning or None, content or None)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize(("prompt", "text", "expected"), [
    (OPENED, "Let me see.\n</think>\n\nIt is 4.", ("Let me see.\n", "\n\nIt is 4.")),
    (PLAIN, "<think>\nLet me see.</think>It is 4.", ("\nLet me see.", "It is 4.")),
    (PLAIN, "\n\n<think>x</think>y", ("x", "y")),
    (OPENED, "cut short by max_tokens", ("cut short by max_tokens", None)),  # never closed: all reasoning
    (OPENED, "thinking</think>", ("thinking", None)),
    (OPENED, "</think>answer", (None, "answer")),
    (OPENED, "", (None, None)),
    (OPENED, "a<think>b</think>c</think>d", ("a<think>b", "c</think>d")),  # only an opening start tag is dropped
    (CLOSED, "It is 4.</think>x", (None, "It is 4.</think>x")),  # thinking off: all content
])
def test_extract(name, prompt, text, expected):
    assert get_reasoning_parser(name)(prompt).extract(text) == expected


def test_qwen3_enable_thinking_false_is_content_even_when_the_template_writes_no_empty_block():
    qwen3, deepseek = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    assert qwen3(PLAIN, {"enable_thinking": False}).extract("Hi") == (None, "Hi")
    assert qwen3(PLAIN, {"enable_thinking": True}).extract("Hi") == ("Hi", None)
    assert deepseek(PLAIN, {"enable_thinking": False}).extract("Hi") == ("Hi", None)  # not a DeepSeek switch


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


PIECES = ["<think>", "</think>", "<", "</", "</thi", "<th", "think", ">", "a", "é", " ", "\n", "\n\n"]


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.sampled_from(PIECES), max_size=12), cuts=st.lists(st.integers(0, 80), max_size=6),
       prompt=st.sampled_from([OPENED, PLAIN, CLOSED]), name=st.sampled_from(sorted(REASONING_PARSERS)))
def test_streamed_deltas_add_up_to_the_whole_split(pieces, cuts, prompt, name):
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    parser = get_reasoning_parser(name)(prompt)
    expected = reference(text, thinking=prompt is not CLOSED)
    assert parser.extract(text) == expected
    streamer = parser.streamer()
    reasoning, content = "", ""
    for i, (start, end) in enumerate(zip(bounds, bounds[1:] or [len(text)])):
        delta = streamer.feed(text[start:end], finished=i == len(bounds) - 2 or len(bounds) == 1)
        # Nothing given out is ever taken back: a held tag prefix is not emitted as reasoning.
        reasoning += delta.reasoning or ""
        content += delta.content or ""
        assert expected.reasoning is None and not reasoning or (expected.reasoning or "").startswith(reasoning)
    assert (reasoning or None, content or None) == expected


def test_a_partial_end_tag_is_held_until_the_next_delta_decides_it():
    streamer = get_reasoning_parser("deepseek_r1")(OPENED).streamer()
    assert streamer.feed("step one </thi", finished=False) == ("step one ", None)
    assert streamer.feed("nk>\n\nanswer", finished=False) == (None, "\n\nanswer")
    streamer = get_reasoning_parser("deepseek_r1")(OPENED).streamer()
    assert streamer.feed("a </th", finished=False) == ("a ", None)
    assert streamer.feed("ere", finished=False) == ("</there", None)  # not a tag after all
    assert streamer.feed(" </t", finished=True) == (" </t", None)  # the end flushes what was held
