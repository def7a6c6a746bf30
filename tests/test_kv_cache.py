"""The block pool: allocation, reference counts, prefix sharing, LRU reuse."""
from __future__ import annotations

from slipstream.server.engine.kv_cache import NULL_BLOCK, KVCacheManager
from slipstream.server.engine.outputs import RequestMetrics
from slipstream.server.engine.request import Request
from slipstream.server.engine.sampling_params import SamplingParams
from slipstream.server.engine.scheduler import Scheduler, SchedulerOutput


def req(tokens, rid="r"):
    return Request(rid, rid, 0, list(tokens), SamplingParams(), None, RequestMetrics(0.0))


def compute(kv, r, n=None):
    """Pretend the model computed ``n`` of the request's tokens (default: the rest) and apply the
    step as the engine does: the scheduler's ``update_from_output``, nothing sampled."""
    n = r.num_tokens - r.num_computed_tokens if n is None else n
    assert kv.allocate(r, n)
    Scheduler(kv, max_num_seqs=1, max_num_batched_tokens=n).update_from_output(SchedulerOutput([r], [n]), {})


def test_allocate_is_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    r = req(range(17))
    assert not kv.allocate(r, 17)  # needs 5 blocks
    assert r.block_table == [] and kv.num_free_blocks == 4
    assert kv.allocate(r, 16)
    assert len(r.block_table) == 4 and kv.num_free_blocks == 0 and kv.usage == 1.0


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req(range(12), "a")
    kv.match_prefix(a)
    compute(kv, a)
    b = req(range(12), "b")  # identical prompt: 3 full blocks, but the last token must be computed
    assert kv.match_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert [kv.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    c = req(list(range(8)) + [99, 98, 97, 96, 95], "c")  # shares two blocks, then diverges
    assert kv.match_prefix(c) == 8
    d = req([7] + list(range(1, 13)), "d")  # first block differs: the chain breaks at once
    assert kv.match_prefix(d) == 0


def test_freed_cached_blocks_are_revived_then_evicted_lru():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5], "a")
    kv.match_prefix(a)
    compute(kv, a)
    blocks = list(a.block_table)
    kv.free_request(a)
    assert kv.num_free_blocks == 4 and all(c == 0 for c in kv.ref_counts)
    b = req([1, 2, 3, 4, 9], "b")
    assert kv.match_prefix(b) == 4 and b.block_table == blocks[:2]  # revived from the free queue
    kv.free_request(b)
    # A stranger needs all four blocks: the cache entries must be evicted, never shared.
    c = req(range(100, 108), "c")
    kv.match_prefix(c)
    compute(kv, c)
    assert sorted(c.block_table) == [0, 1, 2, 3]
    d = req([1, 2, 3, 4, 9], "d")
    kv.free_request(c)
    assert kv.match_prefix(d) == 0


def test_unhashed_blocks_are_reused_before_cached_ones():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3], "a")
    kv.match_prefix(a)
    compute(kv, a)  # block 0 full and cached, block 1 partial
    cached, partial = a.block_table
    kv.free_request(a)
    b = req([50], "b")
    assert kv.allocate(b, 1) and b.block_table == [partial]


def test_fork_shares_full_prompt_blocks_only():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = req(range(10), "p")
    kv.match_prefix(parent)
    compute(kv, parent)
    child = req(range(10), "p-1")
    kv.fork(parent, child)
    assert child.block_table == parent.block_table[:2] and child.num_computed_tokens == 8
    assert [kv.ref_counts[b] for b in parent.block_table] == [2, 2, 1]
    kv.free_request(parent)
    kv.free_request(child)
    assert kv.num_free_blocks == 8


def test_utilization_counts_shared_blocks_once():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req(range(6), "a")
    kv.match_prefix(a)
    compute(kv, a)  # 6 tokens in 2 blocks
    assert kv.utilization([a]) == 6 / 8
    b = req(list(range(4)) + [9, 9, 9], "b")
    kv.match_prefix(b)
    compute(kv, b)  # shares block 0, adds one block with 3 tokens
    assert kv.utilization([a, b]) == (4 + 2 + 3) / 12


