"""The three tool-call formats, as data: what the parsers read, the prompt teaches and the grammar
enforces, in one place.

- ``hermes``: Hermes 2 Pro / Qwen2.5 (``NousResearch/Hermes-2-Pro-Llama-3-8B`` and
  ``Qwen/Qwen2.5-*-Instruct`` chat templates; vLLM ``--tool-call-parser hermes``)::

      <tool_call>
      {"name": "get_weather", "arguments": {"city": "Paris"}}
      </tool_call>

  one block per call; tool results go back as ``<tool_response>…</tool_response>`` in a user turn.
- ``llama3_json``: Llama 3.1/3.2/3.3 JSON tool calling (Meta's model card, "JSON based tool
  calling"; vLLM ``llama3_json``): ``{"name": "get_weather", "parameters": {"city": "Paris"}}``,
  optionally after ``<|python_tag|>``, several separated by ``;``; a call object at the very start
  of the output needs no marker.
- ``mistral``: Mistral v3 tokenizers (``mistral-common``; vLLM ``mistral``):
  ``[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]``; results go back as
  ``[TOOL_RESULTS]{"content": …, "call_id": …}[/TOOL_RESULTS]``.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass

_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolFormat:
    name: str
    marker: str  # opens calls anywhere in the output
    bare_at_start: bool  # a call object at the very start of the output needs no marker
    list_open: str  # "[" when the calls after the marker form a JSON array, else ""
    separator: str  # between the calls that follow one marker; "" when each call has its own marker
    call_end: str  # closes one call; optional when parsing (outputs cut at a stop string lack it)
    args_keys: tuple[str, ...]  # accepted names of the arguments field; the first is the one written
    special_marker: bool  # the marker is a special token: serve with skip_special_tokens=False
    id_prefix: str  # a call id is this prefix and ``id_length`` random alphanumerics
    id_length: int

    @property
    def args_key(self) -> str:
        return self.args_keys[0]

    @property
    def list_close(self) -> str:
        return "]" if self.list_open else ""

    def frame(self) -> tuple[str, str, str, str, str]:
        """The literal text around call objects: ``(before all, before each, after each, between,
        after all)``; :meth:`write` and the grammar of ``tool_choice`` both build on it."""
        if self.call_end:
            return "", self.marker + "\n", "\n" + self.call_end, "\n", ""
        if self.list_open:
            return self.marker + self.list_open, "", "", ", ", self.list_close
        return "", "", "", self.separator + " ", ""

    def write(self, calls: list[str]) -> str:
        """Call objects (JSON texts) as the model writes them in this format."""
        before, each_before, each_after, between, after = self.frame()
        return before + between.join(each_before + c + each_after for c in calls) + after

    def new_call_id(self) -> str:
        """A fresh tool-call id: OpenAI's ``call_`` + 24 alphanumerics, or, for ``mistral``,
        9 alphanumerics, the only shape Mistral's chat templates accept back in ``tool_call_id``."""
        return self.id_prefix + "".join(secrets.choice(_ALNUM) for _ in range(self.id_length))


FORMATS: dict[str, ToolFormat] = {
    f.name: f
    for f in (
        ToolFormat("hermes", "<tool_call>", False, "", "", "</tool_call>", ("arguments",), False,
                   "call_", 24),
        ToolFormat("llama3_json", "<|python_tag|>", True, "", ";", "", ("parameters", "arguments"),
                   True, "call_", 24),
        ToolFormat("mistral", "[TOOL_CALLS]", False, "[", ",", "", ("arguments",), True, "", 9),
    )
}


class UnknownToolParser(ValueError):
    """``--tool-call-parser`` names no known format."""

    param = "tool_call_parser"


def get_format(name: str) -> ToolFormat:
    """The format called ``name``.

    Raises:
        UnknownToolParser: not one of :data:`FORMATS`.
    """
    try:
        return FORMATS[name]
    except KeyError:
        raise UnknownToolParser(
            f"unknown tool-call parser {name!r}; choose one of {', '.join(sorted(FORMATS))}") from None
