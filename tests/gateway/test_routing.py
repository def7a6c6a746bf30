"""The routing policies (pure): who gets a request, given endpoints' load and what they cache."""
from __future__ import annotations

import pytest

from slipstream.server.gateway.routing import (
    POLICIES, PROFILES, BlockIndex, Choice, EndpointLoad, PrefixTable, Profile, RouteRequest, Router, Weights,
    registry)
from slipstream.server.gateway.routing.plugins import BaseScorer
from slipstream.server.gateway.routing.scorers.queue import QueueScorer
from slipstream.server.kv_hash import block_hash, prompt_block_hashes

A, B, C = "http://127.0.0.2:8000", "http://127.0.0.3:8000", "http://127.0.0.4:8000"


def hashes(group: int, blocks: int, block_size: int = 16) -> tuple[bytes, ...]:
    return tuple(prompt_block_hashes([group * 1000 + i for i in range(blocks * block_size)], block_size))


def idle(*names: str) -> list[EndpointLoad]:
    return [EndpointLoad(n) for n in names]


def test_block_hashes_chain_and_are_stable():
    tokens = list(range(40))
    hs = prompt_block_hashes(tokens, 16)
    assert len(hs) == 2  # the partial third block has no name
    assert hs[0] == block_hash(None, tokens[:16]) and hs[1] == block_hash(hs[0], tokens[16:32])
    # Fixed bytes: a change to the hash breaks every gateway that talks to older pods.
    assert hs[0].hex() == block_hash(None, list(range(16))).hex()
    assert prompt_block_hashes(tokens, 16, limit=1) == hs[:1]
    assert prompt_block_hashes([1] * 15, 16) == []
    # A block's name depends on everything before it.
    assert prompt_block_hashes([9] + tokens[1:], 16)[1] != hs[1]
    with pytest.raises(ValueError):
        prompt_block_hashes(tokens, 0)


def test_the_engine_uses_the_shared_hash():
    from slipstream.server.engine import kv_cache
    assert kv_cache.block_hash is block_hash


def test_round_robin_takes_turns_and_skips_full_endpoints():
    router = Router("round-robin")
    picks = [router.pick(RouteRequest(), idle(C, A, B)).endpoint for _ in range(6)]
    assert picks == [A, B, C, A, B, C]
    full = [EndpointLoad(A, in_flight=4, capacity=4), EndpointLoad(B, in_flight=3, capacity=4)]
    assert {router.pick(RouteRequest(), full).endpoint for _ in range(3)} == {B}


def test_least_loaded_uses_the_fresher_of_scrape_and_in_flight():
    router = Router("least-loaded")
    # A's scrape says 1, but the router has sent it 5 since: it holds 5.
    endpoints = [EndpointLoad(A, waiting=0, running=1, in_flight=5), EndpointLoad(B, waiting=2, running=1)]
    assert router.pick(RouteRequest(), endpoints) == Choice(B, "least-loaded")


def test_no_endpoint_or_all_full_returns_none():
    for policy in POLICIES:
        router = Router(policy)
        assert router.pick(RouteRequest(hashes(1, 4)), []) is None
        assert router.pick(RouteRequest(hashes(1, 4)), [EndpointLoad(A, in_flight=2, capacity=2)]) is None


def test_prefix_policy_sends_a_group_back_where_it_went():
    router = Router("prefix")
    first = {}
    for group in range(6):
        request = RouteRequest(hashes(group, 8))
        choice = router.pick(request, idle(A, B, C))
        router.record(request, choice)
        first[group] = choice.endpoint
        assert choice.reason == "load"
    # Later requests of each group share its 8-block prefix and add their own tail.
    for group in range(6):
        request = RouteRequest(hashes(group, 8) + hashes(100 + group, 2))
        choice = router.pick(request, idle(A, B, C))
        assert choice.endpoint == first[group] and choice.reason == "prefix-hit" and choice.matched_blocks == 8


