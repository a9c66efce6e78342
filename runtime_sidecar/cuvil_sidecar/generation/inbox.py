"""Token events from the engine thread to the streams reading them on an event loop, delivered
in batches.

A decode step picks a token for every running stream at once; handing each to its stream with
its own ``call_soon_threadsafe`` would wake the loop (a write to its self-pipe) once per stream
per step. ``LoopInbox`` queues them and wakes the loop only when no delivery is already due, so
one step's tokens for all streams on a loop arrive in one wake-up, in the order they were put.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any


class LoopInbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue[Any], Any]] = []
        self._due = False  # a delivery is scheduled on the loop and has not run yet

    def put(self, queue: asyncio.Queue[Any], item: Any) -> None:
        """From any thread: ``item`` into ``queue`` on the loop, soon (dropped once the loop
        is closed: nobody reads its queues)."""
        with self._lock:
            self._pending.append((queue, item))
            if self._due:
                return
            self._due = True
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
        for queue, item in pending:
            queue.put_nowait(item)


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
