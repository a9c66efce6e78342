"""ModelStreamInfer on grpcio's server: every request read from the stream is answered as it
completes, while the next ones are read, so that a client streaming many requests has them
batched together as concurrent unary calls would be. A request may have several answers (a
generation model's, one per token: Triton's decoupled mode); they go out as they come,
interleaved with other requests' answers.

Each answer is a ``ModelStreamInferResponse`` (``wire.EncodedStreamResponse``): an inference's
response, or its error message with the request's id, so one bad request does not end the
stream. The native front end streams in C++ and calls the same per-message answer
(``InferenceServicer.stream_message``) for each message.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any


async def serve_stream(
    requests: AsyncIterator[Any], answer: Callable[[Any], AsyncIterator[Any]]
) -> AsyncIterator[Any]:
    """The answers to ``requests``, each as it comes; ends once the client has stopped sending
    and every request is answered. ``answer`` yields one request's answers and must not raise;
    when the client goes away, every ``answer`` still running is cancelled."""
    answers: asyncio.Queue[Any] = asyncio.Queue()
    finished_reading, answered = object(), object()
    running: set[asyncio.Task[Any]] = set()
    unanswered = 0  # requests read whose answers have not all been sent

    async def relay(request: Any) -> None:
        try:
            async for item in answer(request):
                answers.put_nowait(item)
        finally:
            answers.put_nowait(answered)

    async def read() -> None:
        nonlocal unanswered
        try:
            async for request in requests:
                unanswered += 1
                task = asyncio.ensure_future(relay(request))
                running.add(task)
                task.add_done_callback(running.discard)
        finally:
            answers.put_nowait(finished_reading)

    reader = asyncio.ensure_future(read())
    reading = True
    try:
        while reading or unanswered:
            item = await answers.get()
            if item is finished_reading:
                reading = False
            elif item is answered:
                unanswered -= 1
            else:
                yield item
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()
