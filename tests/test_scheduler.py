"""Iteration-level scheduling with a fake model (only the forward pass is faked; the scheduler,
KV cache and engine are the real ones)."""
from __future__ import annotations

import pytest
import torch

from slipstream.server.engine import SamplingParams
from slipstream.server.engine.fairness import WaitingQueue
from slipstream.server.engine.kv_cache import KVCacheManager
from slipstream.server.engine.model_runner import StepOutput
from slipstream.server.engine.outputs import FinishReason, RequestMetrics
from slipstream.server.engine.request import Request
from slipstream.server.engine.scheduler import Scheduler

TOKEN = 42  # the fake model always predicts this (not EOS)


class FakeRunner:
    """Stands in for the forward pass: logits that pick ``TOKEN``, and a count of slot-steps."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self.calls = 0

    def run(self, batch, sample_rows):
        self.calls += 1
        logits = torch.zeros(len(sample_rows), self.vocab)
        logits[:, TOKEN] = 1.0
        return StepOutput(logits)


@pytest.fixture
def engine(make_llm):
    def build(**kwargs):
        llm = make_llm(trace=True, **kwargs)
        llm.engine.runner = FakeRunner(llm.engine.model_config.vocab_size)
        return llm.engine
    return build


def static_slot_steps(output_lengths: list[int], slots: int) -> int:
    """Slot-steps that static batching spends: each batch of ``slots`` runs to its longest request."""
    return sum(max(output_lengths[i:i + slots]) * slots for i in range(0, len(output_lengths), slots))


def params(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run_all(engine):
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = engine.num_steps - 1  # index of the step that finished it
    return done


def test_textbook_head_of_line_case(engine):
    """Orca §2.2: 4 slots, outputs of 20/50/200/2000 tokens. Static batching holds every slot
    for 2000 steps (8,000 slot-steps); continuous batching spends only the 2,270 useful ones and
    gives a freed slot to the next waiting request on the very next step."""
    eng = engine(max_num_seqs=4)
    lengths = [20, 50, 200, 2000]
    for i, n in enumerate(lengths):
        eng.add_request([1], params(n), request_id=f"r{i}")
    eng.add_request([1], params(5), request_id="late")
    done = run_all(eng)

    assert static_slot_steps(lengths, 4) == 8000
    first_four = {f"r{i}" for i in range(4)}
    used = sum(1 for rec in eng.trace for rid, _, _ in rec.scheduled if rid in first_four)
    assert used == 2270
    assert max(len(rec.scheduled) for rec in eng.trace) == 4
    admitted = next(rec.step for rec in eng.trace if any(rid == "late" for rid, _, _ in rec.scheduled))
    assert admitted == done["r0"] + 1
    assert len(eng.trace) == 2000  # the longest request alone sets the length of the run


def test_token_budget_chunks_prefill_and_keeps_decodes_going(engine):
    eng = engine(max_num_batched_tokens=32)
    eng.add_request([1], params(30), request_id="short")
    eng.step()  # "short" is now decoding
    eng.add_request(list(range(1, 101)), params(2), request_id="long")
    run_all(eng)
    for rec in eng.trace:
        assert rec.num_tokens <= 32
    steps_with_long_prefill = [rec for rec in eng.trace if any(rid == "long" and p for rid, p, _ in rec.scheduled)]
    assert len(steps_with_long_prefill) == 4  # 100 tokens beside one decode token: 31+31+31+7
    assert all(any(rid == "short" and d == 1 for rid, _, d in rec.scheduled) for rec in steps_with_long_prefill)


def test_max_num_seqs_bounds_the_batch(engine):
    eng = engine(max_num_seqs=3)
    for i in range(7):
        eng.add_request([1, 2], params(4), request_id=f"r{i}")
    run_all(eng)
    assert max(rec.num_running for rec in eng.trace) <= 3
    assert max(len(rec.scheduled) for rec in eng.trace) == 3


def test_out_of_blocks_preempts_newest_and_recomputes(engine):
    eng = engine(kv_cache_memory_bytes=6 * 16 * 46080, max_num_seqs=8)  # 6 blocks of 16
    assert eng.kv.num_blocks == 6
    for i in range(3):
        eng.add_request([1] * 16, params(30), request_id=f"r{i}")  # each grows to 3 blocks
    done = run_all(eng)
    assert set(done) == {"r0", "r1", "r2"}
    assert eng.scheduler.num_preemptions > 0
    assert sum(rec.num_preemptions for rec in eng.trace) == eng.scheduler.num_preemptions
    assert all(rec.num_blocks_used <= 6 for rec in eng.trace)


@pytest.mark.slow
def test_waiting_forked_choices_give_back_their_blocks_when_nothing_else_can_run(engine):
    """A forked choice waits holding its parent's prompt blocks. When a preempted request at the
    head of the queue needs the whole cache, nothing runs, so those blocks must be given back or
    the engine stalls for good (seen with chats whose default max_tokens fills the cache)."""
    eng = engine(kv_cache_memory_bytes=9 * 16 * 46080, max_num_seqs=32)  # 9 blocks, max_model_len 144
    for i in range(5):
        n = 4 if i == 3 else 1
        eng.add_request([1] * (20 + i % 3), SamplingParams(max_tokens=None, ignore_eos=True, n=n, seed=i),
                        request_id=f"r{i}")
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        eng.step()
    assert not eng.has_unfinished(), (eng.scheduler.num_running, eng.scheduler.num_waiting)
    assert eng.scheduler.num_preemptions > 0


def test_request_that_can_never_fit_is_rejected_at_once(engine):
    from slipstream.server.engine import RequestRejected
    eng = engine(kv_cache_memory_bytes=4 * 16 * 46080, max_model_len=1024)
    with pytest.raises(RequestRejected, match="KV blocks") as e:
        eng.add_request([1] * 40, params(40))  # 80 tokens > 64 slots
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(RequestRejected, match="maximum context length is 1024"):
        eng.add_request([1] * 1000, params(100))
    with pytest.raises(RequestRejected):
        eng.add_request([1] * 1024, params(1))
    with pytest.raises(ValueError, match="must not be empty"):
        eng.add_request([], params(1))
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([1, 10**9], params(1))
    assert not eng.has_unfinished()


def test_max_model_len_defaults_to_what_the_cache_holds(engine):
    from slipstream.server.engine import RequestRejected
    small = engine(kv_cache_memory_bytes=4 * 16 * 46080)  # 64 token slots; the model's context is 8192
    assert small.max_model_len == 64
    # No max_tokens: the rest of the context, which then fits (a chat would otherwise ask for 8192 - prompt).
    assert small.make_requests([1] * 10, SamplingParams(max_tokens=None))[0].params.max_tokens == 54
    asked = engine(kv_cache_memory_bytes=4 * 16 * 46080, max_model_len=1024)
    assert asked.max_model_len == 1024  # kept; what needs more than the cache is refused per request
    assert asked.make_requests([1] * 10, SamplingParams(max_tokens=None))[0].params.max_tokens == 54
    with pytest.raises(RequestRejected, match="The prompt has 64 tokens but the KV cache holds only 64") as e:
        asked.make_requests([1] * 64, SamplingParams(max_tokens=None))
    assert e.value.param == "messages"


def test_abort_frees_blocks_at_once(engine):
    eng = engine()
    eng.add_request(list(range(1, 40)), params(100), request_id="a")
    eng.add_request(list(range(1, 40)), params(100), request_id="b")
    eng.step()
    eng.step()
    assert eng.kv.num_used_blocks > 0
    assert eng.abort("a") and eng.abort("b")
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished()
    assert not eng.abort("a")


def test_n_choices_share_prompt_blocks(engine):
    eng = engine(enable_prefix_caching=False)
    eng.add_request(list(range(1, 50)), SamplingParams(n=3, temperature=1.0, max_tokens=5, ignore_eos=True),
                    request_id="g")
    eng.step()  # prefill of choice 0, then fork
    group = eng.groups["g"]
    assert len(group) == 3
    shared = group[0].block_table[:3]
    assert all(r.block_table[:3] == shared for r in group[1:])
    assert all(eng.kv.ref_counts[b] == 3 for b in shared)
    run_all(eng)


# --- the after-step update (Scheduler.update_from_output), on the scheduler alone ----------------

EOS = 2


def bare_scheduler(max_num_batched_tokens=64, max_model_len=None, num_blocks=8, long_prefill_token_threshold=0):
    """A scheduler over ``num_blocks`` blocks of 4 tokens whose EOS is token 2."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4)
    return Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=max_num_batched_tokens, eos_token_ids=[EOS],
                     max_model_len=max_model_len, long_prefill_token_threshold=long_prefill_token_threshold)


