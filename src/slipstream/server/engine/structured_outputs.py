"""Structured outputs: a request's constraint compiled to a grammar, and its own matcher over it.

The grammar library is llguidance (guidance-ai/llguidance, MIT): an Earley parser over a lazily
built derivative-based lexer, computing a whole-vocabulary token mask in about 50 µs of one CPU
core for a 128k-token vocabulary (its README, "About"; design in "Making Structured Outputs Go
Brrr", 2025), from a Rust core shipped as abi3 wheels with no torch pin; vLLM, SGLang and
llama.cpp integrate it. JSON Schema, regular expressions and
Lark grammars (which may embed ``%json {...}``) all compile to its grammar format.

Compiling builds a matcher once per distinct constraint (a bounded LRU cache keyed by the
canonical constraint); each request gets a deep copy (microseconds). Compile off the step loop:
``AsyncLLM.generate`` builds requests in a worker thread.
"""
from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from typing import Any

import llguidance
import llguidance.hf

from .errors import InvalidRequest
from .sampling_params import StructuredOutputsParams

log = logging.getLogger("slipstream.engine")

# Compact JSON: no whitespace between tokens. Flexible whitespace lets a small model pad with
# newlines until max_tokens and never close the object.
_JSON_OPTIONS = {"whitespace_flexible": False}


class StructuredOutputError(InvalidRequest):
    """A constraint that does not compile: an invalid JSON Schema, regex or Lark grammar.

    ``param`` defaults to ``structured_outputs``; the API layer sets it to the field the
    constraint came from (``response_format``, ``guided_json``, ...). ``constraint`` says which
    kind failed (``json``, ``json_object``, ``regex``, ``choice``, ``grammar``).
    """

    def __init__(self, message: str, constraint: str, param: str | None = "structured_outputs",
                 code: str = "invalid_structured_output"):
        super().__init__(message, param, code)
        self.constraint = constraint


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """``schema`` with every object that lists ``properties`` but leaves ``additionalProperties``
    unset closed to other keys (a new dict; the input is not modified).

    JSON Schema leaves such objects open, and a small model under an open object invents keys
    until ``max_tokens``; vLLM's default backend (xgrammar's strict mode) closes them the same way,
    and OpenAI's strict mode requires it. An object without ``properties`` (``{"type": "object"}``)
    stays open.
    """
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in (*_SUBSCHEMA_LISTS, "items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(out.get(key), (dict, list)):
            out[key] = closed_objects(out[key])
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def grammar_source(spec: StructuredOutputsParams) -> tuple[tuple, str]:
    """The cache key and llguidance grammar text of a constraint (no compilation; pure).

    The key is the constraint with JSON re-serialized without whitespace; key order is kept,
    since it decides the order of the output's properties.

    Raises:
        StructuredOutputError: ``json`` is not a JSON object (or its text).
    """
    if spec.json is not None:
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}", "json") from None
        if not isinstance(schema, dict):
            raise StructuredOutputError(f"a JSON schema must be a JSON object, got {type(schema).__name__}", "json")
        text = json.dumps(closed_objects(schema), separators=(",", ":"), ensure_ascii=False)
        return ("json", text), _from_json_schema(text, "json")
    if spec.json_object:
        return ("json_object",), _from_json_schema('{"type":"object"}', "json_object")
    if spec.regex is not None:
        return ("regex", spec.regex), llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # A Lark string literal takes JSON's escapes (llguidance's own grammar_from("choice") does this).
        lark = "start: " + " | ".join(json.dumps(c) for c in spec.choice)
        return ("choice", tuple(spec.choice)), llguidance.LLMatcher.grammar_from_lark(lark)
    return ("grammar", spec.grammar), llguidance.LLMatcher.grammar_from_lark(spec.grammar)


def _from_json_schema(text: str, constraint: str) -> str:
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_JSON_OPTIONS)
    except ValueError as e:
        raise StructuredOutputError(f"invalid JSON schema: {e}", constraint) from None


@functools.lru_cache(maxsize=4)
def _ll_tokenizer(hf_tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a transformers fast tokenizer (~0.6 s to build; shared by engines
    over the same tokenizer). ``vocab_size`` rows: ids past the tokenizer have no bytes, so no
    grammar ever allows them."""
    n_vocab = max(vocab_size, len(hf_tokenizer))
    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=list(eos_token_ids))


class GrammarMatcher:
    """One request's position in its grammar (an ``llguidance.LLMatcher``).

    ``matcher`` is what the sampler masks with; it advances by one :meth:`accept` per output
    token and is never rolled back (preemption recomputes KV but keeps the output tokens, so the
    state stays right).
    """

    __slots__ = ("_initial", "matcher", "vocab_size")

    def __init__(self, initial: llguidance.LLMatcher, vocab_size: int):
        self._initial = initial  # the cached, never advanced matcher
        self.matcher = initial.deep_copy()
        self.vocab_size = vocab_size  # the mask's width in tokens (llguidance's vocab, ≥ the model's)

    def fresh(self) -> GrammarMatcher:
        """A matcher at the grammar's start (for a sibling choice, which starts from the prompt)."""
        return GrammarMatcher(self._initial, self.vocab_size)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token; False (and :attr:`error` set) if the grammar refuses it."""
        return self.matcher.consume_token(token_id)

    @property
    def done(self) -> bool:
        """The grammar is complete and takes no further token (only EOS would be allowed)."""
        return self.matcher.is_stopped()

    @property
    def error(self) -> str:
        """Why the matcher failed, in one line ("" if it has not)."""
        return self.matcher.get_error().partition("\n")[0]


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer, with a bounded LRU cache. Thread-safe.

    Args:
        tokenizer: the model's transformers fast tokenizer.
        vocab_size: the model's vocabulary (rows of its logits), which may exceed the tokenizer's length.
        eos_token_ids: the ids that end the output; a complete grammar allows only these.
        cache_size: most distinct compiled constraints kept.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = tuple(eos_token_ids)
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer, built on first use (so engines that never constrain don't pay)."""
        return _ll_tokenizer(self._hf_tokenizer, self._vocab_size, self._eos)

    def compile(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for ``spec``: from the cache, or compiled (milliseconds; up to about a
        second for a very large schema — call it off the step loop).

        Raises:
            StructuredOutputError: the schema, regex or grammar is invalid (``.constraint`` says which).
        """
        key, source = grammar_source(spec)
        with self._lock:
            initial = self._cache.get(key)
            if initial is not None:
                self._cache.move_to_end(key)
                self.hits += 1
        if initial is None:
            initial = self._build(key[0], source)
            with self._lock:
                self.misses += 1
                self._cache[key] = initial
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return GrammarMatcher(initial, self.tokenizer.vocab_size)

    def _build(self, constraint: str, source: str) -> llguidance.LLMatcher:
        # The constructor drops the GIL while it compiles; errors come back as state, not exceptions.
        matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        if matcher.is_error():
            what = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[constraint]
            raise StructuredOutputError(f"invalid {what}: {matcher.get_error()}", constraint)
        for warning in matcher.get_grammar_warnings():
            log.warning("structured output %s: %s", constraint, warning)
        return matcher
