"""IncrementalDetokenizer against the tokenizer's own full decode, on SmolLM2's real (byte-level BPE) tokenizer.

The reference is `tokenizer.decode(all_ids, ...)` of the whole sequence at once; the detokenizer under test only
ever decodes short windows. Token sequences include special and added tokens, single-byte tokens and pieces that
split UTF-8 characters (Chinese, emoji, ZWJ sequences), in random order, so many of them are not valid UTF-8.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagellm.engine.detokenizer import IncrementalDetokenizer

VALID_TEXTS = [
    "你好，世界！今天天气很好。",
    "Emoji: 😀🎉👨‍👩‍👧‍👦 🇯🇵🇺🇸 done",
    "Mixed 中文 and English, ünïcödé, кириллица, العربية, 日本語のテキスト ✓✗ …",
    "  leading spaces\n\nnew lines\ttabs <|im_end|> literal special text",
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def piece_ids(tokenizer) -> list[int]:
    """Token ids that carry partial UTF-8 characters (from encoding multi-byte text)."""
    ids = set()
    for text in VALID_TEXTS:
        ids.update(tokenizer.encode(text, add_special_tokens=False))
    return sorted(ids)


class CountingTokenizer:
    """Wraps a tokenizer to record how many tokens each decode call is given (the cost per step)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids, **kwargs):
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def run_incremental(tokenizer, ids: list[int], chunks: list[int] | None = None, **kwargs):
    """Feed `ids` in chunks of the given sizes (1 by default); returns (detokenizer, per-step deltas)."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    deltas, i, sizes = [], 0, iter(chunks or [])
    while i < len(ids):
        n = max(1, next(sizes, 1))
        chunk = ids[i:i + n]
        i += len(chunk)
        finished = i >= len(ids)
        detok.update(chunk, finished=finished)
        deltas.append(detok.get_next_output_text(finished, delta=True))
    return detok, deltas


def token_lists(piece_ids):
    special = st.integers(0, 16)  # <|endoftext|>, <|im_start|>, <|im_end|> and the other added tokens
    single_bytes = st.integers(17, 300)  # byte-level single-byte tokens
    anything = st.integers(0, 49151)
    pieces = st.sampled_from(piece_ids)
    return st.lists(st.one_of(special, single_bytes, anything, pieces, pieces), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans(), spaces=st.booleans())
def test_incremental_equals_full_decode(tokenizer, piece_ids, data, skip, spaces):
    ids = data.draw(token_lists(piece_ids))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=40))
    detok, deltas = run_incremental(tokenizer, ids, chunks, skip_special_tokens=skip,
                                    spaces_between_special_tokens=spaces)
    # SmolLM2's byte-level decoder puts no spaces between special tokens, so both settings equal the full decode.
    expected = tokenizer.decode(ids, skip_special_tokens=skip)
    assert detok.output_text == expected
    assert "".join(deltas) == expected


@pytest.mark.parametrize("text", VALID_TEXTS)
@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("path", ["decode_stream", "window"])
def test_valid_text_never_emits_half_characters(tokenizer, text, skip, path):
    ids = tokenizer.encode(text, add_special_tokens=False) + [2]  # + <|im_end|>
    if not text.isascii():  # the text does split characters across tokens
        assert any(tokenizer.decode([i]).endswith("\ufffd") for i in ids)
    # The fast tokenizer streams through tokenizers' DecodeStream; the wrapper, having no Rust backend, takes the
    # window decode.
    counting = CountingTokenizer(tokenizer)
    detok, deltas = run_incremental(tokenizer if path == "decode_stream" else counting, ids, skip_special_tokens=skip)
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(deltas) == detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
    if path == "window":  # each step decodes a short window, never the whole sequence again (no O(n^2))
        assert max(counting.window_sizes) <= 8 < len(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=30))
def test_random_valid_text_round_trips_without_replacement_chars(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        return
    detok, deltas = run_incremental(tokenizer, ids)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.output_text == expected
    if "\ufffd" not in expected:  # the tokenizer round-trips the text (it maps some rare planes to junk bytes)
        assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("before", ["", "Hi 你好"])
def test_held_back_partial_character_is_flushed_at_the_end(tokenizer, before):
    ids = tokenizer.encode(before, add_special_tokens=False) + tokenizer.encode("你", add_special_tokens=False)[:1]
    detok = IncrementalDetokenizer(tokenizer)
    detok.update(ids)
    assert detok.output_text == before  # waiting for the rest of the last character's bytes
    detok.update([], finished=True)  # the request ended mid-character: show what the full decode shows
    assert detok.output_text == tokenizer.decode(ids) == before + "\ufffd"


class FakeSpacedTokenizer:
    """A decoder that, like WordPiece/Metaspace ones, joins added tokens with spaces."""

    added_tokens_decoder = {100: "<a>", 101: "<b>"}

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return " ".join(self.added_tokens_decoder.get(i, f"w{i}") for i in ids)


def test_spaces_between_special_tokens_false_drops_spaces_between_added_tokens():
    ids = [1, 100, 101, 2]
    on, _ = run_incremental(FakeSpacedTokenizer(), ids, skip_special_tokens=False)
    off, _ = run_incremental(FakeSpacedTokenizer(), ids, skip_special_tokens=False,
                             spaces_between_special_tokens=False)
    assert on.output_text == "w1 <a> <b> w2"
    assert off.output_text == "w1 <a><b> w2"