def queue(sched, prompt, rid="r", **params) -> Request:
    req = Request(rid, rid, 0, list(prompt), SamplingParams(**params), None, RequestMetrics(0.0))
    sched.add(req)
    return req


def step(sched, token):
    """Schedule one step and apply it, every sampled request drawing ``token``."""
    batch = sched.schedule()
    return sched.update_from_output(batch, {batch.requests[i]: token for i in batch.sample_indices()})


def test_update_advances_and_caches_a_prefill_chunk_without_appending_a_token():
    sched = bare_scheduler(max_num_batched_tokens=8)
    req = queue(sched, range(10, 20))
    assert step(sched, 7) == []
    assert req.num_computed_tokens == 8 and req.num_output_tokens == 0
    assert [sched.kv.hash_of[b] for b in req.block_table[:2]] == req.block_hashes[:2]  # both full blocks named


def test_update_appends_the_sampled_token_on_the_last_prefill_chunk():
    sched = bare_scheduler(max_num_batched_tokens=8)
    req = queue(sched, range(10, 20))
    step(sched, 7)
    assert step(sched, 7) == [req]
    assert req.num_computed_tokens == 10 and req.output_token_ids == [7] and not req.finished


def test_eos_finishes_with_reason_stop_and_frees_the_blocks():
    sched = bare_scheduler()
    req = queue(sched, [10, 11, 12])
    assert step(sched, EOS) == [req]
    assert req.finished and (req.finish_reason, req.stop_reason) == ("stop", None)
    assert sched.num_running == 0 and sched.kv.num_used_blocks == 0


