"""Token events handed from an engine thread to queues on an event loop: all delivered, in
order, with far fewer loop wake-ups than events; nothing raised once the loop is closed."""

from __future__ import annotations

import asyncio
import threading

from cuvil_sidecar.generation.inbox import LoopInbox, LoopInboxes


def test_events_from_another_thread_arrive_in_order_with_few_wake_ups() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        wake_ups = 0
        schedule = loop.call_soon_threadsafe

        def counted(callback, *args):  # type: ignore[no-untyped-def]
            nonlocal wake_ups
            wake_ups += 1
            return schedule(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        inbox = LoopInbox(loop)
        left: asyncio.Queue[int] = asyncio.Queue()
        right: asyncio.Queue[int] = asyncio.Queue()

        def engine() -> None:  # steps of two streams' tokens, as a scheduler emits them
            for step in range(200):
                inbox.put(left, step)
                inbox.put(right, step)

        thread = threading.Thread(target=engine)
        thread.start()
        got_left = [await asyncio.wait_for(left.get(), 10) for _ in range(200)]
        got_right = [await asyncio.wait_for(right.get(), 10) for _ in range(200)]
        thread.join()
        return got_left, got_right, wake_ups

    got_left, got_right, wake_ups = asyncio.run(main())
    assert got_left == got_right == list(range(200))
    assert 1 <= wake_ups < 400  # one per batch of events, not one per event


def test_a_closed_loop_drops_events_without_raising() -> None:
    loop = asyncio.new_event_loop()
    inboxes = LoopInboxes()
    inbox = inboxes.of(loop)
    loop.close()
    inbox.put(asyncio.Queue(), 1)  # the engine thread goes on; nobody reads that stream
    fresh = asyncio.new_event_loop()
    try:
        assert inboxes.of(fresh) is not inbox and inboxes.of(fresh) is inboxes.of(fresh)
    finally:
        fresh.close()
