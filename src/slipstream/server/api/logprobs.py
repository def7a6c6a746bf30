r"""Exact OpenAI logprobs objects from token bytes (pure functions and one small running state).

A token is a byte string, not a string: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen) and
SentencePiece byte fallback (``<0xE4>``) split a character over several tokens. So every entry is
rendered from the token's own bytes:

- ``bytes``: the token's raw bytes, so ``b"".join(bytes of every entry).decode() == text``
  (for a text that holds every token's text: a special token skipped in mid-output by
  ``skip_special_tokens`` still has its own bytes).
- ``token``: the bytes decoded as UTF-8 where they are valid on their own; each byte that is not
  (part of a split character) is written as the four characters ``\xNN``: the token
  ``b" \xf0\x9f"`` is the string `` \xf0\x9f`` (JSON ``" \\xf0\\x9f"``), as OpenAI's chat API
  (and DeepSeek's) return it, where vLLM returns U+FFFD. The legacy completions ``tokens`` and
  ``top_logprobs`` keys prefix such a token with ``bytes:`` (``bytes:\xe2\x80``), as OpenAI's
  legacy completions API shows them; a token that is valid UTF-8 is its text in both.
- ``text_offset`` (legacy): the character offset in the choice's text where a token begins; a
  token that begins inside a character (its first byte continues one) gets that character's
  offset. Offsets never decrease and never pass the end of the text given so far.
- A choice that ended on an EOS or stop token id whose text the output leaves out
  (``skip_special_tokens``) has no entry for it: see :func:`drop_hidden_stop_token`.

Public API: :class:`TokenBytes`, :func:`chat_logprobs`, :class:`CompletionLogprobs`,
:func:`concat_completion_logprobs`, :func:`drop_hidden_stop_token`.
"""
from __future__ import annotations

import re

from slipstream.server.engine.outputs import Logprob

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (Radford et al. 2019, ``encoder.py``): printable bytes stand
    for themselves, the other 68 for the characters U+0100 onwards, in byte order. Char → byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def _is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's decoder is byte-level (GPT-2 style) rather than SentencePiece-style."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow tokenizer: GPT-2's keeps its byte table
        return hasattr(tokenizer, "byte_encoder")
    decoder = backend.decoder  # its state is its JSON: ByteLevel, or a Sequence holding one
    return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()


def _escape(data: bytes) -> str:
    r"""UTF-8 text, with every byte that is not part of a valid character written ``\xNN``."""
    return data.decode("utf-8", errors="backslashreplace")


class TokenBytes:
    """Each token id's raw bytes, read once from a Hugging Face tokenizer.

    Byte-level BPE tokens map back through GPT-2's byte alphabet; SentencePiece tokens turn
    ``▁`` into a space and ``<0xAB>`` byte-fallback tokens into the byte 0xAB; added and special
    tokens (``<|im_end|>``) are their text's UTF-8. Ids the tokenizer does not know (a model's
    vocabulary padded past the tokenizer's) have no bytes.

    Args:
        tokenizer: a transformers tokenizer (fast, or GPT-2's slow one).
    """

    def __init__(self, tokenizer):
        n = len(tokenizer)
        pieces = tokenizer.convert_ids_to_tokens(list(range(n)))
        if _is_byte_level(tokenizer):
            table = _byte_level_decoder()
            data = [bytes(table[c] for c in p) if all(c in table for c in p) else p.encode()
                    for p in (p or "" for p in pieces)]
        else:
            data = []
            for p in pieces:
                p = p or ""
                m = _BYTE_FALLBACK.fullmatch(p)
                data.append(bytes([int(m.group(1), 16)]) if m else p.replace("\u2581", " ").encode())
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        for i, tok in added.items():
            if i < n:
                data[i] = getattr(tok, "content", str(tok)).encode()
                if getattr(tok, "special", False):
                    special.add(i)
        self._bytes: list[bytes] = data
        self._special = frozenset(special)

    def __len__(self) -> int:
        return len(self._bytes)

    def bytes_of(self, token_id: int) -> bytes:
        """The token's raw bytes (``b""`` for an id the tokenizer does not know)."""
        return self._bytes[token_id] if 0 <= token_id < len(self._bytes) else b""

    def is_special(self, token_id: int) -> bool:
        """Whether the token is special (EOS, chat markers): text that ``skip_special_tokens`` leaves out."""
        return token_id in self._special

    def token(self, token_id: int) -> str:
        r"""The chat API's ``token``: the bytes as text, each byte outside valid UTF-8 as ``\xNN``."""
        return _escape(self.bytes_of(token_id))

    def legacy_token(self, token_id: int) -> str:
        r"""The legacy completions ``tokens`` entry: the text, or ``bytes:`` + :meth:`token`'s form
        (``bytes:\xe2\x80``) when the bytes are not valid UTF-8 on their own (OpenAI's legacy form)."""
        data = self.bytes_of(token_id)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + _escape(data)


