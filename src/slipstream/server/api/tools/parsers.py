"""Tool calls out of model output: a finished text (:meth:`ToolParser.extract`) or text deltas as
they are generated (:class:`ToolCallStream`), in one of the formats of :mod:`.formats`
(vLLM's ``--tool-call-parser hermes | llama3_json | mistral``).

One state machine reads both ways, so a stream and ``extract`` agree by construction, on any
output: a call is reported once its object has closed — its arguments complete JSON — and sent
whole (its announcement, then its arguments in one delta). An output that breaks or is cut off
inside a call (e.g. at ``max_tokens``, with parallel calls under ``tool_choice: "required"``)
reports that text as content, streamed or not; a stream never sends a call whose arguments could
end cut off (``{"city":"Paris",``).

Rules (the same for every format):

- A call is the format's marker followed by a JSON object with a string ``name`` and an object of
  arguments (``arguments``; ``llama3_json`` also ``parameters``); other keys are ignored, a
  repeated key or invalid JSON makes it not a call. Text that is not a call stays content —
  nothing is dropped but the whitespace that only separates content from a call.
- ``arguments`` is the model's JSON with the whitespace outside strings removed
  (``{"city":"Paris"}``), as OpenAI returns it; it always parses as a JSON object.
- Calls to names not in the request's ``tools`` are returned as they are, as vLLM does: the client
  sees what the model asked for (``tool_choice`` ``required`` or a named function makes the
  grammar of :mod:`.grammar` allow declared names only).
- Ids are OpenAI's shape, ``call_`` + 24 alphanumerics (``mistral``: 9 alphanumerics, the shape
  Mistral's templates require back in ``tool_call_id``).
- With ``parallel_tool_calls=False`` only the first call is returned, as recent vLLM does: a later
  call is read (so its text does not turn into content) and dropped — no deltas, not in
  ``tool_calls``. Text outside the calls is content as usual.
"""
from __future__ import annotations

import json
from enum import Enum

from .formats import ToolFormat, get_format
from .scan import ObjectScan, Scan

_WS = " \t\n\r"


