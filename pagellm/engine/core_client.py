"""Engine-core clients: how AsyncLLM reaches the engine core(s) that run its requests.

- `InprocClient`: one EngineCore stepped by a thread of this process (the default).
- `DPClient` (dp_client.py): `--data-parallel-size` engine replicas, each an EngineCore in a child process
  (core_proc.py), each request routed to one of them.

Requests and aborts are the hot path, with methods of their own; everything else a front end asks of a core goes
through `call_utility(engine_index, name, *args)`, which runs the `@utility` method `name` of that EngineCore
(engine/core.py) between two of its steps and resolves a Future with the result.

Every client reports back through two callbacks given to `start`: `on_update(engine_index, CoreUpdate)` after each
pass of a core's loop, and `on_dead(reason)` once, when a core can no longer run. Both, and the callbacks of the
futures `call_utility` returns, may be called from any thread of the client's.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from pagellm.core.beam_group import BeamGroup
from pagellm.core.request import Request
from pagellm.engine.core import EngineCore
from pagellm.engine.core_loop import EngineCoreLoop
from pagellm.engine.core_output import CoreUpdate
from pagellm.metrics.stats import SchedulerStats

UpdateCallback = Callable[[int, CoreUpdate], None]
DeadCallback = Callable[[str], None]


class EngineCoreClient(ABC):
    num_engines: int = 1

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """The device KV blocks of the smallest engine: what a single request may use at most."""

    @abstractmethod
    def initial_stats(self) -> list[SchedulerStats]:
        """Each engine's scheduler snapshot before its first step."""

    @abstractmethod
    def start(self, on_update: UpdateCallback, on_dead: DeadCallback) -> None:
        """Start the engines' loops; from here on they report through the callbacks."""

    @abstractmethod
    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> int:
        """Queue a request, or the first beam of a beam search with its group (refusals come back in a CoreUpdate);
        returns the index of the engine it went to."""

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort these requests (user request ids) wherever they run; unknown ids are ignored."""

    @abstractmethod
    def call_utility(self, engine_index: int, method: str, *args: Any) -> Future:
        """Have engine `engine_index` run `EngineCore.call_utility(method, *args)` between two steps; the future
        gets the result, or the exception raised (EngineDeadError if the engine stopped first)."""

    @abstractmethod
    def num_fitting(self, demands: Iterable[tuple[int, int]]) -> int:
        """How many of these (sequence slots, tokens) demands, in order, idle engines can hold at once."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop every engine; requests in flight are aborted."""


class InprocClient(EngineCoreClient):
    def __init__(self, build_core: Callable[[], EngineCore], max_waiting_requests: int | None = None) -> None:
        """The core is built by `build_core` on the loop's thread, which then steps it (see core_loop.py)."""
        self._loop = EngineCoreLoop(build_core, max_waiting_requests)
        self.core = self._loop.core  # touched only by the loop's thread once that runs

    @property
    def num_blocks(self) -> int:
        return self.core.num_blocks

    def initial_stats(self) -> list[SchedulerStats]:
        return [self.core.scheduler.stats()]

    def start(self, on_update: UpdateCallback, on_dead: DeadCallback) -> None:
        self._loop.start(lambda update: on_update(0, update), on_dead)

    def add_request(self, request: Request, beam_group: BeamGroup | None = None) -> int:
        self._loop.add_request(request, beam_group)
        return 0

    def abort_requests(self, request_ids: list[str]) -> None:
        self._loop.abort_requests(request_ids)

    def call_utility(self, engine_index: int, method: str, *args: Any) -> Future:
        return self._loop.call_utility(method, *args)

    def num_fitting(self, demands: Iterable[tuple[int, int]]) -> int:
        return self.core.scheduler.num_fitting(demands)  # reads only constants: safe from any thread

    def shutdown(self) -> None:
        self._loop.shutdown()
