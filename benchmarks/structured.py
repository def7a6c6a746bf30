"""Structured outputs' cost: decode steps at 32 running requests, JSON-schema constrained vs not.

Two runs over the built-in model with the same 32 chat prompts, greedy, ``max_num_seqs`` 32:

- ``unconstrained``: ``ignore_eos=True``, ``max_tokens`` = ``--steps``.
- ``json-schema``: each request constrained by one of four schemas of long arrays of objects
  (so none completes within ``--steps`` tokens), ``max_tokens`` = ``--steps``.

The two runs alternate ``--rounds`` times (a shared CPU's speed drifts). Only decode steps with
all 32 requests running count. For each it takes the step's wall time (``StepRecord.step_time``),
the process's CPU time over the step (all threads, llguidance's pool included), and, in the
constrained run, the time in the sampler's grammar mask (llguidance filling the 32 rows' bitmask
in parallel, turning it into a 0/-inf bias and adding it to those rows) and in the matchers'
``accept`` of the sampled tokens. Medians are printed as a table, with the grammar work's share of
a constrained decode step (issue 13's target: < 10%).

Usage: ``python benchmarks/structured.py [--steps 48] [--rounds 2] [--threads 1] [--device cpu]``.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from slipstream.server.engine import LLM, SamplingParams
from slipstream.server.engine.sampling_params import StructuredOutputsParams
from slipstream.server.engine.structured_outputs import GrammarMatcher

RUNNING = 32


def _list_of(item: dict, n: int) -> dict:
    return {"type": "object", "properties": {"entries": {"type": "array", "items": item, "minItems": n,
                                                         "maxItems": n}},
            "required": ["entries"], "additionalProperties": False}


SCHEMAS = [
    ("a shopping list", _list_of({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16}, "qty": {"type": "integer", "minimum": 1, "maximum": 99}},
        "required": ["name", "qty"], "additionalProperties": False}, 30)),
    ("a list of people", _list_of({"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}},
        "required": ["name", "age", "email"], "additionalProperties": False}, 20)),
    ("weather readings", _list_of({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
        "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}},
        "required": ["city", "celsius", "sky"], "additionalProperties": False}, 20)),
    ("a task board", _list_of({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24}, "done": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
        "required": ["title", "done", "tags"], "additionalProperties": False}, 20)),
]


class Timer:
    """Accumulates seconds spent in wrapped calls since the last :meth:`take`."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        return s


def run(llm: LLM, constrained: bool, steps: int) -> dict:
    engine = llm.engine
    mask, accept = Timer(), Timer()
    engine.sampler._mask_grammar = mask.wrap(engine.sampler._mask_grammar)
    original_accept = GrammarMatcher.accept
    GrammarMatcher.accept = accept.wrap(original_accept)
    prompts, params = [], []
    for i in range(RUNNING):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        prompts.append(llm.apply_chat_template([{"role": "user", "content": f"Give me {what} as JSON. ({i})"}]))
        params.append(SamplingParams(temperature=0, max_tokens=steps, ignore_eos=not constrained,
                                     structured_outputs=StructuredOutputsParams(json=schema) if constrained else None))
    reqs = [engine.make_requests(p, sp) for p, sp in zip(prompts, params)]  # compile before timing the steps
    for r in reqs:
        engine.add(r)
    samples = {"step": [], "cpu": [], "mask": [], "accept": []}
    try:
        while engine.has_unfinished():
            cpu0 = time.process_time()
            engine.step()
            cpu = time.process_time() - cpu0
            rec = engine.trace[-1]
            m, a = mask.take(), accept.take()
            if rec.num_decode_tokens == RUNNING and rec.num_prefill_tokens == 0:
                for key, value in (("step", rec.step_time), ("cpu", cpu), ("mask", m), ("accept", a)):
                    samples[key].append(value)
    finally:
        GrammarMatcher.accept = original_accept
        del engine.sampler._mask_grammar
    return samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=48, help="output tokens per request (decode steps measured)")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of the two runs")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (llguidance uses its own pool)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    args = ap.parse_args()
    llm = LLM(max_num_seqs=RUNNING, num_threads=args.threads, device=args.device, trace=True)
    llm.generate("warm up", SamplingParams(temperature=0, max_tokens=4,
                                          structured_outputs=StructuredOutputsParams(json_object=True)))
    load = os.getloadavg()[0]
    plain: dict[str, list[float]] = {}
    json_: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for constrained, into in ((False, plain), (True, json_)):
            for key, values in run(llm, constrained, args.steps).items():
                into.setdefault(key, []).extend(values)
    plain, json_ = ({k: statistics.median(v) for k, v in d.items()} | {"steps": len(d["step"])} for d in (plain, json_))
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, device {llm.engine.device}, "
          f"torch {torch.__version__}, {args.threads} torch thread(s), load {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"# {RUNNING} running requests, median over decode steps with all {RUNNING} running")
    print(f"{'run':<14} {'steps':>5} {'step ms':>8} {'CPU ms':>8} {'mask ms':>8} {'accept ms':>9} "
          f"{'(mask+accept)/step':>19}")
    for name, r in (("unconstrained", plain), ("json-schema", json_)):
        share = (r["mask"] + r["accept"]) / r["step"]
        print(f"{name:<14} {r['steps']:>5} {r['step'] * 1e3:>8.1f} {r['cpu'] * 1e3:>8.1f} {r['mask'] * 1e3:>8.2f} "
              f"{r['accept'] * 1e3:>9.2f} {share:>19.1%}")
    print(f"constrained / unconstrained: step time {json_['step'] / plain['step']:.3f}x, "
          f"CPU time {json_['cpu'] / plain['cpu']:.3f}x; "
          f"grammar work is {(json_['mask'] + json_['accept']) / json_['step']:.1%} of a constrained step "
          f"(target < 10%)")


if __name__ == "__main__":
    main()