class _State(Enum):
    START = 0  # llama3_json: the output may open with a bare call object
    CONTENT = 1
    OPEN = 2  # after a marker: "[" (mistral) and the first call object
    OBJECT = 3  # inside a call object
    AFTER = 4  # after a call object: its end tag, a separator, "]" or content
    NEXT = 5  # after a separator: the next call object


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _partial_suffix(text: str, start: int, marker: str) -> int:
    """Length of the longest suffix of ``text[start:]`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStream:
    """Incremental extraction of tool calls from text deltas.

    ``feed(delta)`` returns OpenAI chat-completion-chunk deltas, in order:

    - ``{"content": str}`` — text; held back only while it may be the start of a call
      (a partial marker, whitespace before a marker, a call object not yet decided);
    - ``{"tool_calls": [{"index": i, "id": str, "type": "function",
      "function": {"name": str, "arguments": ""}}]}`` — once call ``i``'s name is known;
    - ``{"tool_calls": [{"index": i, "function": {"arguments": str}}]}`` — argument fragments;
      their concatenation is call ``i``'s ``arguments``.

    ``finish()`` reads the end of the output and returns the last deltas. ``tool_calls`` lists the
    calls announced so far, ``[{"id", "type": "function", "function": {"name", "arguments"}}]``
    (finish_reason ``tool_calls`` when non-empty). Deltas may split text anywhere, e.g. inside a
    marker, a JSON string or an escape. A call is announced once its object has closed (see the
    module docstring); ``parallel_tool_calls=False`` drops every call after the first.
    """

    def __init__(self, fmt: ToolFormat, *, parallel_tool_calls: bool = True):
        self.fmt = fmt
        self.tool_calls: list[dict] = []
        self._single = not parallel_tool_calls  # keep the first call only
        self._dropping = False  # the call being read is one after the first: read, never sent
        self._text = ""
        self._pos = 0  # text[:pos] is decided: emitted, or dropped as separator
        self._state = _State.START if fmt.bare_at_start else _State.CONTENT
        self._search = 0  # where the next marker may start (past a rejected one)
        self._cursor = 0  # OPEN/AFTER/NEXT: where to read next
        self._retry_from = 0  # the search position after a rejected attempt
        self._in_list = False
        self._after_call = False  # whitespace right after a call only separates it from content
        self._scan: ObjectScan | None = None
        self._call: dict | None = None  # the announced call whose object is being read
        self._sent = 0  # ObjectScan.out chunks of its arguments already sent
        self._args_key = ""  # which of the format's argument keys this call uses
        self._events: list[dict] = []

    def feed(self, delta: str) -> list[dict]:
        self._text += delta
        self._run(final=False)
        return self._take()

    def finish(self) -> list[dict]:
        self._run(final=True)
        return self._take()

    # -- the machine: each handler returns False when it needs more text --------------------------

    def _run(self, final: bool) -> None:
        handlers = {_State.START: self._start, _State.CONTENT: self._content_state,
                    _State.OPEN: self._open, _State.OBJECT: self._object, _State.AFTER: self._after,
                    _State.NEXT: self._next}
        while handlers[self._state](final):
            pass

    def _start(self, final: bool) -> bool:
        i = _skip_ws(self._text, self._pos)
        if i == len(self._text) and not final:
            return False
        if i < len(self._text) and self._text[i] == "{":
            self._retry_from = self._pos
            self._begin_object(i)
        else:
            self._state = _State.CONTENT
        return True

    def _content_state(self, final: bool) -> bool:
        text, marker = self._text, self.fmt.marker
        j = text.find(marker, max(self._search, self._pos))
        if j >= 0:
            k = j
            while k > self._pos and text[k - 1] in _WS:
                k -= 1
            self._emit_content(text[self._pos:k])
            self._pos = k
            self._retry_from = j + 1
            self._cursor = j + len(marker)
            self._in_list = False
            self._state = _State.OPEN
            return True
        end = len(text)
        if not final:
            end -= _partial_suffix(text, max(self._search, self._pos), marker)
            while end > self._pos and text[end - 1] in _WS:
                end -= 1
        self._emit_content(text[self._pos:end])
        self._pos = end
        return False

    def _open(self, final: bool) -> bool:
        text = self._text
        i = _skip_ws(text, self._cursor)
        if i == len(text):
            return self._reject() if final else False
        if self.fmt.list_open and not self._in_list and text[i] == self.fmt.list_open:
            self._in_list = True
            self._cursor = i + 1
            return True
        if text[i] != "{":
            return self._reject()
        self._begin_object(i)
        return True

    def _object(self, final: bool) -> bool:
        scan = self._scan
        result = scan.advance(self._text)
        if result is Scan.BAD:
            return self._reject()
        fields = scan.fields
        args_keys = [k for k in self.fmt.args_keys if k in fields]
        name, args = fields.get("name"), (fields[args_keys[0]] if args_keys else None)
        if (len(args_keys) > 1 or (name is not None and scan.out[name[0]] != '"')
                or (args is not None and scan.out[args[0]] != "{")):
            return self._reject()
        if result is not Scan.DONE:
            return self._reject() if final else False  # cut off inside the object: content
        if name is None or name[1] is None or args is None:
            return self._reject()
        self._announce(scan.value("name"), args_keys[0])
        self._send_arguments()
        self._call = None
        self._after_call = True
        self._pos = self._cursor = scan.end
        self._state = _State.AFTER
        return True

    def _after(self, final: bool) -> bool:
        text, fmt = self._text, self.fmt
        i = _skip_ws(text, self._cursor)
        rest = text[i:]
        if not rest and not final:
            return False
        if fmt.call_end:
            if rest.startswith(fmt.call_end):
                self._pos = i + len(fmt.call_end)
            elif rest and fmt.call_end.startswith(rest) and not final:
                return False
        elif fmt.separator and rest.startswith(fmt.separator):
            self._cursor = i + len(fmt.separator)
            self._state = _State.NEXT
            return True
        elif self._in_list and rest.startswith(fmt.list_close):
            self._pos = i + len(fmt.list_close)
        self._in_list = False
        self._state = _State.CONTENT
        return True

    def _next(self, final: bool) -> bool:
        i = _skip_ws(self._text, self._cursor)
        if i == len(self._text) and not final:
            return False
        if i < len(self._text) and self._text[i] == "{":
            self._retry_from = self._search  # a rejected next call gives back the separator only
            self._begin_object(i)
            return True
        return self._reject()

    # -- helpers -----------------------------------------------------------------------------------

    def _begin_object(self, i: int) -> None:
        self._scan = ObjectScan(i)
        self._state = _State.OBJECT

    def _reject(self) -> bool:
        """The attempt since ``pos`` is no call: read it again as content, past its marker."""
        self._search = self._retry_from
        self._in_list = False
        self._scan = None
        self._state = _State.CONTENT
        return True

    def _announce(self, name_json: str, args_key: str) -> None:
        call = {"id": self.fmt.new_call_id(), "type": "function",
                "function": {"name": json.loads(name_json), "arguments": ""}}
        self._call, self._sent, self._args_key = call, 0, args_key
        self._dropping = self._single and bool(self.tool_calls)
        if self._dropping:  # parallel_tool_calls false: a later call is read to its end and dropped
            return
        self.tool_calls.append(call)
        self._events.append({"tool_calls": [{"index": len(self.tool_calls) - 1, **call,
                                             "function": dict(call["function"])}]})

    def _send_arguments(self) -> None:
        """Send the arguments' compact text read since the last fragment."""
        begin, end = self._scan.fields[self._args_key]
        stop = len(self._scan.out) if end is None else end
        fragment = "".join(self._scan.out[max(begin, self._sent):stop])
        self._sent = stop
        if fragment and not self._dropping:
            self._call["function"]["arguments"] += fragment
            self._events.append({"tool_calls": [{"index": len(self.tool_calls) - 1,
                                                 "function": {"arguments": fragment}}]})

    def _emit_content(self, s: str) -> None:
        if self._after_call:
            s = s.lstrip(_WS)
        if s:
            self._after_call = False
            self._events.append({"content": s})

    def _take(self) -> list[dict]:
        """The pending deltas, with neighbours of one kind (content; one call's arguments) merged."""
        merged: list[dict] = []
        for d in self._events:
            prev = merged[-1] if merged else None
            if prev and "content" in d and "content" in prev:
                prev["content"] += d["content"]
            elif (prev and "tool_calls" in prev and "tool_calls" in d and "id" not in d["tool_calls"][0]
                  and prev["tool_calls"][0]["index"] == d["tool_calls"][0]["index"]
                  and "id" not in prev["tool_calls"][0]):
                prev["tool_calls"][0]["function"]["arguments"] += d["tool_calls"][0]["function"]["arguments"]
            else:
                merged.append(d)
        self._events = []
        return merged


