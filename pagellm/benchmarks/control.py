"""`pagellm bench control`: what the worker boundary costs per step.

Two figures, both at a fixed decode batch:
- transport: one step's SchedulerOutput pickled, sent to a worker process over a pipe and answered with the
  driver's result (a ModelRunnerOutput of the same batch), the way the `mp` executor does it, with no model;
- end to end: decode steps of the same batch through the `uni` executor (the model in this process) and the `mp`
  executor (the model in a worker process), and their difference: everything a step pays for the boundary,
  including the worker's own bookkeeping.
"""
from __future__ import annotations

import argparse
import multiprocessing
import pickle
import time
from dataclasses import replace
from multiprocessing.connection import Connection

from pagellm.benchmarks.machine import machine_header
from pagellm.core.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput
from pagellm.engine.arg_utils import EngineArgs
from pagellm.engine.llm_engine import LLMEngine
from pagellm.sampling_params import SamplingParams
from pagellm.worker.model_runner import ModelRunnerOutput


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch-size", type=int, default=64, help="decoding sequences per step")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=32, help="decode steps measured per executor")


def decode_step_output(batch_size: int, context_len: int, block_size: int = 16) -> SchedulerOutput:
    """A steady-state decode step as the scheduler sends it: one new token and, now and then, one new block."""
    scheduled = [ScheduledRequest(f"r{i}", 1, context_len, new_token_ids=[1000 + i],
                                  new_block_ids=[i] if i % block_size == 0 else [])
                 for i in range(batch_size)]
    return SchedulerOutput(scheduled=scheduled, finished_req_ids=["done"])


def _echo(conn: Connection, reply: bytes) -> None:
    while True:
        message = conn.recv_bytes()
        if message == b"stop":
            return
        pickle.loads(message)
        conn.send_bytes(reply)


def transport_ms(output: SchedulerOutput, batch_size: int, repeats: int = 200) -> float:
    """Mean milliseconds for the driver to pickle and send a step and receive and unpickle the reply."""
    result = ModelRunnerOutput({f"r{i}": [7] for i in range(batch_size)})
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    process = context.Process(target=_echo, args=(child, pickle.dumps(("ok", result))), daemon=True)
    process.start()
    try:
        for timed in (False, True):  # the first round waits for the process to start
            start = time.perf_counter()
            for _ in range(repeats if timed else 1):
                parent.send_bytes(pickle.dumps(("execute_model", (output,)), protocol=pickle.HIGHEST_PROTOCOL))
                pickle.loads(parent.recv_bytes())
        return 1e3 * (time.perf_counter() - start) / repeats
    finally:
        parent.send_bytes(b"stop")
        process.join(10)


def decode_step_ms(args: EngineArgs, batch_size: int, input_len: int, steps: int) -> float:
    """Mean milliseconds per decode step of `batch_size` sequences (after their prefill)."""
    engine = LLMEngine.from_engine_args(args)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=steps + 2, ignore_eos=True)
        for i in range(batch_size):
            engine.add_request(str(i), {"prompt_token_ids": [100 + (i + j) % 5000 for j in range(input_len)]}, params)
        while any(r.num_output_tokens == 0 for r in engine.engine_core.scheduler.running) or \
                engine.engine_core.scheduler.waiting:
            engine.step()
        engine.step()  # the first decode step warms up
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        return 1e3 * (time.perf_counter() - start) / steps
    finally:
        engine.shutdown()


def run(args: argparse.Namespace) -> None:
    engine_args = EngineArgs.from_cli_args(args)
    output = decode_step_output(args.batch_size, args.input_len)
    first_step = replace(output, new_requests=[NewRequestData(f"r{i}", list(range(args.input_len)), [],
                                                              SamplingParams()) for i in range(args.batch_size)])
    print(machine_header())
    print(f"transport, batch {args.batch_size}: steady decode step {transport_ms(output, args.batch_size):.3f} ms "
          f"({len(pickle.dumps(output))} bytes); a step adding {args.batch_size} sequences "
          f"{transport_ms(first_step, args.batch_size, repeats=50):.3f} ms ({len(pickle.dumps(first_step))} bytes)")
    timings = {backend: decode_step_ms(replace(engine_args, distributed_executor_backend=backend), args.batch_size,
                                       args.input_len, args.steps)
               for backend in ("uni", "mp")}
    print(f"decode step, batch {args.batch_size}: uni {timings['uni']:.2f} ms, mp {timings['mp']:.2f} ms, "
          f"boundary cost {timings['mp'] - timings['uni']:+.2f} ms per step")
