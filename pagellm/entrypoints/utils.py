"""asyncio helpers for the server: merging the streams of a batch of prompts, and cancelling a handler whose
client has disconnected."""
from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncGenerator[tuple[int, T], None]:
    """Yield (index of the iterator, item) as items arrive from any of them. Closing the merged iterator (or an
    error in one) cancels the others, which aborts their requests."""
    if len(iterators) == 1:
        async for item in iterators[0]:
            yield 0, item
        return
    loop = asyncio.get_running_loop()
    pending = {loop.create_task(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[loop.create_task(anext(iterators[index]))] = index
                yield index, item
    finally:
        # Every live iterator has a pending anext(); cancelling it runs that generator's cleanup (its abort).
        for task in pending:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*pending, return_exceptions=True)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Cancel the handler (and so abort its requests) when the client disconnects before it returns. The
    decorated handler must take the Starlette request as `raw_request`."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        handler_task = asyncio.create_task(handler(*args, **kwargs))
        disconnect_task = asyncio.create_task(_wait_for_disconnect(kwargs["raw_request"]))
        try:
            done, _ = await asyncio.wait((handler_task, disconnect_task), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller was cancelled (a cancelled batch job, a server shutdown)
            handler_task.cancel()
            raise
        finally:
            disconnect_task.cancel()
        if handler_task not in done:
            handler_task.cancel()
            return None
        return handler_task.result()

    return wrapper