def test_block_hash_is_chained():
    from slipstream.server.engine.kv_cache import block_hash
    h1 = block_hash(None, [1, 2])
    assert block_hash(h1, [3, 4]) != block_hash(block_hash(None, [9, 9]), [3, 4])
    assert block_hash(None, [1, 2]) == h1


# --- KV events (what /v1/kv_events streams to gateways) -------------------------------------------

def test_no_kv_events_are_recorded_until_asked():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    a = req([1, 2, 3, 4, 5], "a")
    kv.match_prefix(a)
    compute(kv, a)
    assert kv.events is None and kv.take_events() == []


def test_a_full_block_reports_stored_once_under_the_gateways_hash():
    from slipstream.server.engine.kv_cache import KVEvent
    from slipstream.server.kv_hash import prompt_block_hashes

    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.record_events(True)
    a = req(range(10), "a")
    kv.match_prefix(a)
    compute(kv, a, 6)  # one full block so far
    compute(kv, a)     # the second; the third is partial
    expected = prompt_block_hashes(list(range(10)), 4)
    assert kv.take_events() == [KVEvent("stored", expected)]
    assert kv.take_events() == []
    b = req(range(10), "b")  # shares both blocks: nothing new becomes shareable
    kv.match_prefix(b)
    compute(kv, b)
    assert kv.take_events() == [] and sorted(kv.cached_hashes()) == sorted(expected)


def test_evicting_a_cached_block_reports_removed_before_the_new_blocks_are_stored():
    from slipstream.server.engine.kv_cache import KVEvent
    from slipstream.server.kv_hash import prompt_block_hashes

    kv = KVCacheManager(num_blocks=2, block_size=2)
    kv.record_events(True)
    a = req([1, 2, 3, 4], "a")
    kv.match_prefix(a)
    compute(kv, a)
    kv.free_request(a)  # freed blocks keep their hashes: nothing removed yet
    old = prompt_block_hashes([1, 2, 3, 4], 2)
    assert kv.take_events() == [KVEvent("stored", old)]
    b = req([7, 8, 9, 10], "b")
    kv.match_prefix(b)
    compute(kv, b)
    new = prompt_block_hashes([7, 8, 9, 10], 2)
    # the tail was freed first, so it is evicted first
    assert kv.take_events() == [KVEvent("removed", [old[1], old[0]]), KVEvent("stored", new)]
    assert sorted(kv.cached_hashes()) == sorted(new)


def test_stopping_kv_events_drops_the_ones_not_taken():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.record_events(True)
    a = req([1, 2, 3], "a")
    kv.match_prefix(a)
    compute(kv, a)
    kv.record_events(False)
    assert kv.events is None and kv.take_events() == []


# --- sliding window: blocks behind every layer's window are released ---------------------------

def live(r):
    return [b for b in r.block_table if b != NULL_BLOCK]


def test_blocks_wholly_behind_the_window_are_released_and_the_rest_kept():
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=6)
    r = req(range(20))
    kv.match_prefix(r)
    compute(kv, r)
    table = list(r.block_table)
    # The next query sits at 20 and sees keys 15..20: blocks 0-2 (tokens 0..11) are out of reach,
    # block 3 (12..15) holds key 15 and stays.
    assert kv.free_out_of_window(r) == 3
    assert r.block_table == [NULL_BLOCK] * 3 + table[3:] and r.num_released_blocks == 3
    assert [kv.ref_counts[b] for b in table] == [0, 0, 0, 1, 1]
    assert kv.num_free_blocks == 6
    assert kv.free_out_of_window(r) == 0  # nothing new behind the window
    kv.free_request(r)  # the released entries are not dropped twice
    assert kv.num_free_blocks == 8 and all(c == 0 for c in kv.ref_counts) and r.num_released_blocks == 0


def test_no_window_or_a_short_context_releases_nothing():
    full = KVCacheManager(num_blocks=8, block_size=4)
    r = req(range(20))
    compute(full, r)
    assert full.free_out_of_window(r) == 0 and NULL_BLOCK not in r.block_table
    windowed = KVCacheManager(num_blocks=8, block_size=4, sliding_window=16)
    t = req(range(18))
    compute(windowed, t)
    assert windowed.free_out_of_window(t) == 0  # the query at 18 sees 3..18: block 0 (0..3) still holds 3...
    t.token_ids.append(5)
    compute(windowed, t)
    assert windowed.free_out_of_window(t) == 1  # ...at 19 it sees 4..19: block 0 goes