def test_ignore_eos_and_min_tokens_keep_the_request_running_past_eos():
    sched = bare_scheduler()
    ignoring = queue(sched, [10, 11], ignore_eos=True)
    step(sched, EOS)
    assert not ignoring.finished
    sched = bare_scheduler()
    early = queue(sched, [10, 11], min_tokens=2)
    step(sched, EOS)
    assert not early.finished  # 1 output token < min_tokens
    step(sched, EOS)
    assert early.finished and early.finish_reason == "stop"


def test_a_stop_token_id_finishes_with_that_id_as_stop_reason():
    sched = bare_scheduler()
    req = queue(sched, [10, 11], stop_token_ids=[9])
    step(sched, 9)
    assert req.finished and (req.finish_reason, req.stop_reason) == ("stop", 9)


def test_max_tokens_finishes_with_length():
    sched = bare_scheduler()
    req = queue(sched, [10, 11], max_tokens=2)
    step(sched, 7)
    assert not req.finished
    step(sched, 7)
    assert req.finished and (req.finish_reason, req.stop_reason) == ("length", None)
    assert req.output_token_ids == [7, 7] and sched.kv.num_used_blocks == 0


def test_eos_on_the_last_allowed_token_is_a_stop_not_a_length_cap():
    sched = bare_scheduler()
    req = queue(sched, [10, 11], max_tokens=1)
    step(sched, EOS)
    assert req.finish_reason == "stop"


def test_max_model_len_finishes_with_length():
    sched = bare_scheduler(max_model_len=5)
    req = queue(sched, [10, 11, 12, 13], max_tokens=16)
    step(sched, 7)
    assert req.finished and req.finish_reason == "length" and req.num_tokens == 5


# --- one place finishes a request: Scheduler.finish, called by the update and by aborts ----------

def test_a_text_stop_outranks_the_length_cap_on_the_same_token_but_not_eos():
    from slipstream.server.engine.scheduler import NO_STOP

    sched = bare_scheduler()
    capped = queue(sched, [10, 11], max_tokens=1)
    batch = sched.schedule()
    sched.update_from_output(batch, {capped: 7}, lambda req, tok: "END")
    assert (capped.finish_reason, capped.stop_reason) == ("stop", "END")
    sched = bare_scheduler()
    eos = queue(sched, [10, 11])
    batch = sched.schedule()
    sched.update_from_output(batch, {eos: EOS}, lambda req, tok: "END")
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    sched = bare_scheduler()
    going = queue(sched, [10, 11])
    seen = []
    batch = sched.schedule()
    sched.update_from_output(batch, {going: 7}, lambda req, tok: seen.append(tok) or NO_STOP)
    assert seen == [7] and not going.finished


