"""Token events handed from an engine thread to queues on an event loop: all delivered, in
order, with far fewer loop wake-ups than events, and one per held block (a decode step's
tokens); nothing raised once the loop is closed."""

from __future__ import annotations

import asyncio
import threading

from cuvil_sidecar.generation.inbox import LoopInbox, LoopInboxes, held_deliveries


def counted_wake_ups(loop: asyncio.AbstractEventLoop) -> list[int]:
    """A one-item list that counts the loop's ``call_soon_threadsafe`` calls from now on."""
    count = [0]
    schedule = loop.call_soon_threadsafe

    def counted(callback, *args):  # type: ignore[no-untyped-def]
        count[0] += 1
        return schedule(callback, *args)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return count


def test_events_from_another_thread_arrive_in_order_with_few_wake_ups() -> None:
    async def main() -> tuple[list[int], list[int], int]:
        loop = asyncio.get_running_loop()
        wake_ups = counted_wake_ups(loop)
        inbox = LoopInbox(loop)
        left: asyncio.Queue[int] = asyncio.Queue()
        right: asyncio.Queue[int] = asyncio.Queue()

        def engine() -> None:  # steps of two streams' tokens, as a scheduler emits them
            for step in range(200):
                inbox.put(left.put_nowait, step)
                inbox.put(right.put_nowait, step)

        thread = threading.Thread(target=engine)
        thread.start()
        got_left = [await asyncio.wait_for(left.get(), 10) for _ in range(200)]
        got_right = [await asyncio.wait_for(right.get(), 10) for _ in range(200)]
        thread.join()
        return got_left, got_right, wake_ups[0]

    got_left, got_right, wake_ups = asyncio.run(main())
    assert got_left == got_right == list(range(200))
    assert 1 <= wake_ups < 400  # one per batch of events, not one per event


def test_a_held_block_wakes_each_loop_once_with_all_its_events() -> None:
    """Sixteen streams' tokens of each step put within ``held_deliveries``, slowly (the engine
    thread's work between two puts): every step reaches the loop in one wake-up, whole."""

    async def main() -> tuple[int, list[int], list[list[int]]]:
        loop = asyncio.get_running_loop()
        wake_ups = counted_wake_ups(loop)
        inbox = LoopInbox(loop)
        queues: list[asyncio.Queue[int]] = [asyncio.Queue() for _ in range(16)]
        seen: list[int] = []  # how many events the loop found at each of its looks
        step_done = threading.Event()

        def engine() -> None:
            for step in range(5):
                with held_deliveries():
                    for queue in queues:
                        inbox.put(queue.put_nowait, step)
                        threading.Event().wait(0.001)  # a loop woken now would see a few
                assert step_done.wait(10)
                step_done.clear()

        thread = threading.Thread(target=engine)
        thread.start()
        got: list[list[int]] = [[] for _ in queues]
        for _ in range(5):
            got[0].append(await asyncio.wait_for(queues[0].get(), 10))
            seen.append(1 + sum(q.qsize() for q in queues))
            for index, queue in enumerate(queues[1:], 1):
                got[index].append(queue.get_nowait())
            step_done.set()
        thread.join()
        return wake_ups[0], seen, got

    wake_ups, seen, got = asyncio.run(main())
    assert wake_ups == 5 and seen == [16] * 5
    assert all(tokens == list(range(5)) for tokens in got)


def test_a_closed_loop_drops_events_without_raising() -> None:
    loop = asyncio.new_event_loop()
    inboxes = LoopInboxes()
    inbox = inboxes.of(loop)
    loop.close()
    inbox.put(asyncio.Queue().put_nowait, 1)  # the engine thread goes on; nobody reads that stream
    fresh = asyncio.new_event_loop()
    try:
        assert inboxes.of(fresh) is not inbox and inboxes.of(fresh) is inboxes.of(fresh)
    finally:
        fresh.close()