def test_prefix_hit_loses_to_a_much_longer_queue():
    router = Router("prefix", weights=Weights(prefix=1.0, queue=1.0, kv_cache=0.0, affinity=0.0))
    request = RouteRequest(hashes(1, 4))
    router.record(request, Choice(A, "load"))
    assert router.pick(request, [EndpointLoad(A, waiting=1), EndpointLoad(B, waiting=0)]).endpoint == A
    # Half the prompt cached on A is worth less than A's queue being the longest.
    half = RouteRequest(hashes(1, 4)[:2] + hashes(2, 2))
    assert router.pick(half, [EndpointLoad(A, waiting=30), EndpointLoad(B, waiting=0)]).endpoint == B


def test_kv_events_policy_follows_what_the_pods_hold_not_what_was_sent():
    index = BlockIndex()
    router = Router("kv-events", block_index=index)
    request = RouteRequest(hashes(7, 6))
    router.record(request, Choice(A, "load"))  # sent to A, but A never reported caching it
    index.stored(B, request.block_hashes[:4])
    choice = router.pick(request, idle(A, B, C))
    assert (choice.endpoint, choice.reason, choice.matched_blocks) == (B, "prefix-hit", 4)
    index.removed(B, request.block_hashes[1:2])  # a hole after block 0: only block 0 still counts
    assert router.pick(request, idle(A, B, C)).matched_blocks == 1
    index.forget(B)
    assert router.pick(request, idle(A, B, C)).reason == "load"


def test_leading_blocks_only_count_until_the_first_miss():
    table = PrefixTable()
    h = hashes(3, 5)
    table.record(h[:2], A)
    table.record(h, B)
    table.record(h[3:], C)  # C holds later blocks only: useless without the earlier ones
    assert table.match(h) == {A: 2, B: 5}


def test_prefix_table_is_bounded_lru():
    table = PrefixTable(capacity=10)
    old, new = hashes(1, 6), hashes(2, 6)
    table.record(old, A)
    table.record(new, B)
    assert len(table) == 10
    assert table.match(new) == {B: 6}
    assert table.match(old) == {}  # its first blocks were the least recently routed
    with pytest.raises(ValueError):
        PrefixTable(0)
    with pytest.raises(ValueError):
        BlockIndex(0)


def test_block_index_snapshot_replaces_and_capacity_bounds():
    index = BlockIndex(capacity=8)
    index.stored(A, hashes(1, 6))
    index.replace(A, hashes(2, 3))
    assert index.match(hashes(1, 6)) == {} and index.match(hashes(2, 3)) == {A: 3}
    index.stored(B, hashes(3, 8))
    assert len(index) <= 8
    index.forget(A)
    index.forget(B)
    assert len(index) == 0 and index.match(hashes(2, 3)) == {}


def test_session_affinity_breaks_ties_and_is_forgotten_with_its_endpoint():
    router = Router("kv-events")
    request = RouteRequest((), session="user-42")
    choice = router.pick(request, idle(A, B, C))
    router.record(request, choice)
    for _ in range(3):
        again = router.pick(request, idle(A, B, C))
        assert again.endpoint == choice.endpoint and again.reason == "affinity"
    router.forget(choice.endpoint)
    assert router.pick(request, idle(A, B, C)).reason == "load"


