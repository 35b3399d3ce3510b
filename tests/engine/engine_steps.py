"""Stepping an engine to the end in tests (a helper module the engine tests import)."""
from __future__ import annotations

from pagellm.engine.llm_engine import LLMEngine
from pagellm.exceptions import RequestFailedError
from pagellm.outputs import RequestOutput


def step_until_done(engine: LLMEngine) -> tuple[dict[str, RequestOutput], dict[str, str]]:
    """Step until no request is left; returns (the finished outputs by request id, the error of each request that
    failed). A step that fails some requests still carries the others' outputs."""
    outputs, failures = {}, {}
    while engine.has_unfinished_requests():
        try:
            finished, _ = engine.step()
        except RequestFailedError as exc:
            failures.update(exc.errors)
            finished = exc.outputs
        outputs.update((output.request_id, output) for output in finished)
    return outputs, failures
