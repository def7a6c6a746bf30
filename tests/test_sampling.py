"""Sampling: masks keep exactly the right tokens, seeds are per request, n choices differ."""
from __future__ import annotations

import pytest
import torch

from slipstream.server.engine import SamplingParams
from slipstream.server.engine.sampler import apply_penalties, apply_top_k_top_p_min_p
from slipstream.server.engine.outputs import RequestMetrics
from slipstream.server.engine.request import Request


def kept(logits, k=0, p=1.0, min_p=0.0):
    out = apply_top_k_top_p_min_p(torch.tensor([logits]), torch.tensor([k]), torch.tensor([p]), torch.tensor([min_p]))
    return set(torch.nonzero(out[0] > float("-inf")).flatten().tolist())


def test_top_k_keeps_the_k_largest():
    assert kept([1.0, 5.0, 3.0, 4.0, 2.0], k=2) == {1, 3}
    assert kept([1.0, 5.0, 3.0], k=0) == {0, 1, 2}
    assert kept([1.0, 5.0, 3.0], k=10) == {0, 1, 2}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().tolist()
    assert kept(logits, p=0.5) == {0}          # 0.5 alone reaches 0.5
    assert kept(logits, p=0.51) == {0, 1}      # the token that crosses p is kept
    assert kept(logits, p=0.86) == {0, 1, 2, 3}
    assert kept(logits, p=1.0) == {0, 1, 2, 3, 4}
    assert kept(logits, p=0.01) == {0}         # never empty


def test_min_p_keeps_tokens_above_a_fraction_of_the_top():
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])
    logits = probs.log().tolist()
    assert kept(logits, min_p=0.3) == {0, 1, 2}   # >= 0.15
    assert kept(logits, min_p=0.0) == {0, 1, 2, 3, 4}


def test_masks_are_per_row():
    logits = torch.tensor([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([1, 0]), torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0]))
    assert (out[0] > float("-inf")).tolist() == [False, False, True]
    assert (out[1] > float("-inf")).tolist() == [True, True, True]


def _req(prompt, output, **params):
    r = Request("r", "r", 0, prompt, SamplingParams(**params), None, RequestMetrics(0.0))
    r.token_ids.extend(output)
    return r


def test_penalties():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    apply_penalties(logits, [_req([0, 1], [], repetition_penalty=2.0)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 1.0]]  # prompt tokens: positive halved, negative doubled
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    apply_penalties(logits, [_req([3], [2, 2, 1], presence_penalty=0.5, frequency_penalty=0.25)])
    assert logits.tolist() == [[0.0, -0.75, -1.0, 0.0]]  # output only; the prompt's token 3 untouched


@pytest.mark.slow
def test_seeded_request_samples_the_same_alone_and_in_a_mixed_batch(make_llm):
    llm = make_llm()
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 20, 7)]
    batch = llm.generate(["Hello there", "Once upon a time", "A list of fruits:", "def main():"],
                         [others[0], seeded, others[1], SamplingParams(temperature=0, max_tokens=5)])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate("Once upon a time", seeded)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                                 max_tokens=12, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_choices_are_distinct_samples(make_llm):
    llm = make_llm()
    out = llm.generate("My favourite animal is", SamplingParams(n=4, temperature=1.0, max_tokens=8, ignore_eos=True,
                                                                seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    seqs = {tuple(c.token_ids) for c in out.outputs}
    assert len(seqs) == 4 and all(len(s) == 8 for s in seqs)


def test_logprobs_are_log_softmax_of_the_logits(make_llm):
    llm = make_llm()
    out = llm.generate("The sky is", SamplingParams(temperature=0, max_tokens=3, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 3
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert [t for t, _ in lp.top][0] == tok  # greedy: the chosen token is the top one
        assert len(lp.top) == 3 and lp.logprob <= 0
        vals = [v for _, v in lp.top]
        assert vals == sorted(vals, reverse=True) and abs(lp.logprob - vals[0]) < 1e-6


@pytest.mark.slow
def test_min_tokens_and_stop_token_ids(make_llm):
    llm = make_llm()
    eos = llm.engine.eos_token_ids[0]
    prompt = llm.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30))[0].outputs[0]
    assert greedy.finish_reason == "stop" and greedy.token_ids[-1] == eos
    n = len(greedy.token_ids)
    longer = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, min_tokens=n + 2))[0].outputs[0]
    assert len(longer.token_ids) >= n + 2
    assert eos not in longer.token_ids[:n + 2]
    stop_at = greedy.token_ids[1]
    stopped = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at]))[0].outputs[0]
    assert stopped.token_ids == greedy.token_ids[:2]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    ignored = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n + 3, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == n + 3 and ignored.finish_reason == "length"
    assert ignored.token_ids[:n] == greedy.token_ids