def test_finish_sets_the_reason_once_and_an_engine_abort_goes_through_it(make_llm):
    sched = bare_scheduler()
    req = queue(sched, [10, 11])
    sched.finish(req, FinishReason.ABORT)
    sched.finish(req, FinishReason.STOP, "late")
    assert (req.finish_reason, req.stop_reason) == ("abort", None) and sched.num_waiting == 0
    eng = make_llm(max_num_seqs=2).engine
    eng.add_request("Hello", SamplingParams(max_tokens=4, n=2, temperature=0), request_id="a")
    out = eng.abort("a", "gone")
    assert out.finished and out.error == "gone" and [c.finish_reason for c in out.outputs] == ["abort", "abort"]
    assert eng.abort("a") is None and not eng.has_unfinished()


# --- the long-prefill threshold (vLLM's long_prefill_token_threshold) ------------------------------


def capped_scheduler(threshold, budget=64, num_blocks=80):
    return bare_scheduler(budget, num_blocks=num_blocks, long_prefill_token_threshold=threshold)


def queue_as(sched, rid, prompt, max_tokens=4) -> Request:
    """``prompt`` queued as ``rid``, to run ``max_tokens`` tokens whatever it samples."""
    return queue(sched, prompt, rid, max_tokens=max_tokens, ignore_eos=True)


def step_all(sched, token=7) -> list[tuple[Request, int]]:
    """Schedule and apply one step; the step's (request, tokens) pairs."""
    batch = sched.schedule()
    assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens
    sched.update_from_output(batch, {batch.requests[i]: token for i in batch.sample_indices()})
    return list(zip(batch.requests, batch.num_new_tokens))


@pytest.mark.parametrize("threshold", [0, 16])
def test_a_short_prompt_behind_a_long_prefill_waits_for_it_only_without_a_threshold(threshold):
    """A 240-token prompt at a budget of 64 takes 4 steps. A 10-token one arriving after the first
    of them gets its first token with the long one's, 3 steps later, unless the long chunks are
    capped: then in the next step, beside 16 of the long prompt's tokens; while the short one
    decodes (3 more steps) the long one takes 16 a step, and the whole budget again once alone."""
    sched = capped_scheduler(threshold)
    long = queue_as(sched, "long", range(100, 340))
    assert step_all(sched) == [(long, 64)]  # alone: the whole budget, capped or not
    short = queue_as(sched, "short", range(10, 20))
    first_token, steps = {}, []
    for n in range(1, 10):
        steps.append([(r.request_id, k) for r, k in step_all(sched)])
        first_token.update({r.request_id: n for r in (long, short) if r.num_output_tokens and r.request_id not in first_token})
    assert first_token == ({"long": 6, "short": 1} if threshold else {"long": 3, "short": 3})
    if threshold:
        assert steps[:6] == [[("long", 16), ("short", 10)]] + [[("long", 16), ("short", 1)]] * 3 + \
            [[("long", 64)], [("long", 48)]]


def test_one_long_prefill_at_a_time_and_shorter_prompts_go_past_the_one_waiting():
    """Threshold 8, budget 32: beside a decode, the first long prompt takes 8 tokens a step; the
    second long prompt waits until the first has 8 tokens or fewer left, then starts beside it,
    still ahead of the third; the short prompt behind it starts at once (vLLM V0's order)."""
    sched = capped_scheduler(8, budget=32)
    decoding = queue_as(sched, "decoding", [1, 2, 3], max_tokens=50)
    step_all(sched)
    a, b, c, d = (queue_as(sched, "a", range(100, 200)), queue_as(sched, "b", range(200, 300)),
                  queue_as(sched, "c", range(300, 305)), queue_as(sched, "d", range(400, 500)))
    assert step_all(sched) == [(decoding, 1), (a, 8), (c, 5)]
    assert c.num_output_tokens == 1
    for _ in range(11):
        assert step_all(sched)[:2] == [(decoding, 1), (a, 8)]
        assert sched.waiting.head() is b and len(sched.waiting) == 2  # held back in its place
    assert step_all(sched)[:3] == [(decoding, 1), (a, 4), (b, 8)]
    assert a.num_output_tokens == 1 and d.num_computed_tokens == 0 and sched.waiting.head() is d