class ToolParser:
    """A format's reader, chosen by name (``--tool-call-parser``); stateless and shareable.

    ``skip_special_tokens`` is False for formats whose marker is a special token of the model's
    vocabulary (``<|python_tag|>``, ``[TOOL_CALLS]``): the detokenizer must keep it.
    """

    def __init__(self, fmt: ToolFormat):
        self.format = fmt
        self.name = fmt.name
        self.skip_special_tokens = not fmt.special_marker

    def extract(self, text: str, *, parallel_tool_calls: bool = True) -> tuple[str | None, list[dict]]:
        """Content and tool calls of a finished output (the first call only with
        ``parallel_tool_calls=False``).

        Returns:
            ``(content, tool_calls)``: ``content`` is the text outside the calls (None when
            empty); ``tool_calls`` is a list of ``{"id": str, "type": "function",
            "function": {"name": str, "arguments": str (a JSON object's text)}}``.
        """
        stream = ToolCallStream(self.format, parallel_tool_calls=parallel_tool_calls)
        deltas = stream.feed(text) + stream.finish()
        content = "".join(d["content"] for d in deltas if "content" in d)
        return content or None, stream.tool_calls

    def stream(self, *, parallel_tool_calls: bool = True) -> ToolCallStream:
        """A new :class:`ToolCallStream` for one choice of one request."""
        return ToolCallStream(self.format, parallel_tool_calls=parallel_tool_calls)


def get_parser(name: str) -> ToolParser:
    """The parser of ``--tool-call-parser name``.

    Raises:
        UnknownToolParser: (a ``ValueError`` with ``param``) ``name`` is no known format.
    """
    return ToolParser(get_format(name))