def test_scores_are_weighted_terms_in_unit_range():
    w = Weights(prefix=2.0, queue=1.0, kv_cache=0.5, affinity=0.25)
    router = Router("prefix", weights=w)
    request = RouteRequest(hashes(1, 4), session="s")
    router.record(RouteRequest(request.block_hashes[:2]), Choice(A, "load"))  # A holds 2 of the 4 blocks
    router.record(RouteRequest(session="s"), Choice(B, "load"))  # the session went to B
    endpoints = [EndpointLoad(A, waiting=4, kv_cache_usage=0.5), EndpointLoad(B, waiting=0, kv_cache_usage=0.0)]
    scored = dict(zip((A, B), router.score(request, endpoints)))
    # A's half prefix hit counts for less behind its 4 waiting requests: / (1 + 4).
    assert scored[A] == pytest.approx(2.0 * 0.5 / 5 + 1.0 * (4 - 4) / 8 + 0.5 * 0.5)
    assert scored[B] == pytest.approx(0.0 + 1.0 * (4 - 0) / 8 + 0.5 * 1.0 + 0.25)
    wide = [EndpointLoad(A, waiting=20), EndpointLoad(B, waiting=0)]
    scored = dict(zip((A, B), router.score(RouteRequest(hashes(9, 4)), wide)))
    assert scored[A] == pytest.approx(0.5) and scored[B] == pytest.approx(1.0 + 0.5)


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="routing policy"):
        Router("random")
    with pytest.raises(ValueError, match=r"routing weights\.prefix must be a finite number ≥ 0, got -1"):
        Weights(prefix=-1)
    # an infinite weight made every score NaN: no endpoint was best and each pick failed
    with pytest.raises(ValueError, match=r"routing weights\.queue must be a finite number ≥ 0, got inf"):
        Weights(queue=float("inf"))
    with pytest.raises(ValueError, match="unknown scorer"):
        Weights(speed=1.0)
    with pytest.raises(ValueError, match="at least one weight must be > 0"):
        Weights(prefix=0, queue=0, kv_cache=0, affinity=0)
    with pytest.raises(ValueError, match="queue_scale"):
        QueueScorer(scale=0)
    with pytest.raises(ValueError, match="routing picker 'best' is not registered"):
        Router(Profile("mine", picker="best"))


def test_weights_are_keyed_by_scorer_name_over_the_contracts_defaults():
    assert dict(Weights()) == {"prefix": 3.0, "queue": 1.0, "kv_cache": 0.5, "affinity": 0.5}
    assert Weights({"kv_cache": 0.0}) == Weights(kv_cache=0.0) and Weights(kv_cache=0.0)["prefix"] == 3.0
    assert Router("prefix", weights={"queue": 2.0}).weights["queue"] == 2.0


def test_every_policy_has_a_profile_and_the_prefix_ones_share_the_prefix_weight():
    assert tuple(PROFILES) == POLICIES
    assert [registry.SCORERS[name].weight for name in ("prefix", "kv_events")] == ["prefix", "prefix"]
    assert Router("kv-events").reads_kv_events and Router("prefix").reads_prompt_blocks
    assert not Router("prefix").reads_kv_events and not Router("least-loaded").reads_prompt_blocks


class ShortestName(BaseScorer):
    """A toy signal: endpoints with shorter names score higher."""

    name = "shortest_name"

    def score(self, request, endpoints, state):
        longest = max(len(e.name) for e in endpoints)
        return [1.0 - len(e.name) / longest for e in endpoints]

    def reason(self, endpoint, state):
        return "short-name"


@pytest.fixture
def toy_scorer():
    registry.register_scorer("shortest_name", lambda ctx: ShortestName(), default_weight=2.0,
                             help="score weight of a short endpoint name")
    yield
    del registry.SCORERS["shortest_name"]


def test_a_new_scorer_is_one_class_and_its_registration(toy_scorer):
    from slipstream.server.gateway.cli import config_from_args, gateway_parser

    profile = Profile("short", scorers=("shortest_name", "queue"))
    router = Router(profile, weights=Weights(shortest_name=2.0))
    endpoints = [EndpointLoad("http://a-long-name:8000"), EndpointLoad("http://b:8000", waiting=2)]
    # Its weight (2) outweighs the queue's (1): the short name wins despite its queue.
    assert router.pick(RouteRequest(), endpoints) == Choice("http://b:8000", "short-name", 0,
                                                           pytest.approx(2.0 * (1 - 13 / 23)))
    assert Router(profile, weights=Weights(shortest_name=0.1)).pick(RouteRequest(), endpoints).endpoint == \
        "http://a-long-name:8000"
    # The gateway's command line has its flag, and its default comes from the registration.
    config = config_from_args(gateway_parser().parse_args(["--weight-shortest-name", "0.5"]))
    assert config.weights["shortest_name"] == 0.5 and Weights()["shortest_name"] == 2.0
    with pytest.raises(ValueError, match="registered already"):
        registry.register_scorer("shortest_name", lambda ctx: ShortestName(), help="again")