def test_released_blocks_stay_cached_for_a_later_prompt():
    kv = KVCacheManager(num_blocks=8, block_size=4, sliding_window=4)
    a = req(range(16), "a")
    kv.match_prefix(a)
    compute(kv, a)
    assert kv.free_out_of_window(a) == 3
    b = req(list(range(16)) + [1], "b")  # same first 16 tokens: the released blocks are revived
    assert kv.match_prefix(b) == 16
    assert b.block_table[:3] == [blk for blk in kv.cached.values()][:3]
    kv.free_request(a)
    kv.free_request(b)
    assert all(c == 0 for c in kv.ref_counts)


def test_a_released_block_reused_by_another_request_is_never_renamed():
    kv = KVCacheManager(num_blocks=4, block_size=2, sliding_window=2)
    a = req(range(6), "a")
    compute(kv, a)
    assert kv.free_out_of_window(a) == 2  # sees 5..6: blocks 0 and 1 go
    other = req([9, 9, 9, 9], "o")
    compute(kv, other)  # takes the released blocks and names them by its own tokens
    names = {b: kv.hash_of[b] for b in other.block_table}
    a.token_ids += [7, 8]
    assert kv.allocate(a, 2)
    Scheduler(kv, 1, 2).update_from_output(SchedulerOutput([a], [2]), {})
    assert {b: kv.hash_of[b] for b in other.block_table} == names
    kv.free_request(a)
    kv.free_request(other)
    assert kv.num_free_blocks == 4


def test_a_request_holds_at_most_the_window_and_a_chunk():
    kv = KVCacheManager(num_blocks=64, block_size=4, sliding_window=10)
    r = req(range(7))
    bound = kv.max_blocks_held(200, 7)
    assert bound == kv.blocks_needed(10 - 1 + 7) + 1 < kv.blocks_needed(200)
    peak = 0
    while r.num_tokens < 200:
        kv.free_out_of_window(r)
        n = min(7, r.num_tokens - r.num_computed_tokens) or 1
        if r.num_computed_tokens + n > r.num_tokens:
            r.token_ids.append(3)
        compute(kv, r, n)
        peak = max(peak, len(live(r)))
        r.token_ids += [3] * 6
    assert peak <= bound
    assert KVCacheManager(num_blocks=64, block_size=4).max_blocks_held(200, 7) == 50


def test_a_fork_shares_what_its_first_query_sees_or_starts_fresh():
    # Block size 4, prompt of 14: the parent's last prompt chunk starts at 13, the child (sharing
    # (14 - 1) // 4 = 3 blocks) recomputes from 12.
    def forked(window):
        kv = KVCacheManager(num_blocks=16, block_size=4, sliding_window=window)
        parent, child = req(range(14), "p"), req(range(14), "c")
        compute(kv, parent, 13)
        kv.free_out_of_window(parent)  # the scheduler, before the last chunk
        assert kv.allocate(parent, 1)
        kv.fork(parent, child, num_computed=14)
        return kv, parent, child

    # Window 5: the parent at 13 sees 9..13 and released blocks 0-1; the child at 12 sees 8..12.
    kv, parent, child = forked(5)
    assert parent.num_released_blocks == 2
    assert child.block_table == [NULL_BLOCK, NULL_BLOCK, parent.block_table[2]] and child.num_released_blocks == 2
    assert child.num_computed_tokens == 12
    kv.free_request(child)
    kv.free_request(parent)
    assert all(c == 0 for c in kv.ref_counts)
    # Window 6: the parent at 13 sees 8..13 (blocks 0-1 released), but the child at 12 would
    # see 7, in released block 1: it shares nothing and is admitted afresh (prefix cache).
    kv, parent, child = forked(6)
    assert parent.num_released_blocks == 2
    assert child.block_table == [] and child.num_computed_tokens == 0
    kv.free_request(parent)
    assert all(c == 0 for c in kv.ref_counts)
