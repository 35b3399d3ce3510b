"""Prefix caching in the KV cache manager: the hash chain, hits and their cap, eviction order, salts, the host
tier's second-level cache, and the hit statistics. Hashes are checked against hashlib computed here."""
from __future__ import annotations

import hashlib
from array import array

from scheduler_factories import make_request

from pagellm.core.kv.block_hash import ROOT_HASH, extend_block_hashes, hash_block_tokens
from pagellm.core.kv.kv_cache_manager import KVCacheManager
from pagellm.core.request import Request

BS = 4


def run_prefill(kv: KVCacheManager, request: Request) -> int:
    """Admit a request as the scheduler does and mark its prompt computed; returns the cached tokens it found."""
    computed = kv.get_computed_blocks(request)
    num_cached = computed.num_blocks * BS
    assert kv.allocate_slots(request, request.num_tokens - num_cached, computed)
    kv.record_query(request)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    kv.finish_step()
    return num_cached


def test_hash_chain_is_sha256_of_parent_tokens_and_salt():
    tokens = list(range(1, 9))
    first = hashlib.sha256(ROOT_HASH + array("q", tokens[:4]).tobytes()).digest()
    second = hashlib.sha256(first + array("q", tokens[4:]).tobytes()).digest()
    hashes: list[bytes] = []
    extend_block_hashes(hashes, tokens + [9, 10], BS)  # the partial third block gets no hash
    assert hashes == [first, second]
    salted = hash_block_tokens(None, tokens[:4], "tenant")
    assert salted not in hashes and hash_block_tokens(salted, tokens[4:]) != second


def test_same_prefix_hits_and_a_changed_token_misses_from_its_block_on():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    base = list(range(100, 117))  # 17 tokens: four full blocks
    assert run_prefill(kv, make_request("a", base)) == 0
    assert run_prefill(kv, make_request("b", base[:12] + [7] + base[13:])) == 12  # token 12 starts block 3
    assert run_prefill(kv, make_request("c", [7] + base[1:])) == 0
    shared = kv.req_to_blocks["a"][:3]
    assert kv.req_to_blocks["b"][:3] == shared and all(block.ref_cnt == 2 for block in shared)


def test_full_hit_computes_the_last_token():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = list(range(100, 116))  # exactly four blocks
    run_prefill(kv, make_request("a", tokens))
    second = make_request("b", tokens)
    computed = kv.get_computed_blocks(second)
    assert computed.num_blocks == 3  # capped at 15 tokens, block-aligned
    assert kv.allocate_slots(second, 4, computed) and second.num_computed_tokens == 12


def test_salts_isolate_and_prompt_logprobs_do_not_read_the_cache():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = list(range(100, 113))
    run_prefill(kv, make_request("a", tokens))
    salted = make_request("s", tokens)
    salted.cache_salt = "tenant"
    assert run_prefill(kv, salted) == 0
    again = make_request("s2", tokens)
    again.cache_salt = "tenant"
    assert run_prefill(kv, again) == 12
    assert run_prefill(kv, make_request("p", tokens, prompt_logprobs=1)) == 0
    assert run_prefill(kv, make_request("q", tokens)) == 12  # ... but it filled the cache as usual


def test_freed_blocks_stay_cached_and_are_evicted_least_recently_freed_first():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a, b = make_request("a", list(range(100, 109))), make_request("b", list(range(200, 209)))
    run_prefill(kv, a)
    run_prefill(kv, b)
    a_blocks, b_blocks = kv.req_to_blocks["a"][:2], kv.req_to_blocks["b"][:2]
    kv.free(a)
    kv.free(b)
    assert kv.block_pool.num_free_blocks == 8 and len(kv.block_pool.cached) == 4
    # Two fresh blocks come from the never-used ones, then the evictions: a's tail block first, then its head.
    filler = make_request("f", list(range(300, 320)))
    assert kv.allocate_slots(filler, 20)
    assert [block.block_hash is None for block in a_blocks] == [True, True]
    assert all(block.block_hash is not None for block in b_blocks)
    assert run_prefill(kv, make_request("b2", list(range(200, 209)))) == 8


