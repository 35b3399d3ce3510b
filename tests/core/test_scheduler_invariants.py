"""Property tests: random workloads driven through schedule()/update_from_output() with a fake model, checking the
scheduler's and both block pools' invariants at every step and the requests' outputs at the end.

A fake worker stands in for the KV cache: it records which token each slot holds, applies the step's swaps and
copies as the real workers do, and checks that every position a scheduled request counts as computed holds that
request's token. So prefix-cache hits, host-tier round trips, swap preemption and copy-on-write are checked for
what they are for: the right K/V in the right place."""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st
from scheduler_factories import EOS, make_request

from pagellm.config import SchedulerConfig
from pagellm.core.kv.kv_cache_manager import KVCacheManager, cdiv
from pagellm.core.request import Request, RequestStatus
from pagellm.core.sched.scheduler import Scheduler
from pagellm.worker.input_batch import InputBatch

STOP = 3
MAX_MODEL_LEN = 256
SHARED_PREFIX = 64


@dataclass
class Spec:
    request_id: str
    prompt_len: int
    max_tokens: int
    family: int  # requests of one family share a prompt prefix (prefix-cache hits)
    priority: int
    n: int  # sequences: the request forks at its first sample
    arrival: int  # the step before which it is added
    ignore_eos: bool
    use_stop: bool
    abort_at: int | None  # the step before which it is aborted (if still unfinished)
    plan: list[int]  # what the fake model samples for output token k (deterministic, like a seeded model)

    @property
    def prompt(self) -> list[int]:
        shared = [10 + (13 * self.family + j) % 900 for j in range(SHARED_PREFIX)]
        own = [10 + (7 * int(self.request_id[1:]) + j) % 900 for j in range(self.prompt_len)]
        return (shared + own)[:self.prompt_len]

    def make_request(self) -> Request:
        return make_request(self.request_id, self.prompt, self.max_tokens, priority=self.priority, n=self.n,
                            temperature=1.0, ignore_eos=self.ignore_eos, stop_token_ids=[STOP] if self.use_stop else [])

    def token(self, index: int, k: int) -> int:
        """What the fake model samples as output token k of sequence `index`: the plan for the first sequence, a
        shifted plan (never EOS or the stop token) for its forks, so forks write different K/V."""
        return self.plan[k] if index == 0 else (self.plan[k] + 17 * index) % 990 + 10

    def tokens(self, request: Request) -> list[int]:
        """Every token the sequence has: the K/V its computed positions must hold."""
        return self.prompt + [self.token(request.index, k) for k in range(request.num_output_tokens)]

    def expected(self, max_model_len: int, index: int = 0) -> tuple[list[int], str]:
        """Sequence `index`'s full output if nothing aborts it, and its finish reason."""
        limit = min(self.max_tokens, max_model_len - self.prompt_len)
        for k in range(limit):
            token = self.token(index, k)
            if (token == EOS and not self.ignore_eos) or (token == STOP and self.use_stop):
                return [self.token(index, j) for j in range(k + 1)], "stop"
        return [self.token(index, j) for j in range(limit)], "length"


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    max_num_batched_tokens: int
    max_num_seqs: int
    chunked: bool
    specs: list[Spec]
    prefix_caching: bool = False
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"
    policy: str = "fcfs"