def _chat_entry(token_bytes: TokenBytes, token_id: int, logprob: float) -> dict:
    return {"token": token_bytes.token(token_id), "logprob": logprob, "bytes": list(token_bytes.bytes_of(token_id))}


def chat_logprobs(entries: list[Logprob], token_bytes: TokenBytes) -> dict:
    """The chat ``choices[i].logprobs`` object (or one stream chunk's) for the given tokens.

    Args:
        entries: the choice's generated tokens (``CompletionOutput.logprobs``), already passed
            through :func:`drop_hidden_stop_token` where the choice finished.
        token_bytes: the served tokenizer's :class:`TokenBytes`.

    Returns:
        ``{"content": [{"token": str, "logprob": float, "bytes": list[int], "top_logprobs":
        [{"token", "logprob", "bytes"}, …]}, …], "refusal": None}``; ``top_logprobs`` holds the
        entry's top-N (N = the request's ``top_logprobs``), most likely first.
    """
    return {"content": [dict(_chat_entry(token_bytes, e.token_id, e.logprob),
                             top_logprobs=[_chat_entry(token_bytes, t, v) for t, v in e.top]) for e in entries],
            "refusal": None}


def drop_hidden_stop_token(entries: list[Logprob], finish_reason: str | None, stop_reason: str | int | None,
                           token_bytes: TokenBytes, skip_special_tokens: bool = True) -> list[Logprob]:
    """The entries that belong to the text: without the last one when the choice ended on an EOS
    or stop token id (``finish_reason == "stop"`` and ``stop_reason`` None or an int) that is a
    special token left out of the text (``skip_special_tokens``). A stop token whose text is in
    the output (a plain token, or ``skip_special_tokens=False``) keeps its entry.

    Args:
        entries: a choice's entries, or the last stream chunk's (the one with ``finish_reason``).
        finish_reason, stop_reason: the choice's, from its final :class:`CompletionOutput`.
        token_bytes: the served tokenizer's :class:`TokenBytes`.
        skip_special_tokens: the request's setting.

    Returns:
        ``entries`` itself, or a new list without its last element.
    """
    if (entries and finish_reason == "stop" and not isinstance(stop_reason, str) and skip_special_tokens
            and token_bytes.is_special(entries[-1].token_id)):
        return entries[:-1]
    return entries


