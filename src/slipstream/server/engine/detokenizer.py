"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters (a byte-level BPE token can hold half of
one) and, for SentencePiece, drops the space a word starts with. So each step decodes a short
window twice — the context before the new tokens and the context with them — and emits the
difference only once it no longer ends in U+FFFD (vLLM's prefix/read offsets). Stop strings are
searched in the text so far; a tail that could still grow into a stop string is held back.
"""
from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded before the output so the first word keeps its space


class IncrementalDetokenizer:
    """Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the prompt, for context only (its text is never emitted).
        stop: stop strings; the first one found ends the text (excluded from it unless ``include_stop``).
        skip_special_tokens: leave special tokens (EOS, chat markers) out of the text.
        include_stop: keep the stop string that ended the text (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str], skip_special_tokens: bool = True,
                 include_stop: bool = False):
        self.tokenizer = tokenizer
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop
        self.text = ""          # output text so far (stable, ending at the stop string)
        self.emitted = 0        # characters of self.text already handed out
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one token; return the stop string if the text now contains one, else None."""
        self.tokens.append(token_id)
        before = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        after = self._decode(self.tokens[self.prefix_offset:])
        if len(after) <= len(before) or after.endswith(REPLACEMENT_CHAR):
            return None  # an incomplete character or a skipped special token: wait
        start = len(self.text)
        self.text += after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if not (check_stop and self.stop):
            return None
        window = max(0, start - self.max_stop_len + 1)
        found = [(self.text.find(s, window), s) for s in self.stop]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return None
        pos, s = min(found)
        self.text = self.text[:pos + len(s) if self.include_stop else pos]
        self.stopped_by = s
        return s

    def take(self, finished: bool) -> str:
        """The text not yet handed out; while unfinished, keep back a tail that may start a stop string."""
        end = len(self.text)
        if not finished and self.stop and not self.include_stop:  # a kept stop string needs no hold-back
            end -= self._partial_stop_len()
        end = max(end, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _partial_stop_len(self) -> int:
        text = self.text
        for k in range(min(len(text), self.max_stop_len - 1), 0, -1):
            suffix = text[-k:]
            if any(s.startswith(suffix) for s in self.stop):
                return k
        return 0
