"""Incremental parsing of the output of `tool_choice: "required"`: a JSON array of `{"name", "parameters"}`
objects (the constraint tool_calls.py puts on the output). As text arrives, each call gets its name once the name's
string is complete, and the raw text of its parameters value as it grows, character by character. That raw text
is the call's `function.arguments` whether streamed or not, so a stream reassembles byte for byte to the
non-streamed call (a named function's arguments are the whole output, raw as well). A call is complete once its
object closes: an array cut short (max_tokens, a stop string) still made the calls before the cut.

The scanner only tracks what it needs: string and escape state everywhere, nesting depth, and keys and values at
the call objects' level (depth 2). Keys other than "name" and "parameters" are skipped."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from itertools import takewhile

_CALL_LEVEL = 2  # inside the array (1) and a call object (2)
_WHITESPACE = " \t\r\n"


@dataclass(slots=True)
class ParsedCall:
    name: str | None = None  # once its string is complete
    arguments: str = ""  # the raw text of the "parameters" value so far
    arguments_done: bool = False
    closed: bool = False  # its object has closed

    @property
    def complete(self) -> bool:
        return self.closed and self.name is not None and self.arguments_done


@dataclass
class RequiredCallsParser:
    text: str = ""
    calls: list[ParsedCall] = field(default_factory=list)
    closed: bool = False  # the top-level value has been closed
    invalid: bool = False  # not an array, or something other than whitespace after it: not a list of calls
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    _expect_key: bool = False  # at the call level: the next string is a key
    _key: str | None = None  # the call-level key whose value is being read
    _key_start: int = 0
    _value_start: int | None = None  # where the call-level value being read began
    _in_scalar: bool = False  # that value is a number or a literal (it ends at a delimiter)

    def feed(self, delta: str) -> None:
        start = len(self.text)
        self.text += delta
        for i in range(start, len(self.text)):
            self._step(i, self.text[i])
        if self._value_start is not None and self._key == "parameters":  # every character read so far is in it
            self.calls[-1].arguments = self.text[self._value_start:]

    def complete_calls(self) -> list[ParsedCall]:
        """The complete calls so far, up to the first that is not (cut short, or not a call); none if the text is
        not an array."""
        return [] if self.invalid else list(takewhile(lambda call: call.complete, self.calls))

    @property
    def finished(self) -> bool:
        """The text is a whole array of complete calls (not cut short)."""
        return self.closed and bool(self.calls) and len(self.complete_calls()) == len(self.calls)

    def _step(self, i: int, c: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif c == "\\":
                self._escaped = True
            elif c == '"':
                self._in_string = False
                if self._depth == _CALL_LEVEL:
                    self._end_string(i + 1)
            return
        if self.closed:
            self.invalid = self.invalid or c not in _WHITESPACE
            return
        if self._in_scalar and (c in _WHITESPACE or c in ",]}"):
            self._in_scalar = False
            self._end_value(i)
        at_call_level = self._depth == _CALL_LEVEL
        if c == '"':
            self._in_string = True
            if at_call_level and self._expect_key:
                self._key_start = i
            elif at_call_level:
                self._value_start = i
        elif c in "[{":
            if at_call_level:
                self._value_start = i
            self.invalid = self.invalid or (self._depth == 0 and c == "{")
            self._depth += 1
            if self._depth == _CALL_LEVEL:  # a call object opens
                self.calls.append(ParsedCall())
                self._expect_key = True
        elif c in "]}":
            self._depth -= 1
            if self._depth == _CALL_LEVEL:
                self._end_value(i + 1)
            elif self._depth == _CALL_LEVEL - 1 and self.calls:
                self.calls[-1].closed = True
            self.closed = self._depth == 0
        elif at_call_level and c in ":,":
            self._expect_key = c == ","
        elif at_call_level and c not in _WHITESPACE and not self._in_scalar:
            self._in_scalar = True
            self._value_start = i

    def _end_string(self, end: int) -> None:
        if self._expect_key:
            self._key = _decode_string(self.text[self._key_start:end])
        else:
            self._end_value(end)

    def _end_value(self, end: int) -> None:
        raw, call = self.text[self._value_start:end], self.calls[-1]
        if self._key == "name":
            call.name = _decode_string(raw)
        elif self._key == "parameters":
            call.arguments, call.arguments_done = raw, True
        self._value_start = None


def _decode_string(raw: str) -> str | None:
    """A JSON string token's value; None for another value or a malformed string (the grammar makes neither)."""
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