class CompletionLogprobs:
    """The legacy completions ``logprobs`` of one choice, rendered chunk by chunk.

    Keeps the running text position between calls, so a stream's chunks continue each other's
    ``text_offset``; call :meth:`add_prompt` first for ``echo``, then :meth:`add` per chunk (or
    once). Each call returns the fragment for its tokens; :func:`concat_completion_logprobs`
    joins fragments into one object for a non-streamed response.

    ``text_offset[i]`` is counted in characters (Python ``str`` indices) of the choice's text —
    prompt text then completion text with ``echo`` — from the tokens' bytes: a token that begins
    inside a multi-byte character gets that character's offset. Offsets never exceed the length
    of the text passed in so far, so a token the text leaves out (a stop string that is cut, a
    special token skipped with ``skip_special_tokens``) points at most at the end of the text.

    Args:
        token_bytes: the served tokenizer's :class:`TokenBytes`.
        skip_special_tokens: the request's setting; special tokens of the completion then take no
            room in the text (the prompt's always do: an echoed prompt keeps its text).
    """

    def __init__(self, token_bytes: TokenBytes, skip_special_tokens: bool = True):
        self.token_bytes = token_bytes
        self.skip_special_tokens = skip_special_tokens
        self._base = 0        # characters of the sections (prompt) before the current one
        self._text_chars = 0  # characters of the current section's text passed in so far
        self._starts = 0      # characters begun by the current section's token bytes (UTF-8 lead bytes)

    def add_prompt(self, prompt_token_ids: list[int], prompt_logprobs: list[Logprob | None], prompt_text: str) -> dict:
        """The ``echo`` fragment: one entry per prompt token, the first with ``token_logprobs`` and
        ``top_logprobs`` null (nothing predicts it, as in OpenAI's legacy API and vLLM).

        Args:
            prompt_token_ids: the prompt, ``[P]``.
            prompt_logprobs: ``RequestOutput.prompt_logprobs`` (``P`` entries, the first None).
            prompt_text: the echoed prompt text; the completion's offsets start after it.

        Raises:
            ValueError: ``prompt_logprobs`` is not one entry per prompt token.
        """
        if len(prompt_logprobs) != len(prompt_token_ids):
            raise ValueError(f"prompt_logprobs has {len(prompt_logprobs)} entries for {len(prompt_token_ids)} "
                             "prompt tokens; ask the engine for prompt_logprobs")
        out = self._render(prompt_token_ids, prompt_logprobs, prompt_text, skip_special=False)
        self._base += len(prompt_text)
        self._text_chars = self._starts = 0
        return out

    def add(self, entries: list[Logprob], text: str) -> dict:
        """The fragment for the next generated tokens.

        Args:
            entries: the chunk's entries (``CompletionOutput.logprobs``, through
                :func:`drop_hidden_stop_token` for the final chunk).
            text: the text that goes out with them (the chunk's ``text``; the whole text when not
                streaming).

        Returns:
            ``{"tokens": list[str], "token_logprobs": list[float], "top_logprobs":
            list[dict[str, float]], "text_offset": list[int]}``; each ``top_logprobs`` dict holds
            the top-N and the chosen token (so up to N + 1 keys, as OpenAI's legacy API documents).
        """
        return self._render([e.token_id for e in entries], entries, text, self.skip_special_tokens)

    def _render(self, ids: list[int], entries: list[Logprob | None], text: str, skip_special: bool) -> dict:
        tb = self.token_bytes
        self._text_chars += len(text)
        tokens, values, tops, offsets = [], [], [], []
        for token_id, e in zip(ids, entries):
            data = b"" if skip_special and tb.is_special(token_id) else tb.bytes_of(token_id)
            inside = bool(data) and 0x80 <= data[0] < 0xC0 and self._starts > 0  # continues a character
            offsets.append(self._base + min(self._starts - inside, self._text_chars))
            self._starts += sum(1 for b in data if not 0x80 <= b < 0xC0)
            tokens.append(tb.legacy_token(token_id))
            if e is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(e.logprob)
            top = {}
            for t, v in [*e.top, (e.token_id, e.logprob)]:
                top.setdefault(tb.legacy_token(t), v)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def concat_completion_logprobs(fragments: list[dict]) -> dict:
    """One legacy ``logprobs`` object from :class:`CompletionLogprobs` fragments, in order."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {k: [v for f in fragments for v in f[k]] for k in keys}


def vllm_prompt_logprobs(prompt_token_ids: list[int], entries: list[Logprob | None],
                         token_bytes: TokenBytes) -> list[dict | None]:
    """vLLM's ``choices[i].prompt_logprobs``: per prompt token None (the first: nothing predicts
    it) or ``{"<token id>": {"logprob", "rank", "decoded_token"}}`` for the prompt's own token and
    the top-N. ``rank`` is 1 for the most likely token; the prompt's own token has a rank only when
    it is among the top-N (null otherwise: the full ranking is not computed)."""
    out: list[dict | None] = []
    for token_id, e in zip(prompt_token_ids, entries):
        if e is None:
            out.append(None)
            continue
        ranked = {t: (v, r) for r, (t, v) in enumerate(e.top, start=1)}
        ranked.setdefault(token_id, (e.logprob, None))
        out.append({str(t): {"logprob": v, "rank": r, "decoded_token": token_bytes.token(t)}
                    for t, (v, r) in ranked.items()})
    return out