def test_hit_on_a_free_block_counts_it_taken_before_allocating():
    """Cached blocks nobody holds are also counted as free: a request must not need them twice."""
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(100, 109)))  # two full blocks + one partial
    run_prefill(kv, a)
    kv.free(a)
    b = make_request("b", list(range(100, 113)) + [1, 2, 3, 4, 5])  # needs 5 blocks, two of them cached
    computed = kv.get_computed_blocks(b)
    assert computed.num_blocks == 2
    assert not kv.allocate_slots(b, b.num_tokens - 8, computed)
    assert kv.block_pool.num_free_blocks == 4 and b.num_computed_tokens == 0


def test_preempted_lookups_are_counted_apart():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = list(range(100, 113))
    first = make_request("a", tokens)
    run_prefill(kv, first)
    kv.free(first)
    first.num_computed_tokens = 0
    first.num_preemptions = 1  # resumed after recompute preemption: finds its own blocks
    assert run_prefill(kv, first) == 12
    stats = kv.prefix_stats
    assert (stats.queries, stats.hits) == (13, 0)
    assert (stats.preempted_queries, stats.preempted_hits) == (13, 12)


def test_evicted_blocks_go_to_the_host_tier_and_come_back():
    kv = KVCacheManager(num_blocks=4, block_size=BS, num_host_blocks=8)
    a = make_request("a", list(range(100, 109)))
    run_prefill(kv, a)
    device_ids = [block.block_id for block in kv.req_to_blocks["a"][:2]]
    kv.free(a)
    filler = make_request("f", list(range(300, 316)))
    assert kv.allocate_slots(filler, 16)
    out = kv.take_transfers().swap_out
    # Both cached blocks of a were evicted (its partial block had no hash), each copied to a host block.
    assert sorted(d for d, _ in out) == sorted(device_ids) and len(kv.host_pool.cached) == 2
    kv.finish_step()
    kv.free(filler)

    again = make_request("a2", list(range(100, 109)))
    computed = kv.get_computed_blocks(again)
    assert (len(computed.device), len(computed.host)) == (0, 2)
    assert kv.allocate_slots(again, 1, computed) and again.num_computed_tokens == 8
    swap_in = kv.take_transfers().swap_in
    host_ids = [block.block_id for block in computed.host]
    assert [h for h, _ in swap_in] == host_ids
    assert [d for _, d in swap_in] == [block.block_id for block in kv.req_to_blocks["a2"][:2]]
    # The copied-back blocks are indexed on the device again.
    assert [kv.block_pool.lookup(h) for h in again.block_hashes[:2]] == kv.req_to_blocks["a2"][:2]
    kv.finish_step()
    kv.free(again)
    kv.check_consistency(set())


def test_swap_out_and_back_in_with_host_blocks_held_during_the_step():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, num_host_blocks=4)
    a = make_request("a", list(range(100, 110)))
    run_prefill(kv, a)
    assert kv.can_swap_out(a)
    kv.swap_out(a)
    host_blocks = kv.req_to_host_blocks["a"]
    assert kv.req_to_blocks.get("a") is None and kv.block_pool.num_free_blocks == 8
    assert [b.ref_cnt for b in host_blocks] == [2, 2, 2]  # the request, and this step's copy
    kv.check_consistency({"a"})
    kv.finish_step()
    assert [b.ref_cnt for b in host_blocks] == [1, 1, 1]
    assert not kv.can_swap_out(make_request("none", [1]))
    kv.take_transfers()
    assert kv.allocate_slots(a, 1)  # swapped back in, plus room for the next token
    assert len(kv.req_to_blocks["a"]) == 3 and a.num_computed_tokens == 10
    assert [h for h, _ in kv.take_transfers().swap_in] == [b.block_id for b in host_blocks]
    kv.finish_step()
    assert kv.host_pool.num_free_blocks == 4
    kv.check_consistency({"a"})


def test_token_efficiency_counts_shared_blocks_once():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(100, 110)))  # 10 tokens in 3 blocks
    run_prefill(kv, a)
    assert kv.token_efficiency({"a": 10}) == 10 / 12
    child = a.fork("a/1", 1)
    kv.fork(a, child)
    assert kv.token_efficiency({"a": 10, "a/1": 10}) == 10 / 12
