"""ModelStreamInfer on grpcio's server: every request read from the stream is answered as it
completes, while the next ones are read, so that a client streaming many requests has them
batched together as concurrent unary calls would be.

Each answer is a ``ModelStreamInferResponse`` (``wire.EncodedStreamResponse``): an inference's
response, or its error message with the request's id, so one bad request does not end the
stream. The native front end streams in C++ and calls the same per-message answer
(``InferenceServicer.stream_message``) for each message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any


async def serve_stream(
    requests: AsyncIterator[Any], answer: Callable[[Any], Awaitable[Any]]
) -> AsyncIterator[Any]:
    """The answers to ``requests``, in the order they complete; ends once the client has
    stopped sending and every request is answered. ``answer`` must not raise."""
    answers: asyncio.Queue[Any] = asyncio.Queue()
    finished_reading = object()
    running: set[asyncio.Task[Any]] = set()

    def answered(task: asyncio.Task[Any]) -> None:
        running.discard(task)
        if not task.cancelled():
            answers.put_nowait(task.result())

    async def read() -> None:
        try:
            async for request in requests:
                task = asyncio.ensure_future(answer(request))
                running.add(task)
                task.add_done_callback(answered)
        finally:
            answers.put_nowait(finished_reading)

    reader = asyncio.ensure_future(read())
    reading = True
    try:
        while reading or running or not answers.empty():
            item = await answers.get()
            if item is finished_reading:
                reading = False
            else:
                yield item
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()
