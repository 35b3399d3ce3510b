"""DPClient: `--data-parallel-size` engine replicas behind one AsyncLLM, each request routed to one of them.

Each replica is an EngineCore with its own scheduler, KV cache and tp x pp ranks, in a process of its own
(core_proc.py); they load their models at the same time. A LoadAwareRouter picks each new request's replica; this
client remembers where every live request runs, so aborts and stop-string finishes reach the right one, and it
releases a request from the router's count when its replica reports it gone. One replica dying makes the whole
client dead (the server fails every request in flight and turns /health to 503; the other replicas idle until
it shuts down): a partly working server would fail some requests at random.
"""
from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Any

from pagellm.config import EngineConfig
from pagellm.core.beam_group import BeamGroup
from pagellm.core.kv.kv_cache_manager import cdiv
from pagellm.core.request import Request
from pagellm.engine.core_client import DeadCallback, EngineCoreClient, UpdateCallback
from pagellm.engine.core_output import CoreUpdate
from pagellm.engine.core_proc import EngineReplica
from pagellm.engine.dp_router import LoadAwareRouter
from pagellm.metrics.stats import SchedulerStats


class DPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None) -> None:
        parallel = config.parallel_config
        self.num_engines = parallel.data_parallel_size
        self.config = config
        self.replicas = [
            EngineReplica(dataclasses.replace(config, parallel_config=dataclasses.replace(parallel,
                                                                                         data_parallel_rank=rank)),
                          max_waiting_requests, rank)
            for rank in range(self.num_engines)]
        try:
            for replica in self.replicas:
                replica.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.router = LoadAwareRouter(self.initial_stats(), config.cache_config.block_size,
                                      config.cache_config.enable_prefix_caching)
        self._lock = threading.Lock()  # the router and the owners: the event loop routes, readers release
        self._owners: dict[str, int] = {}  # live request id -> its replica
        self._on_update: UpdateCallback | None = None

    @property
    def num_blocks(self) -> int:
        return min(replica.num_blocks for replica in self.replicas)

    def initial_stats(self) -> list[SchedulerStats]:
        return [replica.initial_stats for replica in self.replicas]

    def start(self, on_update: UpdateCallback, on_dead: DeadCallback) -> None:
        self._on_update = on_update
        dead = threading.Event()

        def replica_dead(reason: str) -> None:
            if not dead.is_set():
                dead.set()
                on_dead(reason)

        for replica in self.replicas:
            replica.start(self._update, replica_dead)

    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> int:
        with self._lock:
            replica = self.router.route(request)
            self._owners[request.request_id] = replica
        self.replicas[replica].add_request(request, beam_group)
        return replica

    def abort_requests(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        with self._lock:
            for request_id in request_ids:
                replica = self._owners.get(request_id)
                if replica is not None:
                    by_replica.setdefault(replica, []).append(request_id)
        for replica, ids in by_replica.items():
            self.replicas[replica].abort_requests(ids)

    def call_utility(self, engine_index: int, method: str, *args: Any) -> Future:
        return self.replicas[engine_index].call_utility(method, *args)

    def num_fitting(self, demands: Iterable[tuple[int, int]]) -> int:
        """As each replica's scheduler counts, with every demand placed on the replica with the most free blocks."""
        sched = self.config.scheduler_config
        free = [[sched.max_num_seqs, replica.num_blocks] for replica in self.replicas]
        fitting = 0
        for num_seqs, num_tokens in demands:
            slot = max(free, key=lambda f: (f[1], f[0]))
            num_blocks = cdiv(num_tokens, self.config.cache_config.block_size)
            if slot[0] < num_seqs or slot[1] < num_blocks:
                break
            slot[0] -= num_seqs
            slot[1] -= num_blocks
            fitting += 1
        return fitting

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    def _update(self, engine_index: int, update: CoreUpdate) -> None:
        """On a replica's reader thread: keep the router current, then pass the update on."""
        gone = [*update.left, *update.refused]
        with self._lock:
            self.router.observe(engine_index, update.stats)
            self.router.release(engine_index, sum(self._owners.pop(r, None) is not None for r in gone))
        self._on_update(engine_index, update)