@st.composite
def workloads(draw) -> Workload:
    block_size = draw(st.sampled_from([1, 4, 16]))
    min_blocks = cdiv(MAX_MODEL_LEN, block_size)  # any single request fits on its own
    num_blocks = min_blocks + draw(st.integers(0, min_blocks))  # small enough to preempt sometimes
    chunked = draw(st.booleans())
    budget = draw(st.integers(1 if chunked else MAX_MODEL_LEN, 512))
    max_num_seqs = draw(st.integers(1, 8))
    p_special = draw(st.sampled_from([0.0, 0.03, 0.15]))  # how often the fake model emits eos / the stop token
    n = draw(st.integers(1, 20))
    specs = []
    for i in range(n):
        max_tokens = draw(st.integers(1, 40))
        seed = draw(st.integers(0, 2**16))
        rng = random.Random(seed)
        plan = [rng.choice((EOS, STOP)) if rng.random() < p_special else rng.randrange(10, 1000)
                for _ in range(max_tokens)]
        abort_at = draw(st.integers(0, 60)) if draw(st.integers(0, 3)) == 0 else None
        specs.append(Spec(request_id=f"r{i}", prompt_len=draw(st.integers(1, 200)), max_tokens=max_tokens,
                          family=draw(st.integers(0, 2)), priority=draw(st.integers(0, 2)),
                          n=min(draw(st.sampled_from([1, 1, 1, 2, 3])), max_num_seqs),  # as InputProcessor checks
                          arrival=draw(st.integers(0, 30)), ignore_eos=draw(st.booleans()),
                          use_stop=draw(st.booleans()), abort_at=abort_at, plan=plan))
    prefix_caching = draw(st.booleans())
    num_host_blocks = draw(st.sampled_from([0, 0, min_blocks // 2, 2 * min_blocks]))
    preemption_mode = draw(st.sampled_from(["recompute", "swap"]))
    policy = draw(st.sampled_from(["fcfs", "fcfs", "priority", "short-first"]))
    return Workload(block_size, num_blocks, budget, max_num_seqs, chunked, specs, prefix_caching, num_host_blocks,
                    preemption_mode, policy)


class FakeKVCache:
    """Which token each slot of each device and host block holds; swaps and copies applied as the workers do
    (all swap-outs, then all swap-ins, each a batched gather then scatter, then copies one after another)."""

    def __init__(self, num_blocks: int, num_host_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.device = [[None] * block_size for _ in range(num_blocks)]
        self.host = [[None] * block_size for _ in range(num_host_blocks)]

    def apply(self, out) -> None:
        gathered = [list(self.device[d]) for d, _ in out.blocks_to_swap_out]
        for (_, h), slots in zip(out.blocks_to_swap_out, gathered):
            self.host[h] = slots
        gathered = [list(self.host[h]) for h, _ in out.blocks_to_swap_in]
        for (_, d), slots in zip(out.blocks_to_swap_in, gathered):
            self.device[d] = slots
        for src, dst in out.blocks_to_copy:
            self.device[dst] = list(self.device[src])

    def check_and_write(self, scheduled, truth: list[int], blocks: list, check_from: int) -> None:
        """Check the computed positions from `check_from` on (a request's earlier positions were checked when it
        was admitted, and writes never touch a shared or cached block), then write the step's tokens."""
        bs = self.block_size
        for pos in range(check_from, scheduled.num_computed_tokens):
            held = self.device[scheduled.block_ids[pos // bs]][pos % bs]
            assert held == truth[pos], f"{scheduled.request_id}: position {pos} holds {held}, not {truth[pos]}"
        for offset, token in enumerate(scheduled.token_ids):
            pos = scheduled.num_computed_tokens + offset
            block = blocks[pos // bs]
            assert block.ref_cnt == 1 and block.block_hash is None, f"write into shared/cached block {block}"
            self.device[block.block_id][pos % bs] = token


# ---- invariants ------------------------------------------------------------------------------------------------
def check_blocks(sched: Scheduler) -> None:
    """Ref counts match the block tables exactly in both pools; free blocks are unreferenced; nothing leaks."""
    kv = sched.kv_cache_manager
    if kv.host_pool is not None:
        host_held = Counter(b.block_id for blocks in kv.req_to_host_blocks.values() for b in blocks)
        host_held.update(b.block_id for b in kv._held_host_blocks)
        kv.host_pool.check_ref_counts(host_held)
        assert kv.host_pool.num_free_blocks + len(host_held) == kv.host_pool.num_blocks
    for request_id in kv.req_to_host_blocks:
        request = sched.requests[request_id]
        assert request.status == RequestStatus.PREEMPTED and request in sched.waiting
        assert len(kv.req_to_host_blocks[request_id]) == cdiv(request.num_computed_tokens, kv.block_size)
    pool = kv.block_pool
    held = Counter(b.block_id for blocks in kv.req_to_blocks.values() for b in blocks)
    free_ids = [block.block_id for block in pool.free_queue]
    assert len(set(free_ids)) == len(free_ids), "a block is on the free list twice"
    free_set = set(free_ids)
    for block in pool.blocks:
        assert block.ref_cnt == held.get(block.block_id, 0), f"block {block.block_id} ref count"
        assert (block.ref_cnt == 0) == (block.block_id in free_set), f"block {block.block_id} free-list state"
    assert pool.num_free_blocks + len(held) == pool.num_blocks
    # Tables only exist for live requests (a waiting one may hold an empty table after a failed allocation).
    for request_id, blocks in kv.req_to_blocks.items():
        request = sched.requests.get(request_id)
        assert request is not None, f"finished request {request_id} still has a block table"
        if request.status != RequestStatus.RUNNING:
            assert blocks == [], f"{request_id} is {request.status.name} but holds blocks"


def check_running_tables(sched: Scheduler, scheduled_tokens: dict[str, int]) -> None:
    bs = sched.kv_cache_manager.block_size
    for request in sched.running:
        assert request.status == RequestStatus.RUNNING
        want = cdiv(request.num_computed_tokens + scheduled_tokens.get(request.request_id, 0), bs)
        assert len(sched.kv_cache_manager.get_block_ids(request.request_id)) == want, request.request_id
    for request in sched.waiting:
        assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert request.num_computed_tokens == 0 or sched.kv_cache_manager.is_swapped_out(request)
        assert sched.kv_cache_manager.get_block_ids(request.request_id) == []


def run_workload(w: Workload) -> tuple[Scheduler, dict[str, Request], dict[str, int]]:
    """Returns the scheduler, every sequence by id (forks included) and the step each aborted request (group id)
    was aborted at."""
    config = SchedulerConfig(max_num_seqs=w.max_num_seqs,
                             max_num_batched_tokens=w.max_num_batched_tokens, enable_chunked_prefill=w.chunked,
                             scheduling_policy=w.policy, preemption_mode=w.preemption_mode)
    kv_cache_manager = KVCacheManager(w.num_blocks, w.block_size, w.prefix_caching, w.num_host_blocks)
    sched = Scheduler(config, MAX_MODEL_LEN, kv_cache_manager)
    cache = FakeKVCache(w.num_blocks, w.num_host_blocks, w.block_size)
    worker = InputBatch()  # what a worker rebuilds from the outputs' diffs alone
    bs = w.block_size
    specs = {s.request_id: s for s in w.specs}
    requests: dict[str, Request] = {}
    aborted_at: dict[str, int] = {}
    last_arrival = max(s.arrival for s in w.specs)
    # Each step the oldest running request computes at least one token and is never preempted, so every
    # sequence needs at most max_model_len steps of its own.
    max_steps = last_arrival + sum(s.n for s in w.specs) * MAX_MODEL_LEN + 10

    step = 0
    while True:
        for s in w.specs:
            if s.arrival == step:
                requests[s.request_id] = s.make_request()
                sched.add_request(requests[s.request_id])
        to_abort = [s.request_id for s in w.specs if s.abort_at == step and s.request_id in requests]
        if to_abort:
            live = {rid for gid in to_abort for rid in sched.groups.get(gid, ())}
            aborted = sched.abort_requests(to_abort + ["no-such-request"])
            assert {r.request_id for r in aborted} == live
            for r in aborted:
                aborted_at[r.group_id] = step
                assert r.status == RequestStatus.FINISHED_ABORTED
            check_blocks(sched)
            check_running_tables(sched, {})
        if not sched.has_unfinished_requests() and step >= last_arrival:
            break
        assert step < max_steps, f"no progress after {step} steps"

        running_before = [r.request_id for r in sched.running]
        waiting_before = [r.request_id for r in sched.waiting]
        had_work = sched.has_unfinished_requests()
        out = sched.schedule()
        batch = {b.request_id: b for b in worker.update(out)}
        for new in out.new_requests:  # plain data: nothing aliases the scheduler's lists
            req = requests.get(new.request_id) or sched.requests[new.request_id]
            assert new.prompt_token_ids is not req.prompt_token_ids
            assert new.output_token_ids is not req.output_token_ids

        # -- limits
        assert out.total_num_scheduled_tokens <= w.max_num_batched_tokens
        assert len(out.scheduled) <= w.max_num_seqs
        assert len(sched.running) <= w.max_num_seqs
        assert not had_work or not out.is_empty, "unfinished requests but nothing scheduled"

        order = [s.request_id for s in out.scheduled]
        assert len(set(order)) == len(order)
        preempted = out.preempted_req_ids
        for r in preempted:
            req = requests[r]
            assert req.status == RequestStatus.PREEMPTED and sched.kv_cache_manager.get_block_ids(r) == []
            assert req.num_computed_tokens == 0 or sched.kv_cache_manager.is_swapped_out(req)
        if w.policy == "fcfs":
            check_fcfs_order(sched, out, requests, running_before, waiting_before)

        # -- each scheduled chunk: contiguous, the right tokens, room in the cache, sampled only at the end
        scheduled_tokens = {}
        for s in out.scheduled:
            req = requests[s.request_id]
            s = batch[s.request_id]  # the worker's view of the step
            spec = specs[req.group_id]
            assert req.status == RequestStatus.RUNNING
            assert s.num_tokens >= 1
            assert s.num_computed_tokens == req.num_computed_tokens
            end = s.num_computed_tokens + s.num_tokens
            assert end <= req.num_tokens <= MAX_MODEL_LEN
            truth = spec.tokens(req)
            assert s.token_ids == truth[s.num_computed_tokens:end]
            assert s.needs_sample == (end == req.num_tokens)
            if not w.chunked:
                assert s.needs_sample, "a prompt was split with chunked prefill disabled"
            assert s.block_ids == sched.kv_cache_manager.get_block_ids(s.request_id)
            assert len(s.block_ids) == cdiv(end, bs)
            scheduled_tokens[s.request_id] = s.num_tokens
        cache.apply(out)
        for s in batch.values():
            admitted = s.request_id in waiting_before or s.request_id not in running_before
            check_from = 0 if admitted else max(s.num_computed_tokens - bs, 0)
            req = requests[s.request_id]
            cache.check_and_write(s, specs[req.group_id].tokens(req),
                                  sched.kv_cache_manager.req_to_blocks[req.request_id], check_from)
        check_blocks(sched)
        check_running_tables(sched, scheduled_tokens)

        # -- the fake model
        sampled = {}
        for s in out.scheduled:
            req = requests[s.request_id]
            if s.needs_sample:  # a request about to fork samples for each of its sequences
                sampled[s.request_id] = [specs[req.group_id].token(req.index + j, req.num_output_tokens)
                                         for j in range(s.num_samples)]
        computed_before = {r: requests[r].num_computed_tokens for r in order}
        outputs_before = {r: requests[r].num_output_tokens for r in order}
        updated, finished = sched.update_from_output(out, sampled)
        for req in updated:
            if req.request_id not in requests:  # forked this step
                assert req.index > 0 and req.num_output_tokens == 1
                requests[req.request_id] = req
        assert {r.request_id for r in updated if r.num_output_tokens > 1 or r.index == 0} <= set(sampled)
        assert set(sampled) <= {r.request_id for r in updated}
        if not w.prefix_caching:
            assert sched.kv_cache_manager.block_pool.cached == {}
        for s in out.scheduled:
            req = requests[s.request_id]
            assert req.num_computed_tokens == computed_before[s.request_id] + s.num_tokens
            assert req.num_output_tokens == outputs_before[s.request_id] + (1 if s.needs_sample else 0)
        for req in finished:
            assert req.is_finished and req not in sched.running
            assert req.request_id not in sched.kv_cache_manager.req_to_blocks
        for req in sched.running:
            assert not req.is_finished
        check_blocks(sched)
        check_running_tables(sched, {})
        step += 1

    return sched, requests, aborted_at


def check_fcfs_order(sched: Scheduler, out, requests: dict[str, Request], running_before: list[str],
                     waiting_before: list[str]) -> None:
    """Running requests first (oldest first), then waiting ones in queue order; preemption takes the newest."""
    order = [s.request_id for s in out.scheduled]
    preempted = out.preempted_req_ids
    assert preempted == running_before[::-1][:len(preempted)]
    still_running = [r for r in running_before if r not in preempted]
    n_old = sum(1 for r in order if r in running_before)
    assert order[:n_old] == still_running[:n_old]
    admitted = order[n_old:]
    assert admitted == waiting_before[:len(admitted)]
    if admitted:
        assert n_old == len(still_running)
    if preempted:
        assert admitted == [], "admitted new work in a step that preempted"
        assert [r.request_id for r in sched.waiting] == preempted[::-1] + waiting_before
    assert [r.request_id for r in sched.running] == still_running + admitted


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_scheduler_invariants_on_random_workloads(w: Workload):
    note(f"block_size={w.block_size} num_blocks={w.num_blocks} budget={w.max_num_batched_tokens} "
         f"max_num_seqs={w.max_num_seqs} chunked={w.chunked} caching={w.prefix_caching} "
         f"host={w.num_host_blocks} {w.preemption_mode} {w.policy}")
    sched, requests, aborted_at = run_workload(w)
    specs_by_id = {spec.request_id: spec for spec in w.specs}

    kv = sched.kv_cache_manager
    kv.finish_step()
    assert kv.block_pool.num_free_blocks == kv.num_blocks
    assert kv.req_to_blocks == {} and kv.req_to_host_blocks == {}
    if kv.host_pool is not None:
        assert kv.host_pool.num_free_blocks == kv.host_pool.num_blocks
    assert sched.requests == {} and not sched.running and not sched.waiting
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert sched.num_preemptions_total == sum(r.num_preemptions for r in requests.values())
    event(f"preempted: {sched.num_preemptions_total > 0}")
    event(f"prefix hits: {kv.prefix_stats.hits > 0}")
    event(f"swapped: {kv.num_swapped_out_blocks > 0}")

    for req in requests.values():
        spec = specs_by_id[req.group_id]
        assert req.is_finished
        want, reason = spec.expected(MAX_MODEL_LEN, req.index)
        if req.finish_reason == "abort":
            assert spec.request_id in aborted_at
            assert req.output_token_ids == want[:req.num_output_tokens]
            assert req.num_output_tokens < len(want)
        else:
            assert req.output_token_ids == want, req.request_id
            assert req.finish_reason == reason
            if reason == "stop":
                assert req.stop_reason == (STOP if want[-1] == STOP else None)
        assert req.all_token_ids == spec.prompt + req.output_token_ids
    # Every sequence of every request that was not aborted before its first sample exists.
    num_sequences = Counter(req.group_id for req in requests.values())
    for spec in w.specs:
        assert num_sequences[spec.request_id] == spec.n or spec.request_id in aborted_at


@pytest.mark.parametrize("preemption_mode,num_host_blocks", [("recompute", 0), ("swap", 64), ("swap", 8)])
def test_tiny_pool_workload_preempts_and_completes(preemption_mode: str, num_host_blocks: int):
    """A fixed workload that must preempt (many long requests sharing a prefix, the smallest pool), run through the
    same checks, with recompute, with swap, and with a host tier too small for every swap (falls back to
    recompute)."""
    rng = random.Random(0)
    specs = [Spec(f"r{i}", prompt_len=150 + 5 * i, max_tokens=40, family=0, priority=0, n=1 + i % 2, arrival=i % 3,
                  ignore_eos=True, use_stop=False, abort_at=None, plan=[rng.randrange(10, 1000) for _ in range(40)])
             for i in range(6)]
    w = Workload(block_size=16, num_blocks=16, max_num_batched_tokens=64, max_num_seqs=4, chunked=True,
                 specs=specs, prefix_caching=True, num_host_blocks=num_host_blocks, preemption_mode=preemption_mode)
    sched, requests, _ = run_workload(w)
    assert sched.num_preemptions_total > 0
    kv = sched.kv_cache_manager
    assert kv.prefix_stats.hits > 0
    if preemption_mode == "swap":
        assert kv.num_swapped_out_blocks > 0 and kv.num_swapped_in_blocks > 0
    for spec in specs:
        assert requests[spec.request_id].output_token_ids == spec.expected(MAX_MODEL_LEN)[0]
