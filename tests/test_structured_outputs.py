"""Structured outputs and logit_bias with the built-in model: every constrained output parses and
validates; unconstrained requests in the same batch are untouched; errors are data."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import jsonschema
import pytest
import torch

from slipstream.server.engine import LLM, InvalidRequest, SamplingParams
from slipstream.server.engine.async_llm import AsyncLLM
from slipstream.server.engine.outputs import RequestMetrics
from slipstream.server.engine.request import Request
from slipstream.server.engine.sampler import Sampler, bitmask_bias
from slipstream.server.engine.sampling_params import StructuredOutputsParams as Constraint
from slipstream.server.engine.structured_outputs import GrammarCompiler, StructuredOutputError

NAME = {"type": "string", "minLength": 1, "maxLength": 16}

# (what to ask for, schema): nested objects, arrays with bounds, enums, integer and number ranges,
# booleans, optional and required fields, patterns, maxLength, anyOf/oneOf, $ref, const, null.
SCHEMAS = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
                  "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False}),
    ("a user account", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                 "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
                 "required": ["id", "email"], "additionalProperties": False},
        "active": {"type": "boolean"}}, "required": ["user", "active"], "additionalProperties": False}),
    ("three fruits", {"type": "object", "properties": {"fruits": {"type": "array", "items": NAME, "minItems": 1,
                      "maxItems": 3}}, "required": ["fruits"], "additionalProperties": False}),
    ("a favourite colour", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                            "required": ["color"], "additionalProperties": False}),
    ("today's temperature", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50,
                             "maximum": 50}}, "required": ["celsius"], "additionalProperties": False}),
    ("two yes/no answers", {"type": "object", "properties": {"is_open": {"type": "boolean"},
                            "has_parking": {"type": "boolean"}}, "required": ["is_open", "has_parking"],
                            "additionalProperties": False}),
    ("a point with an optional label", {"type": "object", "properties": {"x": {"type": "integer", "minimum": -99, "maximum": 99}, "y": {
        "type": "integer", "minimum": -99, "maximum": 99}, "label": NAME}, "required": ["x", "y"], "additionalProperties": False}),
    ("a value", {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, NAME]}},
                 "required": ["value"], "additionalProperties": False}),
    ("a shopping list", {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 2,
        "items": {"type": "object", "properties": {"name": NAME, "qty": {"type": "integer", "minimum": 1,
                  "maximum": 99}}, "required": ["name", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("a few lucky numbers", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                             "minItems": 2, "maxItems": 4}),
    ("a US zip code", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                       "required": ["zip"], "additionalProperties": False}),
    ("a document version", {"type": "object", "properties": {"version": {"const": "1.0"}, "title": NAME},
                            "required": ["version", "title"], "additionalProperties": False}),
    ("a deeply nested count", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 10}},
              "required": ["count"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False}),
    ("a name with an optional middle name", {"type": "object", "properties": {"first": NAME, "middle": {
        "type": ["string", "null"], "maxLength": 10}}, "required": ["first", "middle"],
        "additionalProperties": False}),
    ("a birthday", {"type": "object", "properties": {"date": {"type": "string",
                    "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"], "additionalProperties": False}),
    ("a discount", {"type": "object", "properties": {"percent": {"type": "number", "exclusiveMinimum": 0,
                    "exclusiveMaximum": 100}}, "required": ["percent"], "additionalProperties": False}),
    ("a pet (pydantic style)", {"$defs": {"Pet": {"type": "object", "title": "Pet", "properties": {
        "kind": {"type": "string", "enum": ["cat", "dog"]}, "name": NAME}, "required": ["kind", "name"],
        "additionalProperties": False}}, "type": "object", "title": "Owner", "properties": {
        "owner": NAME, "pet": {"$ref": "#/$defs/Pet"}}, "required": ["owner", "pet"], "additionalProperties": False}),
    ("a star rating", {"type": "object", "properties": {"stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
                       "required": ["stars"], "additionalProperties": False}),
    ("a shape", {"type": "object", "properties": {"shape": {"oneOf": [
        {"type": "object", "properties": {"radius": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["radius"], "additionalProperties": False},
        {"type": "object", "properties": {"side": {"type": "integer", "minimum": 10, "maximum": 99}},
         "required": ["side"], "additionalProperties": False}]}}, "required": ["shape"], "additionalProperties": False}),
    ("a short word", {"type": "string", "minLength": 2, "maxLength": 8}),
    ("an HTTP status", {"type": "object", "properties": {"code": {"type": "integer", "minimum": 100, "maximum": 599},
                        "ok": {"type": "boolean"}, "reason": {"type": ["string", "null"], "maxLength": 12}},
                        "required": ["code", "ok"], "additionalProperties": False}),
    ("a city and its population", {"type": "object", "properties": {"city": NAME, "population": {
        "type": "integer", "minimum": 0, "maximum": 999999999}, "tags": {"type": "array", "items": {"enum": ["big", "small", "old"]},
        "maxItems": 2}}, "required": ["city", "population", "tags"], "additionalProperties": False}),
]


@pytest.fixture(scope="module")
def llm(loaded):
    """One engine for the module (llguidance's tokenizer is built once); each test leaves it empty.
    One torch thread: on a shared CPU, fewer threads step much faster."""
    return LLM(loaded=loaded, num_threads=1)


def chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def test_twenty_two_json_schemas_greedy_and_sampled_all_validate(llm, no_leaks):
    prompts, params = [], []
    for i, (what, schema) in enumerate(SCHEMAS):
        prompt = chat(llm, f"Give me {what} as JSON.")
        prompts += [prompt, prompt]
        params += [SamplingParams(temperature=0, max_tokens=160, structured_outputs=Constraint(json=schema)),
                   SamplingParams(temperature=0.9, seed=i, max_tokens=160, structured_outputs=Constraint(json=schema))]
    outs = llm.generate(prompts, params)
    for (what, schema), greedy, sampled in zip(SCHEMAS, outs[::2], outs[1::2]):
        for out in (greedy.outputs[0], sampled.outputs[0]):
            assert out.finish_reason == "stop", (what, out.text)
            jsonschema.validate(json.loads(out.text), schema)
    no_leaks(llm.engine)


def test_regex_choice_json_object_and_lark_grammar(llm, no_leaks):
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    choices = ["yes", "no", 'it "depends"']
    grammar = 'start: "Answer: " ANSWER ". Data: " data\nANSWER: "yes" | "no"\ndata: %json {"type": "object", ' \
              '"properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"], ' \
              '"additionalProperties": false}'
    outs = llm.generate(
        [chat(llm, "When were you born?"), chat(llm, "Is the sky green?"), chat(llm, "Describe a cat in JSON."),
         chat(llm, "Is water wet? Give a number too.")],
        [SamplingParams(temperature=0.8, seed=3, max_tokens=30, structured_outputs=Constraint(regex=date)),
         SamplingParams(temperature=0, max_tokens=30, structured_outputs=Constraint(choice=choices)),
         SamplingParams(temperature=0, max_tokens=200, structured_outputs=Constraint(json_object=True)),
         SamplingParams(temperature=0, max_tokens=60, structured_outputs=Constraint(grammar=grammar))])
    regex, choice, obj, lark = (o.outputs[0] for o in outs)
    assert re.fullmatch(date, regex.text) and regex.finish_reason == "stop"
    assert choice.text in choices and choice.finish_reason == "stop"
    assert isinstance(json.loads(obj.text), dict) and obj.finish_reason == "stop"
    m = re.fullmatch(r"Answer: (yes|no)\. Data: (.*)", lark.text, re.S)
    assert m and json.loads(m.group(2))["n"] in range(10) and lark.finish_reason == "stop"
    no_leaks(llm.engine)


def test_choices_with_quotes_backslashes_and_unicode_are_matched_literally(llm):
    choices = ['say "hi"', "back\\slash", "naïve ☃", "a\nb"]
    out = llm.generate(chat(llm, "Pick one."), SamplingParams(temperature=1.0, seed=0, n=4, max_tokens=20,
                                                            structured_outputs=Constraint(choice=choices)))[0]
    assert all(c.text in choices and c.finish_reason == "stop" for c in out.outputs)


def test_every_choice_of_n_is_valid_and_they_differ(llm, no_leaks):
    what, schema = SCHEMAS[2]
    out = llm.generate(chat(llm, f"Give me {what} as JSON."),
                       SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=160,
                                      structured_outputs=Constraint(json=schema)))[0]
    assert len(out.outputs) == 4
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)
    assert len({c.text for c in out.outputs}) > 1
    no_leaks(llm.engine)


def test_preempted_constrained_requests_still_validate(make_llm, no_leaks):
    # 12 blocks of 16 tokens for 6 requests of 37 prompt + up to 120 output tokens: preemption is certain.
    llm = make_llm(kv_cache_memory_bytes=12 * 16 * 46080, max_num_batched_tokens=1024, num_threads=1)
    picked = [SCHEMAS[i] for i in (0, 2, 8, 12, 16, 20)]
    outs = llm.generate([chat(llm, f"Give me {what} as JSON.") for what, _ in picked],
                        [SamplingParams(temperature=0.9, seed=i, max_tokens=120,
                                        structured_outputs=Constraint(json=schema))
                         for i, (_, schema) in enumerate(picked)])
    assert llm.engine.scheduler.num_preemptions > 0, "the cache was meant to be too small for all at once"
    for (what, schema), out in zip(picked, outs):
        assert out.outputs[0].finish_reason == "stop", (what, out.outputs[0].text)
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    no_leaks(llm.engine)


def test_unconstrained_requests_batched_with_a_constrained_one_are_unchanged(llm):
    prompts = [chat(llm, "Write a haiku about rain."), chat(llm, "What is 2 + 2?")]
    plain = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True)]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    schema = SCHEMAS[0][1]
    mixed = llm.generate([prompts[0], chat(llm, "Give me a person as JSON."), prompts[1]],
                         [plain[0], SamplingParams(temperature=0, max_tokens=160,
                                                   structured_outputs=Constraint(json=schema)), plain[1]])
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), schema)


def _request(params: SamplingParams, grammar=None, seed: int | None = None) -> Request:
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    req = Request("r", "r", 0, [1, 2, 3], params, gen, RequestMetrics(0.0))
    req.grammar = grammar
    return req


def test_sampler_masks_only_the_constrained_row_and_leaves_others_bitwise_identical(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids)
    vocab = llm.engine.model_config.vocab_size
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0)) * 5
    sampler = Sampler(llm.engine.eos_token_ids)

    def batch(with_grammar: bool) -> list[Request]:
        grammar = compiler.compile(Constraint(regex="[0-9]+")) if with_grammar else None
        return [_request(SamplingParams(temperature=0.7, logprobs=3), seed=11),
                _request(SamplingParams(temperature=0.7, logprobs=3), grammar, seed=12),
                _request(SamplingParams(temperature=0, logprobs=3))]

    free = sampler(logits.clone(), batch(False))
    masked = sampler(logits.clone(), batch(True))
    assert masked.token_ids[0] == free.token_ids[0] and masked.token_ids[2] == free.token_ids[2]
    assert masked.logprobs[0] == free.logprobs[0] and masked.logprobs[2] == free.logprobs[2]
    assert llm.tokenizer.decode([masked.token_ids[1]]).isdigit()
    # logprobs are the model's own distribution, not the masked one
    assert masked.logprobs[1].top == free.logprobs[1].top


def test_bitmask_bias_reads_llguidance_bit_order():
    words = torch.tensor([[0b101 | 1 << 9, -(2**31)], [0, 1 << 30]], dtype=torch.int32)  # bit j of word w: 32w + j
    bias = bitmask_bias(words, 64)
    assert (bias[0] == 0).nonzero().flatten().tolist() == [0, 2, 9, 63]
    assert (bias[1] == 0).nonzero().flatten().tolist() == [62]
    assert set(bias.flatten().tolist()) == {0.0, float("-inf")}
    assert bitmask_bias(words, 40).shape == (2, 40)


def test_a_complete_grammar_ends_the_output_despite_min_tokens_and_ignore_eos(llm, no_leaks):
    out = llm.generate(chat(llm, "Is the sky blue?"),
                       SamplingParams(temperature=0, max_tokens=40, min_tokens=20, ignore_eos=True,
                                      structured_outputs=Constraint(choice=["yes", "no"])))[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop" and len(out.token_ids) < 20
    no_leaks(llm.engine)


def test_min_tokens_still_applies_where_the_grammar_may_go_on(llm):
    out = llm.generate(chat(llm, "Count."), SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                          structured_outputs=Constraint(regex="[0-9]+")))[0]
    text = out.outputs[0].text
    assert re.fullmatch("[0-9]+", text) and len(out.outputs[0].token_ids) >= 6


def test_a_matcher_that_refuses_a_token_fails_that_request_and_not_the_engine(llm, no_leaks):
    sampler = llm.engine.sampler
    letter_a = llm.tokenizer.encode("a", add_special_tokens=False)[0]

    def sample_a_for_the_digits(logits, requests):
        out = sampler(logits, requests)
        out.token_ids = [letter_a if r.grammar is not None else t for r, t in zip(requests, out.token_ids)]
        return out

    llm.engine.sampler = sample_a_for_the_digits
    try:
        bad, good = llm.generate([chat(llm, "Count."), chat(llm, "Say hi.")],
                                 [SamplingParams(temperature=0, max_tokens=8, structured_outputs=Constraint(regex="[0-9]+")),
                                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)])
    finally:
        llm.engine.sampler = sampler
    assert bad.outputs[0].finish_reason == "abort" and "structured output" in bad.error
    assert good.error is None and good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 8
    no_leaks(llm.engine)


def test_logit_bias_plus_100_forces_a_token_and_minus_100_bans_it(llm, no_leaks):
    prompt = chat(llm, "What is the capital of France?")
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    star = llm.tokenizer.encode("*", add_special_tokens=False)[0]
    forced = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                 logit_bias={star: 100.0}))[0].outputs[0].token_ids
    assert forced == [star] * 4
    banned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1,
                                                 logit_bias={free[0]: -100.0}))[0].outputs[0].token_ids
    assert banned[0] != free[0]
    sampled = llm.generate(prompt, SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True,
                                                  logit_bias={star: 100.0}))[0].outputs[0].token_ids
    assert sampled == [star] * 4
    no_leaks(llm.engine)


def test_logit_bias_and_a_grammar_together_the_grammar_wins(llm):
    letter_x = llm.tokenizer.encode("x", add_special_tokens=False)[0]
    out = llm.generate(chat(llm, "Count."), SamplingParams(temperature=0, max_tokens=6, logit_bias={letter_x: 100},
                                                          structured_outputs=Constraint(regex="[0-9]{3}")))[0]
    assert re.fullmatch("[0-9]{3}", out.outputs[0].text)


@pytest.mark.parametrize("bias", [{49152: 1.0}, {-1: 1.0}])
def test_logit_bias_outside_the_vocabulary_is_refused_naming_logit_bias(llm, bias):
    with pytest.raises(InvalidRequest) as e:
        llm.generate("hi", SamplingParams(logit_bias=bias))
    assert e.value.param == "logit_bias"
    assert not llm.engine.groups


@pytest.mark.parametrize("spec, constraint", [
    (Constraint(json={"type": "object", "properties": {"a": {"type": "strnig"}}}), "json"),
    (Constraint(json='{"type": "object",'), "json"),
    (Constraint(json="[1, 2]"), "json"),
    (Constraint(regex="([0-9]+"), "regex"),
    (Constraint(grammar="start: undefined_rule"), "grammar"),
])
def test_an_invalid_constraint_raises_with_its_kind_param_and_code(llm, spec, constraint):
    with pytest.raises(StructuredOutputError) as e:
        llm.generate("hi", SamplingParams(structured_outputs=spec))
    assert isinstance(e.value, InvalidRequest)
    assert (e.value.constraint, e.value.param, e.value.code) == (constraint, "structured_outputs",
                                                                "invalid_structured_output")
    assert not llm.engine.groups


def test_compilation_is_cached_by_the_constraint_and_keeps_property_order(llm):
    compiler = GrammarCompiler(llm.tokenizer, llm.engine.model_config.vocab_size, llm.engine.eos_token_ids,
                               cache_size=2)
    ab = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
          "required": ["a", "b"], "additionalProperties": False}
    ba = {**ab, "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    compiler.compile(Constraint(json=ab))
    compiler.compile(Constraint(json=json.dumps(ab, indent=2)))  # same schema as text: a hit
    assert (compiler.hits, compiler.misses) == (1, 1)
    m = compiler.compile(Constraint(json=ba))
    assert compiler.misses == 2
    tok = llm.tokenizer
    assert not m.matcher.consume_tokens(tok.encode('{"a":1', add_special_tokens=False))  # b comes first
    compiler.compile(Constraint(regex="x"))  # a third entry evicts the oldest (LRU, 2 kept)
    compiler.compile(Constraint(json=ab))
    assert compiler.misses == 4


async def test_async_generate_compiles_off_the_event_loop_and_the_step_loop(make_llm):
    """A grammar whose compile blocks until another request has finished: that request, started
    after it, streams all its tokens meanwhile (a compile on the event loop or the step loop would
    deadlock until the gate's timeout)."""
    engine = make_llm(max_model_len=512, num_threads=1).engine
    compile_now = engine.grammars.compile
    gate = threading.Event()
    seen: dict = {}

    def compile_blocked(spec):
        seen["thread"] = threading.current_thread().name
        seen["released"] = gate.wait(timeout=60)
        return compile_now(spec)

    engine.grammars.compile = compile_blocked
    allm = AsyncLLM(engine=engine)
    await allm.start()
    try:
        async def constrained():
            text = ""
            async for out in allm.generate("Is it?", SamplingParams(temperature=0, max_tokens=5, structured_outputs=
                                                                    Constraint(choice=["yes", "no"]))):
                text += out.outputs[0].text
            return text

        async def plain():
            while "thread" not in seen:  # start once the other's compile is under way
                await asyncio.sleep(0.01)
            ids = []
            async for out in allm.generate("Hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)):
                ids += out.outputs[0].token_ids
            gate.set()
            return ids

        choice, other = await asyncio.gather(constrained(), plain())
    finally:
        await allm.shutdown()
    assert seen["released"], "the plain request could not finish while a grammar compiled"
    assert seen["thread"] not in (threading.main_thread().name, "slipstream-engine")
    assert len(other) == 3 and choice in ("yes", "no")


def test_vocabulary_rows_past_the_tokenizer_are_never_allowed(llm):
    """A model whose vocabulary (logit rows) outgrows its tokenizer: the extra ids have no bytes."""
    tokenizer_len = len(llm.tokenizer)
    compiler = GrammarCompiler(llm.tokenizer, tokenizer_len + 40, llm.engine.eos_token_ids)
    grammar = compiler.compile(Constraint(regex="[a-z ]*"))
    assert grammar.vocab_size == tokenizer_len + 40
    logits = torch.zeros(1, tokenizer_len + 40)
    Sampler(llm.engine.eos_token_ids)._mask_grammar(logits, [_request(SamplingParams(), grammar)])
    allowed = (logits[0] == 0).nonzero().flatten()
    assert len(allowed) > 100 and int(allowed.max()) < tokenizer_len


def test_objects_that_list_properties_are_closed_unless_the_schema_says_otherwise():
    from slipstream.server.engine.structured_outputs import closed_objects

    schema = {"type": "object", "properties": {
        "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
        "c": {"type": "array", "items": {"type": "object", "properties": {"d": {"type": "string"}}}},
        "e": {"type": "object", "properties": {}, "additionalProperties": True},
        "f": {"type": "object"}},
        "$defs": {"g": {"anyOf": [{"type": "object", "properties": {"h": {"type": "null"}}}]}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["items"]["additionalProperties"] is False
    assert closed["properties"]["e"]["additionalProperties"] is True  # said so: kept open
    assert "additionalProperties" not in closed["properties"]["f"]  # any object: stays open
    assert closed["$defs"]["g"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is not modified