@pytest.mark.parametrize("fault", ["step", "grammar"])
def test_a_failed_group_reports_each_choice_once(make_llm, fault):
    """n=3, choice 1 stops at its first token; the group fails two steps later (a failed step) or
    at that same step (choice 2's token refused by its grammar): choice 1 keeps its ``stop``,
    the other two end ``abort``; no choice is reported twice (metrics count each report)."""
    from slipstream.server.engine.sampling_params import StructuredOutputsParams as Constraint

    llm = make_llm()
    engine = llm.engine
    sampler, real_run = engine.sampler, engine.runner.run
    eos = engine.eos_token_ids[0]
    letter_a = llm.tokenizer.encode("a", add_special_tokens=False)[0]
    steps = {"n": 0}

    def choice_1_stops_then_choice_2_breaks(logits, requests):
        out = sampler(logits, requests)
        for row, r in enumerate(requests):
            if r.index == 1:
                out.token_ids[row] = eos
            elif r.index == 2 and steps["n"] == 2 and fault == "grammar":  # the step choice 1 stops at
                out.token_ids[row] = letter_a
        return out

    def run(batch, rows):
        steps["n"] += 1
        if fault == "step" and steps["n"] == 4:
            raise RuntimeError("injected fault")
        return real_run(batch, rows)

    engine.sampler, engine.runner.run = choice_1_stops_then_choice_2_breaks, run
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=10, ignore_eos=False,
                            structured_outputs=Constraint(regex="[0-9 ]*") if fault == "grammar" else None)
    try:
        engine.add(engine.make_requests("Count:", params))
        finishes, error = [], None
        while engine.has_unfinished():
            for out in engine.step():
                finishes += [(co.index, co.finish_reason) for co in out.outputs if co.finish_reason is not None]
                error = error or out.error
    finally:
        engine.sampler, engine.runner.run = sampler, real_run
    assert error and sorted(finishes) == [(0, "abort"), (1, "stop"), (2, "abort")], finishes


# --- the request limits: SamplingParams is their one owner -------------------------------------
@pytest.mark.parametrize("field, value", [
    ("temperature", 2.01), ("temperature", -0.1), ("top_p", 1.5), ("n", 129), ("n", 0), ("logprobs", 21),
    ("prompt_logprobs", -1), ("seed", 1 << 64), ("max_tokens", 0), ("min_p", 1.5), ("top_k", -2),
    ("presence_penalty", 2.5), ("repetition_penalty", 0.0), ("stop_token_ids", [1 << 31]),
])
def test_a_value_out_of_range_is_refused_as_data_naming_its_field(field, value):
    from slipstream.server.engine.errors import OutOfRange

    with pytest.raises(OutOfRange) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field and info.value.value == value
    renamed = info.value.renamed("api_name")
    assert renamed.param == "api_name" and str(renamed).startswith(f"api_name {info.value.requirement}")


def test_temperature_2_is_the_largest_accepted_and_top_p_0_is_greedy():
    assert SamplingParams(temperature=2).temperature == 2
    p = SamplingParams(temperature=0.7, top_p=0)
    assert p.greedy and p.top_p == 1.0


def test_logit_bias_out_of_range_reports_the_value():
    from slipstream.server.engine.errors import OutOfRange

    with pytest.raises(OutOfRange) as info:
        SamplingParams(logit_bias={5: 1.0, 7: -101.0})
    assert info.value.param == "logit_bias" and info.value.value == -101.0


def test_token_ids_are_checked_once_against_what_both_model_and_tokenizer_know(make_llm):
    from slipstream.server.engine.errors import InvalidRequest

    engine = make_llm().engine
    limit = engine.num_token_ids
    assert limit == min(engine.model_config.vocab_size, len(engine.tokenizer))
    engine.check_token_ids([0, limit - 1])
    for bad in ([limit], [-1], [True], [1.0]):
        with pytest.raises(InvalidRequest) as info:
            engine.make_requests([1, *bad], SamplingParams(max_tokens=1))
        assert info.value.param == "prompt" and "prompt[1]" in str(info.value)
    with pytest.raises(InvalidRequest) as info:
        engine.check_token_ids([limit], "tokens")
    assert info.value.param == "tokens"