@pytest.mark.parametrize("policy", ["priority", "fair"])
def test_a_long_prompt_held_back_keeps_its_place_and_is_not_charged_under_every_policy(policy):
    """Held back, a long prompt leaves the queue only for the step: under ``priority`` it stays
    ahead of later long prompts of its rank, under ``fair`` its tenant is charged only when it
    is admitted; a short prompt of another tenant starts meanwhile."""
    kv = KVCacheManager(num_blocks=80, block_size=4)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=32, eos_token_ids=[EOS],
                      waiting=WaitingQueue(policy), long_prefill_token_threshold=8)

    def add(rid, prompt, tenant="x"):
        req = Request(rid, rid, 0, list(prompt), SamplingParams(max_tokens=2, ignore_eos=True), None,
                      RequestMetrics(0.0), tenant=tenant)
        sched.add(req)
        return req

    a = add("a", range(100, 200))
    step_all(sched)
    b, c, d = add("b", range(200, 300)), add("c", range(300, 305), tenant="y"), add("d", range(400, 500))
    served = dict(sched.waiting.counters)
    assert step_all(sched) == [(a, 8), (c, 5)]
    assert sched.waiting.counters.get("x") == served.get("x")  # b and d waited, uncharged
    while a.num_computed_tokens < a.num_prompt_tokens - 8:
        assert sched.waiting.head() is b
        step_all(sched)
    assert [r for r, _ in step_all(sched)][:2] == [a, b] and sched.waiting.head() is d


def test_a_capped_chunk_alone_grows_only_where_free_blocks_allow_and_loses_none():
    sched = capped_scheduler(8, budget=64, num_blocks=10)
    long = queue_as(sched, "long", range(100, 160))  # 15 blocks: only its 8-token chunk fits
    assert step_all(sched) == [(long, 8)]
    assert len(long.block_table) == 2
    sched.finish(long, FinishReason.ABORT)
    assert len(sched.kv.free) == 10


def test_the_threshold_reaches_the_engine_from_the_command_line_and_is_checked(capsys):
    from slipstream.server.cli import engine_config, serve_parser
    from slipstream.server.engine.config import EngineConfig
    assert engine_config(serve_parser().parse_args([])).long_prefill_token_threshold == 0
    config = engine_config(serve_parser().parse_args(["--long-prefill-token-threshold", "256"]))
    assert config.long_prefill_token_threshold == 256
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--long-prefill-token-threshold", "-1"])
    assert "--long-prefill-token-threshold" in capsys.readouterr().err
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be an integer >= 0"):
        EngineConfig(long_prefill_token_threshold=-1)


def test_a_long_prompt_mostly_in_the_prefix_cache_is_not_held_back_as_long():
    """What is left to compute decides: a 100-token prompt whose first 96 tokens are cached has
    4 to go, so it starts beside a long prefill in progress instead of waiting for it."""
    sched = capped_scheduler(8, budget=32)
    warm = queue_as(sched, "warm", range(100, 200), max_tokens=1)
    while not warm.finished:
        step_all(sched)
    long = queue_as(sched, "long", range(300, 400))
    step_all(sched)  # alone: 32 of its 100
    again = queue_as(sched, "again", range(100, 200))
    assert step_all(sched) == [(long, 8), (again, 4)]
    assert again.num_cached_tokens == 96
    assert sched.kv.num_free_blocks + sum(len(r.block_table) for r in (long, again)) == sched.kv.num_blocks


def test_a_long_prompt_held_back_pins_none_of_its_cached_blocks():
    sched = capped_scheduler(8, budget=32)
    warm = queue_as(sched, "warm", range(100, 140), max_tokens=1)
    while not warm.finished:
        step_all(sched)
    long = queue_as(sched, "long", range(300, 400))
    step_all(sched)
    held = queue_as(sched, "held", list(range(100, 140)) + list(range(500, 560)))  # 40 cached, 60 to go
    assert step_all(sched) == [(long, 32)]  # alone: the held one is not beside it
    assert (held.block_table, held.num_computed_tokens) == ([], 0)


def test_the_ready_line_says_whether_the_threshold_takes_effect():
    from slipstream.server.api.server import _long_prefill_note
    from slipstream.server.engine.config import EngineConfig
    assert _long_prefill_note(EngineConfig()) == ""
    assert _long_prefill_note(EngineConfig(long_prefill_token_threshold=128)) == \
        ", long prompts 128 tokens a step beside others"
    assert "no chunk is ever capped" in _long_prefill_note(EngineConfig(long_prefill_token_threshold=512))
