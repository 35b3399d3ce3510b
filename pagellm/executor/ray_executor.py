"""Ray actors as workers (`--distributed-executor-backend ray`), one per rank, on any machine of a Ray cluster.

The ranks are placed with a placement group (one bundle per rank: a GPU on CUDA, a CPU otherwise), joined into
one torch.distributed group whose rendezvous is rank 0's node, and driven as the multi-process executor drives
its processes: every call goes to every rank and only the output rank's step result comes back. A step with
constrained sequences then calls the output rank once more, `sample_tokens` with the grammar bitmask computed while
the ranks ran the forward pass (after that call has returned, so the actor's two threads never race).

Without a running cluster (`ray start --head` and `RAY_ADDRESS`, or `ray.init` already called) a local Ray
instance is started. A dead actor is noticed on the next call and by a monitor that waits on a never-ending
call to each actor (actors run two calls at once for it): the executor is then dead, as with `mp`.
"""
from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any

import numpy as np

from pagellm.config import EngineConfig
from pagellm.core.sched.output import GrammarOutput, SchedulerOutput
from pagellm.exceptions import EngineDeadError
from pagellm.executor.abstract import Executor
from pagellm.logger import init_logger
from pagellm.worker.model_runner import ModelRunnerOutput

logger = init_logger(__name__)


def _import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("--distributed-executor-backend ray needs Ray: pip install 'pagellm[ray]'.") from exc
    return ray


class RayWorker:
    """The actor: a Worker created once the rendezvous address is known, and a call dispatcher."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        self.config = config
        self.rank = rank
        self.worker = None
        self._never = threading.Event()

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free port on it (rank 0's become the torch.distributed rendezvous)."""
        import socket

        import ray

        with socket.socket() as sock:
            sock.bind(("", 0))
            return ray.util.get_node_ip_address(), sock.getsockname()[1]

    def start(self, init_method: str) -> None:
        from pagellm.worker.worker import Worker

        self.worker = Worker(self.config, rank=self.rank, distributed_init_method=init_method)

    def call(self, method: str, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return None if method == "execute_model" and self.rank != self.config.parallel_config.output_rank else result

    def wait_until_stopped(self) -> None:
        """Never returns while the actor lives: the monitor's way to learn that it died."""
        self._never.wait()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address="auto" if _cluster_running() else None, log_to_driver=False)
        world_size = config.parallel_config.world_size
        on_cuda = config.device_config.device.type == "cuda"
        bundle = {"GPU": 1, "CPU": 1} if on_cuda else {"CPU": 1}
        self._placement_group = placement_group([bundle] * world_size, strategy="PACK")
        ray.get(self._placement_group.ready(), timeout=600)
        actor_class = ray.remote(num_cpus=1, num_gpus=1 if on_cuda else 0, max_concurrency=2)(RayWorker)
        self.actors = [
            actor_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._placement_group, placement_group_bundle_index=rank)).remote(config, rank)
            for rank in range(world_size)]
        self._closing = False
        try:
            host, port = ray.get(self.actors[0].node_address.remote())
            ray.get([actor.start.remote(f"tcp://{host}:{port}") for actor in self.actors])
            threading.Thread(target=_monitor, args=(weakref.ref(self), self.actors), daemon=True,
                             name="pagellm-ray-monitor").start()
        except BaseException:
            self.shutdown()
            raise
        self._start_workers()

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self.check_health()
        return self._get([actor.call.remote(method, *args) for actor in self.actors])

    def execute_model(self, output: SchedulerOutput, bitmask: Future[np.ndarray] | None = None) -> ModelRunnerOutput:
        output_rank = self.config.parallel_config.output_rank
        result = self.collective_rpc("execute_model", output)[output_rank]
        if result is None:  # the output rank waits for the bitmask, computed meanwhile, to sample
            [result] = self._get([self.actors[output_rank].call.remote(
                "sample_tokens", GrammarOutput.from_future(bitmask))])
        return result

    def _get(self, refs: list) -> list[Any]:
        """The calls' results; a dead actor (or a failed rank of several) makes the executor dead."""
        try:
            return self._ray.get(refs)
        except self._ray.exceptions.RayActorError as exc:
            raise EngineDeadError(self._fail(f"A Ray worker died: {exc}")) from exc
        except self._ray.exceptions.RayTaskError as exc:
            if len(self.actors) > 1:  # the other ranks may wait in a collective this one never reached
                raise EngineDeadError(self._fail(f"A Ray worker failed: {exc}")) from exc
            raise RuntimeError(str(exc)) from exc

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for actor in getattr(self, "actors", []):
            self._ray.kill(actor)
        self._ray.util.remove_placement_group(self._placement_group)

    def _kill_workers(self) -> None:
        for actor in self.actors:
            self._ray.kill(actor)


def _cluster_running() -> bool:
    return bool(os.environ.get("RAY_ADDRESS"))


def _monitor(executor_ref: weakref.ref, actors: list) -> None:
    """Wait on each actor's never-ending call; the first to end means an actor died (unless shutting down)."""
    import ray

    waits = [actor.wait_until_stopped.remote() for actor in actors]
    ray.wait(waits, num_returns=1, timeout=None)
    executor = executor_ref()
    if executor is not None and not executor._closing:
        executor._fail("A Ray worker actor exited unexpectedly.")
