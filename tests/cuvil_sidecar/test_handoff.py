"""Handoff (cuvil_sidecar/handoff.py): inside an asyncio task it is run_in_executor; driven by
the native front end, the awaiting call goes on from the worker thread that ran the work."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from cuvil_sidecar.handoff import Handoff, drive


def _worker_ident(executor: ThreadPoolExecutor) -> int:
    return executor.submit(threading.get_ident).result()


def test_in_a_task_it_is_run_in_executor() -> None:
    async def main(executor: ThreadPoolExecutor) -> tuple[int, int, int]:
        result = await Handoff(executor, lambda x: x + 1, 41)
        with pytest.raises(ZeroDivisionError):
            await Handoff(executor, lambda: 1 / 0)
        return result, threading.get_ident(), _worker_ident(executor)

    with ThreadPoolExecutor(1) as executor:
        result, after, worker = asyncio.run(main(executor))
    assert result == 42
    assert after != worker  # the task went on on the loop's thread


def test_driven_the_call_goes_on_on_the_worker() -> None:
    seen: dict[str, Any] = {}
    done = threading.Event()
    variable: contextvars.ContextVar[str] = contextvars.ContextVar("variable")

    async def call(executor: ThreadPoolExecutor) -> None:
        variable.set("set before")
        # (work that takes a while: done before drive() hands it over, it would go on here)
        seen["result"] = await Handoff(executor, lambda: time.sleep(0.05) or 7)
        seen["thread"] = threading.get_ident()
        seen["variable"] = variable.get()  # the call's own context, on the worker too
        try:
            await Handoff(executor, lambda: 1 / 0)
        except ZeroDivisionError:
            seen["error"] = True
        done.set()

    with ThreadPoolExecutor(1) as executor:
        waited: list[Any] = []
        drive(call(executor), contextvars.copy_context(), lambda *args: waited.append(args))
        assert done.wait(5)
        worker = _worker_ident(executor)
    assert waited == []  # nothing went to the loop
    assert seen == {"result": 7, "thread": worker, "variable": "set before", "error": True}


def test_what_else_a_driven_call_waits_for_goes_to_the_loop() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        results: list[int] = []

        async def call(executor: ThreadPoolExecutor) -> None:
            results.append(await Handoff(executor, lambda: 1, resume_on_worker=False))
            results.append(await future)

        parked: list[Any] = []
        with ThreadPoolExecutor(1) as executor:
            coroutine = call(executor)
            drive(coroutine, contextvars.copy_context(), lambda *args: parked.append(args))
            # not resumed on the worker: the executor's asyncio future went to on_wait
            assert len(parked) == 1 and asyncio.isfuture(parked[0][2])
            waiting = asyncio.ensure_future(_finish(coroutine, parked[0][2]))
            await asyncio.sleep(0.05)
            future.set_result(2)
            await waiting
        assert results == [1, 2]

    asyncio.run(main())


async def _finish(coroutine: Any, first: asyncio.Future[Any]) -> None:
    """Drive the rest of ``coroutine`` as a task would, starting with ``first``'s result."""
    value = await first
    while True:
        try:
            waited = coroutine.send(value)
        except StopIteration:
            return
        waited._asyncio_future_blocking = False
        value = await waited
