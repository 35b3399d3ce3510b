"""Incremental detokenization and stop strings for one request.

With a fast (Rust) tokenizer, tokens go through tokenizers' `DecodeStream`, which keeps its own window and emits text
only at character boundaries: 0.6 us a token against 4.7 us for the window decode below (docs/performance.md).
The window decode (vLLM's prefix/read-offset technique) still serves three cases: tokenizers without a Rust
backend, `spaces_between_special_tokens=False` with special tokens shown (which `DecodeStream` cannot express), and
the forced flush of a half character held back when a request ends (which `DecodeStream` never emits).

The window decode: each new token is decoded together with a short window of the tokens before it:
`prefix_offset..read_offset` is the window whose text was already emitted, `read_offset..` the tokens not yet
turned into text. The text of the whole window minus the text of its prefix is the new text, emitted only once it
no longer ends in U+FFFD (half a UTF-8 character from byte-level BPE pieces or `<0x..>` byte tokens). Every
emission boundary is then a character boundary, so window decodes concatenate to the full decode, at O(window)
cost per token.

Stop strings are searched only in the new text plus the `len(stop) - 1` characters before it. For streaming,
`get_next_output_text` holds back the last `max(len(stop)) - 1` characters while the request runs, so text
already shown is never retracted by a stop string found later.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tokenizers.decoders import DecodeStream

from pagellm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_REPLACEMENT_CHAR = "\ufffd"


@dataclass(eq=False)
class IncrementalDetokenizer:
    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    stop_buffer_length: int = field(init=False)
    _sent_offset: int = field(default=0, init=False)  # characters already handed out as deltas
    _added_token_text: dict[int, str] = field(default_factory=dict, init=False)
    _stream: DecodeStream | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        # With the stop string excluded from the output, a partial match at the end of the text may still be
        # cut away, so that many characters are not safe to show yet. Included stop strings never cut text
        # that was already there (the cut lies after the match), so nothing needs holding back.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0
        if not self.spaces_between_special_tokens and not self.skip_special_tokens:
            decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
            self._added_token_text = {i: getattr(t, "content", str(t)) for i, t in decoder.items()}
        elif getattr(self.tokenizer, "backend_tokenizer", None) is not None:
            self._stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)

    @classmethod
    def from_params(cls, tokenizer, params: SamplingParams) -> IncrementalDetokenizer:
        return cls(tokenizer, skip_special_tokens=params.skip_special_tokens,
                   spaces_between_special_tokens=params.spaces_between_special_tokens,
                   stop=list(params.stop or []), include_stop_str_in_output=params.include_stop_str_in_output)

    # ---- detokenization ----------------------------------------------------------------------------------
    def _decode(self, token_ids: list[int]) -> str:
        # No clean-up of tokenization spaces: it rewrites text across window edges (" ." -> "."), which would
        # make window decodes disagree with each other.
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _stream_next(self, token_id: int) -> str:
        """`DecodeStream`'s text for one more token; "" while it holds back half a character."""
        assert self._stream is not None
        text = self._stream.step(self.tokenizer.backend_tokenizer, token_id)
        if text is None:
            return ""
        # Everything up to here is emitted, which is where a final forced flush (a window decode) starts.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text

    def _decode_next(self, force: bool = False) -> str:
        """Text of the tokens from `read_offset` on, or "" while it would end in half a character (unless
        `force`, at the end of the request)."""
        if self.read_offset >= len(self.token_ids):
            return ""
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        if new_text.endswith(_REPLACEMENT_CHAR) and not force:
            return ""  # wait for the rest of the character's bytes
        delta = new_text[len(prefix_text):]
        if self._added_token_text:
            delta = self._strip_space_between_added(delta)
        # Advance even when the delta is empty (skipped special tokens), so the window stays short.
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return delta

    def _strip_space_between_added(self, delta: str) -> str:
        """spaces_between_special_tokens=False: drop the space some decoders put between two added tokens."""
        ids = self.token_ids
        last, previous = ids[-1], ids[-2] if len(ids) > 1 else None
        content = self._added_token_text.get(last)
        if content is not None and previous in self._added_token_text and delta.endswith(" " + content):
            return delta[:-len(content) - 1] + content
        return delta

    # ---- per step ----------------------------------------------------------------------------------------
    def update(self, new_token_ids: list[int], finished: bool = False) -> str | None:
        """Add newly generated tokens (and, when `finished`, flush any held-back partial character).
        Returns the stop string that matched, after cutting the text at it, or None."""
        new_text = ""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            new_text += self._stream_next(token_id) if self._stream is not None else self._decode_next()
        if finished:
            new_text += self._decode_next(force=True)
        self.output_text += new_text
        return self._check_stop_strings(len(new_text))

    def _check_stop_strings(self, num_new_chars: int) -> str | None:
        if not num_new_chars or not self.stop:
            return None
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (start, list position, stop string): earliest match wins
        for position, stop_str in enumerate(self.stop):
            # A match must overlap the new text; anything wholly earlier was found on an earlier step.
            start = text.find(stop_str, max(0, len(text) - num_new_chars - len(stop_str) + 1))
            if start != -1 and (best is None or start < best[0]):
                best = (start, position, stop_str)
        if best is None:
            return None
        start, _, stop_str = best
        self.output_text = text[:start + len(stop_str)] if self.include_stop_str_in_output else text[:start]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text safe to show: everything when finished, otherwise all but the last `stop_buffer_length`
        characters. With `delta`, only the part not returned by an earlier delta call."""
        length = len(self.output_text) if finished else max(0, len(self.output_text) - self.stop_buffer_length)
        if not delta:
            return self.output_text[:length]
        if length <= self._sent_offset:
            return ""
        text = self.output_text[self._sent_offset:length]
        self._sent_offset = length
        return text
