"""Work handed to a worker thread, and where the awaiting call goes on afterwards.

``await Handoff(executor, fn, *args)`` runs ``fn`` on ``executor``. Awaited inside an asyncio
task it is ``loop.run_in_executor``: when ``fn`` returns, the event loop wakes and resumes the
task. The native front end drives its calls itself (``drive``), and for those a handoff with
``resume_on_worker`` set goes on where ``fn`` ended: the worker thread resumes the call and
runs it to its end (encoding the response and sending it), so the event loop is never woken
for it. That wake-up is dear after a long run: the loop has slept through the run, and its
first turn runs with cold caches, on every call.

Code that runs after such an await may therefore run on a worker thread: it must not touch the
event loop (no asyncio calls; thread-safe counters), which holds for the data plane's path from
a model's run to the response. Should a call resumed on a worker await an asyncio future after
all, ``drive`` hands it back to the loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable, Coroutine, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_driving = threading.local()  # .active: a drive() step is running on this thread


class Handoff(Generic[T]):
    def __init__(
        self,
        executor: concurrent.futures.Executor,
        fn: Callable[..., T],
        *args: Any,
        resume_on_worker: bool = True,
    ) -> None:
        self.executor = executor
        self.fn = fn
        self.args = args
        self.resume_on_worker = resume_on_worker

    def __await__(self) -> Generator[Any, Any, T]:
        if self.resume_on_worker and getattr(_driving, "active", False):
            return (yield self)  # drive() submits it and sends back fn's result
        loop = asyncio.get_running_loop()
        return (yield from loop.run_in_executor(self.executor, self.fn, *self.args).__await__())


Call = Coroutine[Any, Any, Any]
OnWait = Callable[[Call, contextvars.Context, Any], None]


def drive(
    coroutine: Call,
    context: contextvars.Context,
    on_wait: OnWait,
    value: Any = None,
    error: BaseException | None = None,
) -> None:
    """Run ``coroutine`` (in ``context``) on this thread until it ends or waits. A ``Handoff``
    it waits for is submitted here and the coroutine is driven on from its worker once done;
    anything else it waits for goes to ``on_wait(coroutine, context, waited)``, which must get
    it to the event loop."""
    _driving.active = True
    try:
        if error is not None:
            waited = context.run(coroutine.throw, error)
        else:
            waited = context.run(coroutine.send, value)
    except StopIteration:
        return
    finally:
        _driving.active = False
    if not isinstance(waited, Handoff):
        on_wait(coroutine, context, waited)
        return

    def resume(done: concurrent.futures.Future[Any]) -> None:
        failure = done.exception()
        if failure is not None:
            drive(coroutine, context, on_wait, error=failure)
        else:
            drive(coroutine, context, on_wait, value=done.result())

    try:
        future = waited.executor.submit(waited.fn, *waited.args)
    except BaseException as refused:  # the executor is shut down
        drive(coroutine, context, on_wait, error=refused)
        return
    future.add_done_callback(resume)
