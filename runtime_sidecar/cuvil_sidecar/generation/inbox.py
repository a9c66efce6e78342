"""Token events from the engine thread to the streams reading them on an event loop, delivered
in batches: each event handed to its stream's delivery function (an ``asyncio.Queue``'s
``put_nowait``, or a stream's own, which may write the event out at once) on the loop.

A decode step picks a token for every running stream at once; handing each to its stream with
its own ``call_soon_threadsafe`` would wake the loop (a write to its self-pipe) once per stream
per step. ``LoopInbox`` queues them and wakes the loop only when no delivery is already due, in
the order they were put; and within ``held_deliveries()`` (the scheduler's hand-out of one
step's tokens) not before the block ends, so one step's tokens for all streams on a loop arrive
in one wake-up: a loop woken by the step's first token would otherwise take them a few at a
time, and a gRPC stream carrying several requests would write each few on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("cuvil_sidecar.generation")

_held = threading.local()  # ``inboxes``: those put into within this thread's held block


@contextlib.contextmanager
def held_deliveries() -> Iterator[None]:
    """On the calling thread: what is put into any inbox within the block wakes its loop once,
    when the block ends (nested blocks end with the outermost)."""
    if getattr(_held, "inboxes", None) is not None:
        yield
        return
    inboxes: list[LoopInbox] = []
    _held.inboxes = inboxes
    try:
        yield
    finally:
        _held.inboxes = None
        for inbox in inboxes:
            inbox.wake()


class LoopInbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[Callable[[Any], None], Any]] = []
        self._due = False  # a delivery is scheduled on the loop and has not run yet

    def put(self, deliver: Callable[[Any], None], item: Any) -> None:
        """From any thread: ``deliver(item)`` on the loop, soon (dropped once the loop is
        closed: nobody reads its streams); within ``held_deliveries``, once the block ends."""
        held = getattr(_held, "inboxes", None)
        with self._lock:
            self._pending.append((deliver, item))
            if self._due:
                return
            if held is None:
                self._due = True
        if held is not None:
            if self not in held:
                held.append(self)
            return
        self._schedule()

    def wake(self) -> None:
        """Deliver what is pending, unless a delivery is already due."""
        with self._lock:
            if self._due or not self._pending:
                return
            self._due = True
        self._schedule()

    def _schedule(self) -> None:
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            with self._lock:
                self._pending.clear()
                self._due = False

    def _deliver(self) -> None:  # on the loop
        with self._lock:
            pending, self._pending = self._pending, []
            self._due = False
        for deliver, item in pending:
            try:
                deliver(item)
            except Exception:  # one stream's failure is its own; the others get theirs
                log.exception("a token event's delivery failed")


class LoopInboxes:
    """One inbox per event loop that streams are read on (REST and gRPC may run their own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: dict[asyncio.AbstractEventLoop, LoopInbox] = {}

    def of(self, loop: asyncio.AbstractEventLoop) -> LoopInbox:
        with self._lock:
            inbox = self._inboxes.get(loop)
            if inbox is None or loop.is_closed():
                self._inboxes = {
                    open_loop: kept
                    for open_loop, kept in self._inboxes.items()
                    if not open_loop.is_closed()
                }
                inbox = self._inboxes[loop] = LoopInbox(loop)
            return inbox
