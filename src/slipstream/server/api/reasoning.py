"""Reasoning apart from the answer (issue 13, item 5): ``--reasoning-parser qwen3 | deepseek_r1``.

Models that think in tags write ``<think> … </think>`` before their answer. The chat endpoint
returns the thinking as ``message.reasoning_content`` and the rest as ``content`` — streamed as
``delta.reasoning_content`` chunks, then ``delta.content`` chunks — as vLLM's reasoning parsers
of the same names do (``vllm/reasoning/qwen3_reasoning_parser.py``,
``deepseek_r1_reasoning_parser.py``; docs "Reasoning Outputs").

Rules (both formats; they differ only in where the output starts):

- Where the output starts is decided by the prompt it continues (vLLM checks the prompt's token
  ids the same way): when the prompt's last think tag is ``<think>`` the output starts inside the
  reasoning (DeepSeek-R1 and Qwen3-Thinking-2507 templates open it in the generation prompt;
  ``continue_final_message`` of an assistant turn that began ``<think>…``); when it is
  ``</think>`` the output is answer only (Qwen3's ``chat_template_kwargs: {"enable_thinking":
  false}`` renders an empty ``<think>\\n\\n</think>`` block). With no tag in the prompt,
  ``deepseek_r1`` starts inside (R1 may skip writing ``<think>``) and ``qwen3`` outside (Qwen3
  writes ``<think>`` itself).
- A ``<think>`` at the very start of the output (after whitespace only) opens the reasoning, or,
  already inside, is dropped (DeepSeek-R1-0528 writes it again). A ``<think>`` anywhere later is
  text.
- The first ``</think>`` ends the reasoning; everything after it is content, verbatim (content
  may hold tool calls: feed it to :class:`~slipstream.server.api.tools.ToolCallStream`). Text of
  an unterminated reasoning — cut at ``max_tokens`` — is all reasoning.
- The reasoning text is kept verbatim between the tags; empty parts are None (``extract``) or
  not sent (stream).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_WS = " \t\n\r"


class UnknownReasoningParser(ValueError):
    """``--reasoning-parser`` names no known format."""

    param = "reasoning_parser"


class _Phase(Enum):
    OPENING = 0  # at the start of the output: a "<think>" may follow whitespace
    REASONING = 1  # inside the reasoning: looking for "</think>"
    CONTENT = 2  # the answer: passed through


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningStream:
    """Splits one choice's text deltas into reasoning and content as they are generated.

    ``feed(delta)`` returns OpenAI chat-completion-chunk deltas in order, ``{"reasoning_content":
    str}`` then ``{"content": str}`` (never empty strings); text is held back only while it may be
    part of a tag (a partial ``</think>``, or whitespace and a partial ``<think>`` at the start).
    ``finish()`` releases what was held back. Deltas may split the text anywhere, even inside a
    tag; the concatenations equal :meth:`ReasoningParser.extract` of the whole text.

    Args:
        inside: the output starts inside the reasoning (see :meth:`ReasoningParser.starts_inside`).
    """

    __slots__ = ("inside", "_phase", "_held")

    def __init__(self, inside: bool) -> None:
        self.inside = inside
        self._phase = _Phase.OPENING
        self._held = ""

    def feed(self, delta: str) -> list[dict]:
        self._held += delta
        return self._run(final=False)

    def finish(self) -> list[dict]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[dict]:
        out: list[dict] = []
        if self._phase is _Phase.OPENING:
            rest = self._held.lstrip(_WS)
            if not final and THINK_OPEN.startswith(rest):  # whitespace, or a partial "<think>"
                return out
            if rest.startswith(THINK_OPEN):  # the separating whitespace goes with the tag
                self._held = rest[len(THINK_OPEN):]
                self._phase = _Phase.REASONING
            else:
                self._phase = _Phase.REASONING if self.inside else _Phase.CONTENT
        if self._phase is _Phase.REASONING:
            end = self._held.find(THINK_CLOSE)
            if end >= 0:
                self._emit(out, "reasoning_content", self._held[:end])
                self._held = self._held[end + len(THINK_CLOSE):]
                self._phase = _Phase.CONTENT
            else:
                keep = 0 if final else _partial_tag(self._held, THINK_CLOSE)
                self._emit(out, "reasoning_content", self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
        if self._phase is _Phase.CONTENT:
            self._emit(out, "content", self._held)
            self._held = ""
        return out

    @staticmethod
    def _emit(out: list[dict], key: str, text: str) -> None:
        if text:
            out.append({key: text})


@dataclass(frozen=True, slots=True)
class ReasoningParser:
    """A format's reader, chosen by name (``--reasoning-parser``); stateless and shareable.

    name: ``qwen3`` or ``deepseek_r1``.
    starts_inside_by_default: where the output starts when the prompt holds no think tag.
    """

    name: str
    starts_inside_by_default: bool

    def starts_inside(self, prompt: str) -> bool:
        """Whether an output continuing ``prompt`` (the rendered conversation) starts inside the
        reasoning: the prompt's last think tag decides, else the format's default."""
        opened, closed = prompt.rfind(THINK_OPEN), prompt.rfind(THINK_CLOSE)
        if opened < 0 and closed < 0:
            return self.starts_inside_by_default
        return opened > closed

    def extract(self, text: str, *, inside: bool | None = None) -> tuple[str | None, str | None]:
        """Reasoning and content of a finished output.

        Args:
            text: the whole output.
            inside: the output starts inside the reasoning (None: the format's default).

        Returns:
            ``(reasoning, content)``, each None when empty.
        """
        stream = self.stream(inside=inside)
        deltas = stream.feed(text) + stream.finish()
        reasoning = "".join(d["reasoning_content"] for d in deltas if "reasoning_content" in d)
        content = "".join(d["content"] for d in deltas if "content" in d)
        return reasoning or None, content or None

    def stream(self, *, inside: bool | None = None) -> ReasoningStream:
        """A new :class:`ReasoningStream` for one choice of one request."""
        return ReasoningStream(self.starts_inside_by_default if inside is None else inside)


PARSERS: dict[str, ReasoningParser] = {
    p.name: p for p in (ReasoningParser("qwen3", False), ReasoningParser("deepseek_r1", True))
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser of ``--reasoning-parser name``.

    Raises:
        UnknownReasoningParser: (a ``ValueError`` with ``param``) ``name`` is no known format.
    """
    try:
        return PARSERS[name]
    except KeyError:
        raise UnknownReasoningParser(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(PARSERS))}") from None
