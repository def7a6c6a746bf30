"""An incremental, strict scan of one JSON object over a growing text.

The tool-call parsers read a call object (``{"name": ..., "arguments": {...}}``) while it is still
being generated: this scanner resumes where it stopped when more text arrives, rejects invalid
JSON at the first character that makes it so (RFC 8259 grammar: no trailing commas, no raw
control characters in strings, numbers and literals checked), records where each top-level
field's value begins and ends, and keeps the object's compact text (whitespace outside strings
removed) so that a value can be streamed as it grows.
"""
from __future__ import annotations

import json
import re
from enum import Enum

_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_LITERALS = ("true", "false", "null")
_PLAIN_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_HEX = frozenset("0123456789abcdefABCDEF")


class Scan(Enum):
    MORE = "more"  # the text so far is a valid prefix; the object is not closed yet
    DONE = "done"  # the object closed at ``end``
    BAD = "bad"  # the text is not a prefix of any JSON object


class _S(Enum):
    VALUE = 0  # a value is expected
    FIRST_KEY = 1  # after "{": a key or "}"
    KEY = 2  # after ",": a key
    COLON = 3
    FIRST_ITEM = 4  # after "[": a value or "]"
    AFTER = 5  # after a value: "," or the closing bracket
    STRING = 6
    ESCAPE = 7
    UNICODE = 8
    NUMBER = 9
    LITERAL = 10


class ObjectScan:
    """Scan of the JSON object that starts at ``text[start]`` (which must be ``{``).

    Call :meth:`advance` with the whole text so far (a growing string) as often as it grows.
    After it: ``fields`` maps each top-level key (decoded) to ``[begin, end]`` offsets of its
    value in ``compact`` (``end`` is None while the value is incomplete); ``end`` is the offset in
    the text just past the closing ``}``; ``bad_at`` the offset of the first invalid character.
    A repeated top-level key makes the object BAD (the parsers take no last-one-wins guesses).
    """

    __slots__ = ("pos", "state", "stack", "out", "fields", "end", "bad_at", "_key", "_key_begin",
                 "_string_is_key", "_hex_left", "_token", "_value_key")

    def __init__(self, start: int):
        self.pos = start
        self.state = _S.VALUE
        self.stack: list[str] = []
        self.out: list[str] = []
        self.fields: dict[str, list[int | None]] = {}
        self.end: int | None = None
        self.bad_at: int | None = None
        self._key: str | None = None  # the top-level key whose value is being read
        self._key_begin = 0
        self._string_is_key = False
        self._hex_left = 0
        self._token = ""  # a number or literal being read
        self._value_key: str | None = None

    @property
    def compact(self) -> str:
        return "".join(self.out)

    def value(self, key: str) -> str | None:
        """The compact text of a top-level field's value so far, or None if it has not begun."""
        span = self.fields.get(key)
        if span is None:
            return None
        return "".join(self.out[span[0]:span[1]])

    def advance(self, text: str) -> Scan:
        """Read ``text[self.pos:]``; never reads past the closing brace."""
        if self.end is not None:
            return Scan.DONE
        if self.bad_at is not None:
            return Scan.BAD
        n = len(text)
        while self.pos < n:
            if self.state is _S.STRING:  # the hot path: runs of plain characters in one slice
                m = _PLAIN_STRING_RUN.match(text, self.pos)
                if m:
                    self.out.append(m.group())
                    self.pos = m.end()
                    continue
            c = text[self.pos]
            if not self._step(c):
                self.bad_at = self.pos
                return Scan.BAD
            if self.end is not None:
                return Scan.DONE
        return Scan.MORE

    def _step(self, c: str) -> bool:
        """Consume one character at ``self.pos``; False if it makes the JSON invalid."""
        s = self.state
        if s is _S.STRING:
            if c == '"':
                self.out.append(c)
                self.pos += 1
                return self._end_string()
            if c == "\\":
                self.state = _S.ESCAPE
            elif c < " ":
                return False
            self.out.append(c)
            self.pos += 1
            return True
        if s is _S.ESCAPE:
            if c == "u":
                self.state, self._hex_left = _S.UNICODE, 4
            elif c in '"\\/bfnrt':
                self.state = _S.STRING
            else:
                return False
            self.out.append(c)
            self.pos += 1
            return True
        if s is _S.UNICODE:
            if c not in _HEX:
                return False
            self._hex_left -= 1
            if self._hex_left == 0:
                self.state = _S.STRING
            self.out.append(c)
            self.pos += 1
            return True
        if s is _S.NUMBER or s is _S.LITERAL:
            if (c in _NUMBER_CHARS) if s is _S.NUMBER else c.isalpha():
                self._token += c
                if s is _S.LITERAL and not any(lit.startswith(self._token) for lit in _LITERALS):
                    return False
                self.out.append(c)
                self.pos += 1
                return True
            ok = (_NUMBER.fullmatch(self._token) if s is _S.NUMBER else self._token in _LITERALS)
            if not ok:
                return False
            self._end_value()
            return True  # ``c`` is read again in the AFTER state
        if c in _WS:
            self.pos += 1
            return True
        if s is _S.VALUE or s is _S.FIRST_ITEM:
            if s is _S.FIRST_ITEM and c == "]":
                return self._close(c)
            return self._begin_value(c)
        if s is _S.FIRST_KEY or s is _S.KEY:
            if c == "}" and s is _S.FIRST_KEY:
                return self._close(c)
            if c != '"':
                return False
            self._string_is_key = True
            self._key_begin = len(self.out)
            self.state = _S.STRING
            self.out.append(c)
            self.pos += 1
            return True
        if s is _S.COLON:
            if c != ":":
                return False
            self.state = _S.VALUE
            self.out.append(c)
            self.pos += 1
            return True
        # AFTER a value
        top = self.stack[-1]
        if c == ",":
            self.state = _S.KEY if top == "{" else _S.VALUE
            self.out.append(c)
            self.pos += 1
            return True
        if c == ("}" if top == "{" else "]"):
            return self._close(c)
        return False

    def _begin_value(self, c: str) -> bool:
        if len(self.stack) == 1 and self._key is not None:
            self.fields[self._key] = [len(self.out), None]
            self._value_key, self._key = self._key, None
        if c in "{[":
            if not self.stack and c != "{":
                return False
            self.stack.append(c)
            self.state = _S.FIRST_KEY if c == "{" else _S.FIRST_ITEM
        elif c == '"':
            self._string_is_key = False
            self.state = _S.STRING
        elif c == "-" or c.isdigit():
            self.state, self._token = _S.NUMBER, c
        elif c in "tfn":
            self.state, self._token = _S.LITERAL, c
        else:
            return False
        if not self.stack:  # the scan is of an object, nothing else
            return False
        self.out.append(c)
        self.pos += 1
        return True

    def _end_string(self) -> bool:
        if self._string_is_key:
            self._string_is_key = False
            self.state = _S.COLON
            if len(self.stack) == 1:
                key = json.loads("".join(self.out[self._key_begin:]))
                if key in self.fields:
                    return False
                self._key = key
            return True
        self._end_value()
        return True

    def _close(self, c: str) -> bool:
        self.stack.pop()
        self.out.append(c)
        self.pos += 1
        if not self.stack:
            self.end = self.pos
            return True
        self._end_value()
        return True

    def _end_value(self) -> None:
        self.state = _S.AFTER
        if len(self.stack) == 1 and self._value_key is not None:
            self.fields[self._value_key][1] = len(self.out)
            self._value_key = None
